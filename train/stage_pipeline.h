// StagePipeline: one rank's stage of a pipeline across the ranks of a
// communicator. Stage s of P (s = the rank) runs layers [s L / P, (s + 1) L / P)
// of the model's L through a LayerPipeline; activations go forward and
// gradients back by the send/recv ops (ops/collective_ops.h: recorded when
// traced, on the communication stream where the context has one):
//
//   StagePipeline stage(ctx, comm, model_layers, /*microbatches=*/4, activation_meta);
//   for (const PipelinePass& pass : stage.schedule().passes()) {
//     const std::int64_t m = pass.microbatch;
//     if (pass.kind == PipelinePass::Kind::kForward) y[m] = stage.forward(ctx, m, stage.is_first() ? x[m] : Tensor{});
//     else dx[m] = stage.backward(ctx, m, stage.is_last() ? dy[m] : Tensor{});
//   }
//   stage.gradient_sums();  // this stage's parameters, summed over the microbatches
//
// forward(m) on the last stage returns the model's output of microbatch m,
// backward(m) on the first stage its input gradient; the other stages
// return an undefined tensor. Every activation between stages has one shape
// and dtype (`activation`): a stack of blocks. The same calls run eager or
// traced (CapturedStep over a whole iteration, CaptureOptions::communicators
// holding `comm`).
//
// Note [Pipeline stages across ranks]
// Each stage runs its own 1F1B order, PipelineSchedule::one_f_one_b(M, P - 1 - s)
// as in Megatron: P - 1 - s forwards ahead of its first backward. A send on
// NCCL may wait until its receive is posted, and a rank's transfers run in
// order on one stream, so a send and a receive issued one after the other
// can wait for each other across two ranks. The stage therefore issues its
// transfers in groups (stage_schedule_check.h): after pass i it sends pass
// i's output and receives pass i + 1's input together (one send_recv op, one
// NCCL group; Megatron's send_forward_recv_backward and
// send_backward_recv_forward), and receives alone only before its first pass.
// With these groups 1F1B pairs every send with its receive: in the steady
// state stage s's group after forward m (send F m, recv B m - w_s, w_s its
// warmup) meets stage s + 1's group after backward m - w_s (send B m - w_s,
// recv F m), since stage s + 1 has one forward in flight fewer; in warmup and
// cooldown the groups form a chain from the first (last) stage, which sends
// without waiting for a receive. Backwards run in microbatch order on every
// stage, so each parameter's gradient sum adds the microbatches in the order
// 0, 1, ..., M - 1, as one rank running all layers in any schedule with
// backwards in that order does (Note [Gradients summed over microbatches]).
//
// A mismatched schedule (stages whose orders do not pair up) must be an
// error on every rank, never a hang. The capture uniformity check
// (graphs/collective_check.h) compares each pair of ranks' sends and
// receives in order, but only per pair: 1F1B on stage 0 against
// all-forward-all-backward on stage 1 sends and receives the same tensors in
// the same order between them and still deadlocks, since each waits for the
// other's next group. The constructor therefore exchanges every stage's
// schedule (Communicator::exchange, host-side and bounded) and simulates the
// groups with check_stage_schedules: every rank gets the same Error, before
// any transfer, eager or traced. forward and backward then refuse a pass that
// is not the schedule's next one.
// Interleaved stages (V chunks a rank) need other transfer groups: see
// InterleavedStagePipeline (interleaved_stage_pipeline.h) and Note
// [Interleaved transfer groups].
//
// Data parallelism (PP x DP): with options.data_parallel, the group of this
// stage's ranks across the replicas (each replica a pipeline communicator
// of its own, training its share of the global batch's microbatches), the
// iteration's last backward ends with the gradient sums all-reduced (summed,
// in place, one all_reduce_many_ per dtype: an op, traced and captured like
// the transfers) over that group. As in TrainStep, the sum is the gradient
// of the global loss because each replica's output gradients are of its
// share of it: the caller's loss divides by the replicas (TrainStep's
// loss_scale 1 / world size); the pipeline scales nothing. The all-reduce
// follows the stage's last transfer group and its group holds one stage
// only, so it waits on no transfer: every replica's stage s reaches it once
// its own pipeline's transfers are done. The constructor exchanges every
// replica's stage, stages and schedule line over the group, so a group that
// mixes stages is the same Error on each of its ranks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/any_layer.h"
#include "layers/parameter.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"

namespace stepgraph {

struct StagePipelineOptions {
  LayerPipelineOptions pipeline;
  // This stage's order of passes; nullopt: one_f_one_b(M, P - 1 - s). Every
  // rank's order is checked against the others' (Note [Pipeline stages across ranks]).
  std::optional<PipelineSchedule> schedule;
  // The same stage in every data-parallel replica; null: one replica. See
  // Note [Pipeline stages across ranks]. Must outlive the pipeline.
  Communicator* data_parallel = nullptr;
};

class StagePipeline {
 public:
  // The layers [first, last) stage s of `stages` runs, out of `layer_count`:
  // an Error unless the stages divide the layers evenly.
  struct LayerRange {
    std::size_t first = 0;
    std::size_t last = 0;
  };
  static LayerRange stage_layers(std::size_t layer_count, int stage, int stages);

  // `layers`: the whole model's, in order (this rank uses its share; they
  // must outlive the pipeline, as must `comm`). The entries of other ranks'
  // shares are never read and may be null: a rank may build only its own
  // stage's layers (train/language_model_stages.h). Every rank of `comm` must
  // construct its stage together (they exchange their schedules).
  StagePipeline(Context& ctx, Communicator& comm, const std::vector<AnyLayer*>& layers, std::int64_t microbatches,
                TensorMeta activation, const StagePipelineOptions& options = {});

  // Microbatch m's forward through this stage: `x` on the first stage (an
  // Error elsewhere: the input comes from the previous stage). Returns the
  // output on the last stage, else an undefined tensor.
  Tensor forward(Context& ctx, std::int64_t m, const Tensor& x = {});
  // Microbatch m's backward: `dy` on the last stage (an Error elsewhere).
  // Returns d loss / d x on the first stage, else an undefined tensor.
  Tensor backward(Context& ctx, std::int64_t m, const Tensor& dy = {});

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ + 1 == stages_; }
  LayerRange layer_range() const { return range_; }
  const PipelineSchedule& schedule() const { return schedule_; }
  // The pass the schedule runs next ("F0" at the start of an iteration).
  std::string next_pass() const { return schedule_.passes()[next_].to_string(); }
  // This stage's parameters, in layer order, and their gradients summed over
  // the microbatches (LayerPipeline::gradient_sums) and, after the
  // iteration's last backward, over options.data_parallel.
  const std::vector<Parameter*>& parameters() const { return pipeline_.parameters(); }
  const std::vector<Tensor>& gradient_sums() const { return pipeline_.gradient_sums(); }

 private:
  void check_next(const PipelinePass& pass);
  // Receives the input of pass `next_` where it comes from a peer and no
  // group has received it yet (the first pass of an iteration).
  Tensor take_input(Context& ctx, const PipelinePass& pass);
  // After pass `next_`: sends `out` (undefined: nothing to send) together
  // with receiving the next pass's input, then advances.
  void finish_pass(Context& ctx, const PipelinePass& pass, const Tensor& out);
  // Sums the gradient sums over data_parallel_ (after the iteration's last pass).
  void reduce_over_replicas(Context& ctx);

  Communicator& comm_;
  Communicator* data_parallel_ = nullptr;
  int stage_ = 0;
  int stages_ = 1;
  LayerRange range_;
  TensorMeta activation_;
  PipelineSchedule schedule_;
  LayerPipeline pipeline_;
  std::size_t next_ = 0;  // index into the schedule's passes
  Tensor received_;       // the next pass's input, received with the last group
};

}  // namespace stepgraph
