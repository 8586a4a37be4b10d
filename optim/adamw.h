// AdamW over a model's parameters: one multi-tensor op per step, with fp32
// master weights, fp32 moments, the model-dtype copies refreshed in the same
// launch, and the step counter kept on the device so a replayed step needs
// no value from the host.
//
// Grouped steps: set_groups() splits the parameters into consecutive groups
// (a model's blocks, its head, ...), each with its own launch table, so a
// training step can update each group as soon as its gradients are final,
// overlapping the rest of the backward (TrainStep does this on the
// weight-gradient stream). Every group's update reads the same step counter;
// the last one of a step advances it. The arithmetic per element is the same
// as step()'s, so results are bitwise unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "kernels/lr_schedule.h"
#include "kernels/step_guard.h"
#include "layers/gradients_ready.h"
#include "layers/parameter.h"
#include "ops/optimizer_ops.h"

namespace stepgraph {

// The learning rate is a device scalar every update reads (Note
// [Learning-rate schedule] in kernels/lr_schedule.h): hyper.lr at first,
// then what set_lr writes between steps, or, with a schedule, what the
// schedule computes on the device from the step counter before each
// update. A captured step replays with each new rate; nothing is captured
// again.
class AdamW {
 public:
  // `schedule`: the rate of each update from the step counter (its base
  // replaces hyper.lr); none keeps hyper.lr until set_lr.
  AdamW(Context& ctx, const std::vector<Parameter*>& parameters, const kernels::AdamWHyper& hyper,
        const std::optional<kernels::LrSchedule>& schedule = std::nullopt);

  // The rate the next updates use, written from the host (ordered after the
  // updates already issued). An Error with a schedule, which writes it.
  void set_lr(Context& ctx, float lr);
  // The rate the last update used (with a schedule), or the one set; reads
  // the device (not while tracing).
  float lr(Context& ctx) const;
  const std::optional<kernels::LrSchedule>& schedule() const { return schedule_; }

  void step(Context& ctx) const;

  // Splits the parameters (in the constructor's order) into consecutive
  // groups of these sizes; they must add up to the parameter count.
  void set_groups(Context& ctx, std::span<const std::size_t> sizes);
  std::size_t group_count() const { return groups_.size(); }
  std::size_t parameter_count() const { return parameters_.size(); }
  const std::vector<Parameter*>& parameters() const { return parameters_; }
  // set_groups(sizes) where the update can overlap the backward: the
  // context has a weight-gradient stream and the sizes cover every
  // parameter; otherwise the optimizer stays one update after the backward.
  void group_for_overlap(Context& ctx, std::span<const std::size_t> sizes);
  // Updates group `group`; advance_step for the last update of a step only.
  void step_group(Context& ctx, std::size_t group, bool advance_step) const;
  // The gradients a group's update reads (all of them for step()).
  // Persistent gradients only (an Error with step-scoped ones).
  const std::vector<Tensor>& group_gradients(std::size_t group) const;
  const std::vector<Tensor>& all_gradients() const;

  // Note [Step-scoped gradients] (layers/parameter.h): from now on every
  // parameter's gradient is a tensor of the step, made by the backward where
  // it first writes it and dropped once the step's updates are issued
  // (step(), GroupedStep::finish()); the persistent gradients are released
  // (their memory freed where nothing else holds them). Each update writes
  // its table's entries from the step's gradients (AdamWParams::
  // table_from_operands). Not with ZeRO-1, the non-finite skip or
  // collectives over the gradients (data or tensor parallelism): Errors.
  void use_step_scoped_gradients(Context& ctx);
  bool step_scoped_gradients() const { return step_scoped_; }
  // Drops the step's gradients (step-scoped; a no-op otherwise).
  void release_step_gradients() const;

  // One step's grouped updates, driven by a backward's "gradients ready"
  // calls (ResidualStack::GradientsReady): each group updates on the
  // weight-gradient stream (WeightGradScope) when it is called; the last
  // call advances the step counter. finish() checks every group ran once.
  //
  //   AdamW::GroupedStep update(ctx, optimizer);
  //   model.backward(ctx, saved, dlogits, std::ref(update));
  //   update.finish();
  //
  // With a data-parallel communicator, each group's gradients are first
  // summed across the ranks (one all-reduce bucket per
  // group, on the communication stream), so the reduction of one group
  // overlaps the backward of the groups before it. `rank_local` parameters
  // are left out of that sum (expert-parallel experts, Note [Expert-parallel
  // ResidualStack] in layers/residual_stack.h): with `rank_local_group`
  // their gradients are summed over that group instead, in the same place
  // (expert x data parallelism: the ranks holding the same experts); without
  // it they are this rank's own and already whole. Not with ZeRO-1. Where a
  // summed group's update runs: Note [Where summed updates run].
  class GroupedStep {
   public:
    GroupedStep(Context& ctx, const AdamW& optimizer, Communicator* data_parallel = nullptr,
                std::span<Parameter* const> rank_local = {}, Communicator* rank_local_group = nullptr);
    void operator()(std::size_t group);
    void finish() const;

   private:
    Context& ctx_;
    const AdamW& optimizer_;
    Communicator* data_parallel_;
    Communicator* rank_local_group_;
    // Per group, the gradients summed over data_parallel when some
    // parameters are rank-local; empty: every group's gradients.
    std::vector<std::vector<Tensor>> reduced_;
    // Per group, its rank-local gradients (summed over rank_local_group).
    std::vector<std::vector<Tensor>> rank_local_reduced_;
    std::vector<bool> done_;
    std::size_t remaining_;
  };

  // Note [Where summed updates run]
  // A group whose gradients are summed over data-parallel ranks updates
  // after its all-reduce. On the weight-gradient stream (kWeightGradient)
  // the update waits there for the all-reduce, and every weight-gradient
  // GEMM issued after it, the next groups', waits behind it: the
  // reductions and the weight gradients run one after the other instead of
  // side by side, and the main stream, which joins the weight-gradient
  // stream one group behind (Note [Joining the weight-gradient stream]),
  // waits on reductions too. On the communication stream (kCommunication,
  // the default) the update follows its all-reduce there and the weight
  // gradients go on: only the next all-reduce waits behind it. Measured
  // (docs/communication_performance.md, step_bench --dp-update-stream), the
  // captured step scales better with kCommunication and the eager one with
  // kWeightGradient, so the default, kCommunicationWhenCaptured, takes each
  // where it is faster. The arithmetic is the same, so results are bitwise
  // unchanged (eager == graph holds for every choice); groups that nothing
  // sums (no data parallelism, ZeRO-1's own path) update on the
  // weight-gradient stream either way.
  enum class SummedUpdateStream : std::uint8_t { kWeightGradient, kCommunication, kCommunicationWhenCaptured };
  void set_summed_update_stream(SummedUpdateStream stream) { summed_update_stream_ = stream; }
  SummedUpdateStream summed_update_stream() const { return summed_update_stream_; }

  // Note [Non-finite steps]
  // With skip_nonfinite set, a step whose loss or any gradient is NaN or
  // infinite changes nothing: not the parameters, the moments, the step
  // counter, the scheduled rate or what hooks derive from the weights (an
  // FP8 weight cache); the next good step proceeds as if the bad one never
  // ran. The check runs on the device: each group's gradients are checked
  // as soon as they are final (flag_nonfinite_group, on the weight-gradient
  // stream, where the update ran before), the loss by flag_nonfinite; the
  // flag is max-all-reduced over the step's communicators; then every update
  // runs inside Context::run_if_zero, a CUDA conditional (IF) node in a
  // captured step, so a replay reads nothing on the host. The updates thus
  // wait for the whole backward instead of overlapping it (the cost is in
  // docs/step_options_performance.md). skipped_steps() counts the steps skipped.
  // Not with ZeRO-1: its updates reduce-scatter and all-gather, and
  // collectives inside conditional nodes fail to instantiate (NCCL #1986).
  void set_skip_nonfinite(Context& ctx, bool skip);
  bool skips_nonfinite() const { return nonfinite_flag_.defined(); }
  // ORs "x (fp32) is not finite" into the step's flag.
  void flag_nonfinite(Context& ctx, const Tensor& x) const;
  // ORs "a gradient of group `group` (all of them for -1) is not finite".
  void flag_nonfinite_group(Context& ctx, std::ptrdiff_t group) const;
  // The step's updates, all groups in order (or step()), only where nothing
  // was flagged; the flag max-all-reduced over `communicators` first. Then
  // counts a skipped step and clears the flag for the next.
  void update_if_finite(Context& ctx, std::span<Communicator* const> communicators) const;
  // Steps skipped so far (reads the device: not while tracing), and the
  // counter itself (int64 [1], for checkpoints).
  std::int64_t skipped_steps(Context& ctx) const;
  const Tensor& skipped_counter() const { return skipped_; }

  // fp16's dynamic loss scaling (Note [Loss scaling] in kernels/step_guard.h),
  // on the non-finite skip (set_skip_nonfinite first): the caller multiplies
  // the loss gradient by the scale (ops::scale_by_loss_scale_ with
  // loss_scale_state()), every update divides the gradients by it, and
  // update_if_finite updates it after the step (backs off where the step was
  // skipped). nullopt turns it off.
  void set_loss_scaling(Context& ctx, const std::optional<kernels::LossScaling>& scaling);
  bool scales_loss() const { return loss_scale_.defined(); }
  // fp32 [3] {scale, 1/scale, good steps in a row}: for the loss gradient and checkpoints.
  const Tensor& loss_scale_state() const { return loss_scale_; }
  // The scale the next step's backward uses (reads the device: not while tracing).
  float loss_scale(Context& ctx) const;

  // ZeRO-1 (Note [Sharded AdamW]): from now on each update reduce-scatters
  // its group's gradients over `comm`, updates this rank's 1/N of the
  // group's elements (this rank owns 1/N of the master weights and moments;
  // the per-parameter moments are released), and all-gathers the updated
  // weights into every parameter's value. Call after the groups are set,
  // before any step; every rank must call it with the same parameters.
  void shard(Context& ctx, Communicator& comm);
  bool sharded() const { return sharding_ != nullptr; }
  Communicator* sharding() const { return sharding_; }

  // A sharded optimizer's state on this rank, for checkpoints: per shard
  // (one per group) its name and this rank's master, m and v.
  struct ShardState {
    std::string name;
    Tensor master, m, v;
  };
  std::vector<ShardState> shard_states() const;

  // Steps taken so far (reads the device counter: not while tracing).
  std::int64_t steps_taken(Context& ctx) const;

  // The optimizer's state, for checkpoints: each parameter's moments in the
  // constructor's order, and the device step counter (int64 [1]).
  struct Moments {
    Tensor m;
    Tensor v;
  };
  std::vector<Moments> moments() const;
  const Tensor& step_counter() const { return step_; }

 private:
  SummedUpdateStream summed_update_stream_ = SummedUpdateStream::kCommunicationWhenCaptured;
  // One parameter's tensors; copy is undefined when the master is the value.
  using UpdateTensors = ops::AdamWParamOperands<Tensor>;
  // One launch: its parameters' table and tensors.
  struct Update {
    std::size_t first = 0;  // the parameters [first, first + count) it updates
    std::size_t count = 0;
    ops::AdamWParams params;
    Tensor table;                 // the kernel's launch table (pointers), int64 words
    std::vector<UpdateTensors> tensors;  // per parameter
    std::vector<Tensor> grads;    // per parameter
  };
  // The update of parameters [first, first + count).
  Update make_update(Context& ctx, std::size_t first, std::size_t count, const std::string& table_name) const;
  // The update's tensors with this step's gradients (step-scoped), else its own.
  std::vector<UpdateTensors> tensors_now(const Update& update) const;

  Update make_update(Context& ctx, const std::vector<UpdateTensors>& entries, const std::string& table_name) const;

  // This rank's shard of a group's parameters [first, first + count), laid
  // end to end (Note [Sharded AdamW]).
  struct Shard {
    std::string name;
    std::size_t first = 0;
    std::size_t count = 0;
    std::int64_t padded = 0;     // the bucket: the group's elements, padded to N equal shards
    Tensor grad;                 // fp32 [padded / N]: this rank's reduced gradients
    Tensor master;               // fp32 [padded / N]
    Tensor value;                // what is gathered: the bf16 copy, or the master itself
    std::vector<Tensor> grads;   // the group's parameter gradients, packed in order
    std::vector<Tensor> values;  // the group's parameter values, unpacked in order
    Update update;
  };
  Shard make_shard(Context& ctx, std::size_t first, std::size_t count, const std::string& name) const;
  void step_shard(Context& ctx, const Shard& shard, bool advance_step) const;
  // Parameters [first, first + count)'s after_update hooks (their values changed).
  void after_update(Context& ctx, std::size_t first, std::size_t count) const;

  // The schedule's rate into lr_ (with a schedule), then the update.
  void run_update(Context& ctx, const ops::AdamWParams& params, const Tensor& table,
                  const std::vector<UpdateTensors>& tensors) const;

  kernels::AdamWHyper hyper_;
  std::optional<kernels::LrSchedule> schedule_;
  Tensor lr_;  // fp32 [1]: the rate every update reads
  std::vector<Parameter*> parameters_;
  std::vector<Tensor> m_;  // per parameter
  std::vector<Tensor> v_;
  Tensor step_;  // int64 [1]
  Update all_;
  std::vector<Update> groups_;
  Communicator* sharding_ = nullptr;
  std::vector<Shard> shards_;  // per group (or one for all) once sharded
  Tensor nonfinite_flag_;      // int32 [1], with skip_nonfinite
  Tensor skipped_;             // int64 [1], with skip_nonfinite
  std::optional<kernels::LossScaling> loss_scaling_;
  Tensor loss_scale_;  // fp32 [3], with loss scaling
  bool step_scoped_ = false;
};

// "wgrad" | "comm" | "captured": the step_bench flag's spelling of AdamW::SummedUpdateStream.
std::string_view summed_update_stream_name(AdamW::SummedUpdateStream stream);

// Runs `backward` and the optimizer's step: each group's update as soon as
// the backward reports it (AdamW::GroupedStep) when the optimizer has
// groups, else one update after the whole backward. With `data_parallel`
// the gradients are summed across its ranks before they are used (the loss
// must already divide by the world size); at one rank that sum is a copy.
// An optimizer that skips non-finite steps checks each group's gradients
// as the backward reports it and updates after the backward, where nothing
// was flagged (Note [Non-finite steps]); its flag is max-all-reduced over
// `data_parallel` and `tensor_parallel`, those given. `rank_local`
// parameters' gradients are never summed over `data_parallel`, but over
// `rank_local_group` where one is given (AdamW::GroupedStep).
void backward_and_update(Context& ctx, const AdamW& optimizer, const BackwardWithReady& backward,
                         Communicator* data_parallel = nullptr, Communicator* tensor_parallel = nullptr,
                         std::span<Parameter* const> rank_local = {}, Communicator* rank_local_group = nullptr);

}  // namespace stepgraph
