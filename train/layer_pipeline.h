// LayerPipeline: a list of layers run as one pipeline stage over several
// microbatches, each pass (a microbatch's forward or backward through every
// layer) when the caller's schedule says (train/pipeline_schedule.h):
//
//   LayerPipeline stage(ctx, {&attention, &mlp}, /*microbatches=*/4);
//   const PipelineSchedule schedule = PipelineSchedule::one_f_one_b(4, 1);
//   for (const PipelinePass& pass : schedule.passes()) {
//     const std::int64_t m = pass.microbatch;
//     if (pass.kind == PipelinePass::Kind::kForward) y[m] = stage.forward(ctx, m, x[m]);
//     else dx[m] = stage.backward(ctx, m, dy[m]);
//   }
//   stage.gradient_sums();  // every parameter's gradient, summed over the microbatches
//
// It keeps each microbatch's saved state from its forward to its backward.
// The same calls run eager or traced: GraphedLayers (graphed_layers.h)
// traces them in the schedule's order into one program whose segments are
// the per-layer graphs. Each layer's part of a pass starts its own segment,
// named "F2 layer 1 (layernorm_mlp)".
//
// Note [Gradients summed over microbatches]
// A layer's backward overwrites its parameters' gradients. With
// accumulate_gradients, each layer's backward is followed by a copy of its
// gradients into a persistent fp32 sum (the iteration's first backward of
// that layer) or an add to it (the others), so after every microbatch's
// backward the sums hold the iteration's gradient, in the schedule's order
// of additions. An iteration ends when every microbatch's backward has run.
#pragma once

#include <any>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/any_layer.h"
#include "layers/parameter.h"
#include "train/pipeline_schedule.h"

namespace stepgraph {

struct LayerPipelineOptions {
  // See Note [Gradients summed over microbatches]; false leaves each
  // parameter's gradient as its last backward wrote it.
  bool accumulate_gradients = true;
};

class LayerPipeline {
 public:
  // The layers must outlive the pipeline; each appears once (a layer listed
  // twice would overwrite its own gradients: an Error).
  LayerPipeline(Context& ctx, std::vector<AnyLayer*> layers, std::int64_t microbatches,
                const LayerPipelineOptions& options = {});

  // Microbatch m's forward through every layer: the last layer's output.
  // An Error while m's previous forward still waits for its backward.
  Tensor forward(Context& ctx, std::int64_t m, const Tensor& x);
  // Microbatch m's backward through every layer, last first: d loss / d x
  // (undefined where the first layer computes no dx). Writes every
  // parameter's gradient and, with accumulate_gradients, adds it to the sums.
  Tensor backward(Context& ctx, std::int64_t m, const Tensor& dy);

  // The name of layer `layer`'s segment of `pass`: "F2 layer 1 (layernorm_mlp)".
  std::string segment_name(const PipelinePass& pass, std::size_t layer) const;

  // Every layer's parameters, in layer order.
  const std::vector<Parameter*>& parameters() const { return parameters_; }
  // Per parameter: the gradient summed over this iteration's microbatches
  // (accumulate_gradients), or the parameter's own gradient.
  const std::vector<Tensor>& gradient_sums() const { return gradient_sums_; }
  std::size_t layer_count() const { return layers_.size(); }
  std::int64_t microbatches() const { return microbatches_; }

 private:
  void check_microbatch(std::int64_t m, const char* pass) const;
  void accumulate(Context& ctx, std::size_t layer);

  std::vector<AnyLayer*> layers_;
  std::int64_t microbatches_ = 0;
  LayerPipelineOptions options_;
  std::vector<Parameter*> parameters_;
  std::vector<std::size_t> first_parameter_;  // per layer, into parameters_, and the total last
  std::vector<Tensor> gradient_sums_;
  std::vector<std::vector<std::any>> saved_;  // per microbatch, per layer; empty between its backward and forward
  std::int64_t backwards_this_iteration_ = 0;
};

}  // namespace stepgraph
