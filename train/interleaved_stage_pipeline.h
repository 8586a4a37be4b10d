// InterleavedStagePipeline: one rank's V chunks of an interleaved (virtual)
// pipeline across the ranks of a communicator. The model's L layers are cut
// into P * V chunks; stage s (the rank) holds chunks s, s + P, ...,
// s + (V - 1) P (Megatron's layout), its chunk v being the model's chunk
// v P + s. An activation goes from model chunk c to c + 1 on the next rank
// (the last rank's chunk v to rank 0's chunk v + 1), a gradient back:
//
//   InterleavedStagePipeline stage(ctx, comm, model_layers, /*chunks=*/2, /*microbatches=*/4, activation);
//   for (const ChunkPass& p : stage.schedule().passes()) {
//     const std::int64_t m = p.pass.microbatch;
//     if (p.pass.kind == PipelinePass::Kind::kForward)
//       y[m] = stage.forward(ctx, p.chunk, m, stage.takes_model_input(p.chunk) ? x[m] : Tensor{});
//     else dx[m] = stage.backward(ctx, p.chunk, m, stage.takes_model_gradient(p.chunk) ? dy[m] : Tensor{});
//   }
//
// forward on the model's last chunk returns the model's output, backward on
// its first chunk the input gradient; the others return an undefined tensor.
// The transfers are send/recv ops (recorded when traced, on the
// communication stream where the context has one) in the groups of
// interleaved_transfer_plan (Note [Interleaved transfer groups]); the
// constructor exchanges every stage's schedule and refuses, on every rank
// with the same Error and before any transfer, orders that deadlock or send
// another tensor (check_interleaved_stage_schedules; Note [Pipeline stages
// across ranks] says why the per-pair capture check cannot see it). Each
// chunk is a LayerPipeline; traced over a whole iteration (CapturedStep) all
// chunks and microbatches of the rank share one pool plan. StagePipeline
// (stage_pipeline.h) is the V = 1 case with 1F1B's own grouping.
//
// Megatron's interleaved order runs each chunk's backwards in microbatch
// order 0, 1, ..., M - 1, so each parameter's gradient sum adds the
// microbatches in that order, as one rank running every layer with its
// backwards in microbatch order does (Note [Gradients summed over microbatches]).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/any_layer.h"
#include "layers/parameter.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"
#include "train/stage_schedule_check.h"

namespace stepgraph {

struct InterleavedStagePipelineOptions {
  LayerPipelineOptions pipeline;
  // This stage's order; nullopt: InterleavedSchedule::interleaved_one_f_one_b(M, P, s, V).
  std::optional<InterleavedSchedule> schedule;
};

class InterleavedStagePipeline {
 public:
  // The layers [first, last) of the model's chunk `model_chunk` of `chunks_total`:
  // an Error unless the chunks divide the layers evenly.
  struct LayerRange {
    std::size_t first = 0;
    std::size_t last = 0;
  };
  static LayerRange chunk_layers(std::size_t layer_count, int model_chunk, int chunks_total);

  // `layers`: the whole model's, in order (they and `comm` must outlive the
  // pipeline). Every rank of `comm` constructs its stage together.
  InterleavedStagePipeline(Context& ctx, Communicator& comm, const std::vector<AnyLayer*>& layers, int chunks,
                           std::int64_t microbatches, TensorMeta activation,
                           const InterleavedStagePipelineOptions& options = {});

  // Chunk `chunk`'s forward of microbatch m: `x` where this chunk is the
  // model's first (an Error elsewhere). Returns the output on the model's last chunk.
  Tensor forward(Context& ctx, int chunk, std::int64_t m, const Tensor& x = {});
  // Its backward: `dy` on the model's last chunk. Returns dx on the model's first.
  Tensor backward(Context& ctx, int chunk, std::int64_t m, const Tensor& dy = {});

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  int chunks() const { return schedule_.chunks(); }
  int model_chunk(int chunk) const { return chunk * stages_ + stage_; }
  bool takes_model_input(int chunk) const { return model_chunk(chunk) == 0; }
  bool takes_model_gradient(int chunk) const { return model_chunk(chunk) + 1 == stages_ * chunks(); }
  LayerRange layer_range(int chunk) const;
  const InterleavedSchedule& schedule() const { return schedule_; }
  std::string next_pass() const { return schedule_.passes()[next_].to_string(); }
  // Every chunk's parameters (chunk 0's first, in layer order) and their
  // gradients summed over the microbatches.
  const std::vector<Parameter*>& parameters() const { return parameters_; }
  std::vector<Tensor> gradient_sums() const;

 private:
  using Key = std::tuple<int, PipelinePass::Kind, std::int64_t>;  // chunk, kind, microbatch
  void check_next(const ChunkPass& pass);
  // Issues the plan's groups due before pass `next_` (or after the last).
  void issue_groups(Context& ctx);
  Tensor run(Context& ctx, const ChunkPass& pass, const Tensor& given);

  Communicator& comm_;
  int stage_ = 0;
  int stages_ = 1;
  TensorMeta activation_;
  InterleavedSchedule schedule_;
  InterleavedTransfers plan_;
  std::vector<std::unique_ptr<LayerPipeline>> chunks_;
  std::vector<Parameter*> parameters_;
  std::vector<LayerRange> ranges_;  // per chunk of this stage
  std::size_t next_ = 0;        // index into the schedule's passes
  std::size_t next_group_ = 0;  // index into plan_.groups
  std::map<Key, Tensor> outputs_;   // outputs waiting for their send
  std::map<Key, Tensor> received_;  // inputs received for passes still to run
};

}  // namespace stepgraph
