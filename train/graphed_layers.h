// GraphedLayers: a list of layers captured as one graph per layer, pass
// and microbatch, in the order a pipeline schedule gives, all planned into
// one pool (TransformerEngine's make_graphed_callables with `_order`, done
// by the planner):
//
//   auto graphed = GraphedLayers::capture(ctx, {&attention, &mlp}, {x_meta, x_meta, x_meta, x_meta},
//                                         PipelineSchedule::one_f_one_b(4, 1));
//   for (const PipelinePass& pass : graphed->schedule().passes()) {
//     if (pass.kind == PipelinePass::Kind::kForward) send(graphed->forward(pass.microbatch, recv_x()));
//     else send(graphed->backward(pass.microbatch, recv_dy()));
//   }
//   graphed->gradient_sums();  // summed over the microbatches
//
// The step traced is LayerPipeline's (layer_pipeline.h) over the
// schedule's passes, with each microbatch's input and output gradient at
// fixed addresses (persistent: input(m), grad_output(m)). Its segments are
// the per-layer graphs; the planner sees them all in the schedule's order,
// so a saved activation lives from its forward to its microbatch's backward
// and its memory is reused as soon as that backward has read it: the pool is
// planned for the schedule as a whole, not per graph.
//
// Note [Per-layer graphs run in the captured order]
// The pool's offsets reuse memory in the schedule's order, so a graph run
// out of that order could overwrite a value another graph still needs.
// Every replay call therefore checks that its graph is the one the schedule
// runs next (an Error naming it otherwise); after the last, the schedule
// starts over. Each pass's output, output(m) and grad_input(m), stays valid
// until that pass runs again in the next iteration.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "graphs/pool_report.h"
#include "layers/any_layer.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"

namespace stepgraph {

struct GraphedLayersOptions {
  PoolReportPolicy pool_report_policy = PoolReportPolicy::kError;
  LayerPipelineOptions pipeline;
};

class GraphedLayers {
 public:
  // `inputs`: each microbatch's input shape and dtype (one per microbatch
  // of the schedule). The context and layers must outlive the result.
  static std::unique_ptr<GraphedLayers> capture(Context& ctx, std::vector<AnyLayer*> layers,
                                                std::vector<TensorMeta> inputs, const PipelineSchedule& schedule,
                                                const GraphedLayersOptions& options = {});
  GraphedLayers(const GraphedLayers&) = delete;
  GraphedLayers& operator=(const GraphedLayers&) = delete;

  // Replays microbatch m's forward: every layer's graph in turn, after
  // copying `x` into input(m) (unless x is undefined or input(m) itself).
  // Returns output(m). An Error unless it is the schedule's next pass.
  // `source_streams`: as for CapturedStep::replay (Note [Sources the caller
  // reuses] in graphs/captured_step.h).
  const Tensor& forward(std::int64_t m, const Tensor& x = {}, std::span<CUstream_st* const> source_streams = {});
  // Replays microbatch m's backward, last layer first, after copying `dy`
  // into grad_output(m); returns grad_input(m) (undefined where the first
  // layer computes no dx).
  const Tensor& backward(std::int64_t m, const Tensor& dy = {}, std::span<CUstream_st* const> source_streams = {});
  // Replays one layer's graph of a pass: the graph the schedule runs next
  // (forward and backward are these, layer by layer). `source` is bound as
  // above, to the first layer's forward or the last layer's backward only.
  void replay_layer(const PipelinePass& pass, std::size_t layer, const Tensor& source = {},
                    std::span<CUstream_st* const> source_streams = {});
  // The name of the graph the schedule runs next: "B1 layer 0 (linear)".
  std::string next_graph() const;

  const Tensor& input(std::int64_t m) const;
  const Tensor& grad_output(std::int64_t m) const;
  const Tensor& output(std::int64_t m) const;
  const Tensor& grad_input(std::int64_t m) const;
  // See LayerPipeline::gradient_sums.
  const std::vector<Tensor>& gradient_sums() const { return pipeline_.gradient_sums(); }
  const PipelineSchedule& schedule() const { return schedule_; }
  std::size_t graph_count() const { return step_->segment_count(); }
  // The one captured step whose segments are the graphs: its plan (pool
  // bytes and lower bound), program and report.
  const CapturedStep& step() const { return *step_; }

 private:
  GraphedLayers(Context& ctx, std::vector<AnyLayer*> layers, const PipelineSchedule& schedule,
                const GraphedLayersOptions& options);
  std::size_t graph_index(std::size_t pass, std::size_t layer) const;
  std::size_t pass_index(const PipelinePass& pass) const;

  Context& ctx_;
  PipelineSchedule schedule_;
  LayerPipeline pipeline_;
  std::vector<Tensor> inputs_, grad_outputs_, outputs_, grad_inputs_;  // per microbatch
  std::shared_ptr<CapturedStep> step_;
  std::size_t next_ = 0;  // the graph the schedule runs next
};

}  // namespace stepgraph
