#include "optim/adamw.h"

#include <cmath>
#include <optional>
#include <unordered_set>

#include "engine/error.h"
#include "kernels/adamw.h"
#include "layers/weight_grad_scope.h"
#include "ops/collective_ops.h"
#include "ops/step_guard_ops.h"

namespace stepgraph {

AdamW::AdamW(Context& ctx, const std::vector<Parameter*>& parameters, const kernels::AdamWHyper& hyper,
             const std::optional<kernels::LrSchedule>& schedule)
    : hyper_(hyper), schedule_(schedule), parameters_(parameters) {
  kernels::check_adamw_hyper(hyper);  // refused here, not at the first step
  if (schedule_) kernels::check_lr_schedule(*schedule_);
  SG_CHECK(!parameters.empty(), "AdamW needs at least one parameter");
  lr_ = ctx.persistent("adamw.lr", {Shape{1}, DType::kFloat32});
  const float first = schedule_ ? schedule_->base : hyper.lr;
  ctx.copy_from_host(lr_, &first, sizeof(first));
  for (const Parameter* p : parameters) {
    const TensorMeta meta = p->master.meta();
    m_.push_back(ctx.persistent(p->name + ".adam_m", meta));
    v_.push_back(ctx.persistent(p->name + ".adam_v", meta));
  }
  step_ = ctx.persistent("adamw.step", {Shape{1}, DType::kInt64});
  all_ = make_update(ctx, 0, parameters.size(), "adamw.table");
}

AdamW::Update AdamW::make_update(Context& ctx, std::size_t first, std::size_t count,
                                 const std::string& table_name) const {
  std::vector<UpdateTensors> entries;
  for (std::size_t i = first; i < first + count; ++i) {
    const Parameter* p = parameters_[i];
    entries.push_back({p->master, p->grad, m_[i], v_[i], p->has_copy() ? p->value : Tensor()});
  }
  Update update = make_update(ctx, entries, table_name);
  update.first = first;
  update.count = count;
  return update;
}

void AdamW::after_update(Context& ctx, std::size_t first, std::size_t count) const {
  for (std::size_t i = first; i < first + count; ++i) run_after_update(ctx, *parameters_[i]);
}

AdamW::Update AdamW::make_update(Context& ctx, const std::vector<UpdateTensors>& entries,
                                 const std::string& table_name) const {
  Update update;
  update.params.hyper = hyper_;
  update.params.device_lr = true;
  std::vector<kernels::AdamWTensor> table_entries;
  for (const UpdateTensors& e : entries) {
    const bool has_copy = e.copy.defined();
    // A step-scoped gradient has no address yet: the entry holds the master's
    // until each update writes the step's (table_from_operands).
    const Tensor& grad = e.grad.defined() ? e.grad : e.master;
    if (!e.grad.defined()) update.params.table_from_operands = true;
    update.tensors.push_back(e);
    update.grads.push_back(e.grad);
    update.params.has_copy.push_back(has_copy);
    update.params.total_numel += e.master.meta().numel();
    SG_CHECK(!has_copy || e.copy.dtype() == DType::kBFloat16 || e.copy.dtype() == DType::kFloat16,
             "AdamW: the model-dtype copy of a parameter must be bf16 or fp16, got ", dtype_name(e.copy.dtype()));
    table_entries.push_back({e.master.data_as<float>(), grad.data_as<float>(), e.m.data_as<float>(),
                             e.v.data_as<float>(), has_copy ? e.copy.data() : nullptr, e.master.meta().numel(),
                             has_copy && e.copy.dtype() == DType::kFloat16});
  }
  const std::size_t table_bytes = kernels::adamw_table_bytes(table_entries);
  const auto words = static_cast<std::int64_t>((table_bytes + 7) / 8);
  std::vector<std::int64_t> table_host(static_cast<std::size_t>(words), 0);
  kernels::build_adamw_table(table_entries, table_host.data());
  update.table = ctx.persistent(table_name, {Shape{words}, DType::kInt64});
  ctx.copy_from_host(update.table, table_host.data(), table_host.size() * sizeof(std::int64_t));
  return update;
}

void AdamW::step(Context& ctx) const {
  if (sharded()) {
    SG_CHECK(groups_.empty(), "AdamW::step: a sharded optimizer with groups updates by step_group");
    step_shard(ctx, shards_.at(0), /*advance_step=*/true);
    return;
  }
  run_update(ctx, all_.params, all_.table, tensors_now(all_));
  after_update(ctx, all_.first, all_.count);
  release_step_gradients();
}

std::vector<AdamW::UpdateTensors> AdamW::tensors_now(const Update& update) const {
  if (!step_scoped_) return update.tensors;
  std::vector<UpdateTensors> out = update.tensors;
  for (std::size_t i = 0; i < update.count; ++i) {
    const Parameter& p = *parameters_[update.first + i];
    SG_CHECK(p.grad.defined(), "AdamW: parameter '", p.name,
             "' has no gradient this step: the backward did not write it (step-scoped gradients, Note "
             "[Step-scoped gradients] in layers/parameter.h)");
    out[i].grad = p.grad;
  }
  return out;
}

void AdamW::release_step_gradients() const {
  if (!step_scoped_) return;
  for (Parameter* p : parameters_) p->grad = Tensor();
}

void AdamW::use_step_scoped_gradients(Context& ctx) {
  if (step_scoped_) return;
  SG_CHECK_CODE(!sharded(), ErrorCode::kUnsupported,
                "AdamW::use_step_scoped_gradients: a sharded (ZeRO-1) optimizer reduce-scatters persistent "
                "gradients; keep them persistent");
  SG_CHECK_CODE(!skips_nonfinite(), ErrorCode::kUnsupported,
                "AdamW::use_step_scoped_gradients: the non-finite skip checks the gradients through persistent "
                "tables; keep them persistent, or turn the skip off");
  step_scoped_ = true;
  for (Parameter* p : parameters_) {
    p->step_scoped_gradient = true;
    p->grad = Tensor();
  }
  // The tables again, without the persistent gradients (which go with their last handle).
  all_ = make_update(ctx, 0, parameters_.size(), "adamw.table");
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    groups_[g] = make_update(ctx, groups_[g].first, groups_[g].count, "adamw.group" + std::to_string(g) + ".table");
  }
}

void AdamW::run_update(Context& ctx, const ops::AdamWParams& params, const Tensor& table,
                       const std::vector<UpdateTensors>& tensors) const {
  // Every update of a grouped step computes the same rate: the counter
  // advances in the last one only.
  if (schedule_) ops::lr_schedule_(ctx, *schedule_, step_, lr_);
  ops::AdamWOperands<Tensor> operands{.table = table, .step = step_, .params = tensors, .lr = lr_};
  if (!scales_loss()) {
    ops::adamw_step(ctx, params, std::move(operands));
    return;
  }
  ops::AdamWParams unscaling = params;
  unscaling.unscale_grads = true;
  operands.loss_scale = loss_scale_;
  ops::adamw_step(ctx, unscaling, std::move(operands));
}

void AdamW::set_lr(Context& ctx, float lr) {
  SG_CHECK(!schedule_, "AdamW::set_lr: the optimizer's schedule (", schedule_ ? schedule_->to_string() : "",
           ") writes the rate before each update; make an optimizer without a schedule to set it by hand");
  SG_CHECK(std::isfinite(lr) && lr >= 0.0f, "AdamW::set_lr: the rate must be finite and >= 0, got ", lr);
  ctx.copy_from_host(lr_, &lr, sizeof(lr));
}

float AdamW::lr(Context& ctx) const { return ctx.to_vector<float>(lr_).at(0); }

void AdamW::set_groups(Context& ctx, std::span<const std::size_t> sizes) {
  std::size_t total = 0;
  for (const std::size_t size : sizes) {
    SG_CHECK(size > 0, "AdamW::set_groups: every group needs at least one parameter");
    total += size;
  }
  SG_CHECK(total == parameters_.size(), "AdamW::set_groups: the groups hold ", total, " parameters, the optimizer has ",
           parameters_.size());
  SG_CHECK_CODE(!sharded(), ErrorCode::kInvalidState,
                "AdamW::set_groups: the optimizer is already sharded; set the "
                "groups first, then shard()");
  groups_.clear();
  std::size_t first = 0;
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    groups_.push_back(make_update(ctx, first, sizes[g], "adamw.group" + std::to_string(g) + ".table"));
    first += sizes[g];
  }
}

void AdamW::group_for_overlap(Context& ctx, std::span<const std::size_t> sizes) {
  std::size_t total = 0;
  for (const std::size_t size : sizes) total += size;
  if (ctx.stream_count() > WeightGradScope::kStream && total == parameters_.size()) set_groups(ctx, sizes);
}

void AdamW::step_group(Context& ctx, std::size_t group, bool advance_step) const {
  SG_CHECK(group < groups_.size(), "AdamW::step_group: group ", group, " of ", groups_.size(),
           "; call set_groups first");
  if (sharded()) {
    step_shard(ctx, shards_.at(group), advance_step);
    return;
  }
  ops::AdamWParams params = groups_[group].params;
  params.advance_step = advance_step;
  run_update(ctx, params, groups_[group].table, tensors_now(groups_[group]));
  after_update(ctx, groups_[group].first, groups_[group].count);
}

const std::vector<Tensor>& AdamW::group_gradients(std::size_t group) const {
  SG_CHECK(group < groups_.size(), "AdamW::group_gradients: group ", group, " of ", groups_.size());
  SG_CHECK_CODE(!step_scoped_, ErrorCode::kInvalidState,
                "AdamW::group_gradients: the gradients are step-scoped (read Parameter::grad during the step)");
  return groups_[group].grads;
}

const std::vector<Tensor>& AdamW::all_gradients() const {
  SG_CHECK_CODE(!step_scoped_, ErrorCode::kInvalidState,
                "AdamW::all_gradients: the gradients are step-scoped (read Parameter::grad during the step)");
  return all_.grads;
}

namespace {

// A data-parallel communicator, even of one rank: its collectives then are
// identities, but they run (and are captured) as at any size.
bool reduces(const Communicator* comm) { return comm != nullptr; }

// The gradients of parameters [first, first + grads.size()) that are (or,
// with `local` false, are not) rank-local, in order.
std::vector<Tensor> rank_local_split(const std::vector<Tensor>& grads, const std::vector<Parameter*>& parameters,
                                     std::size_t first, const std::unordered_set<const Parameter*>& rank_local,
                                     bool local) {
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if ((rank_local.count(parameters[first + i]) > 0) == local) out.push_back(grads[i]);
  }
  return out;
}
std::vector<Tensor> without_rank_local(const std::vector<Tensor>& grads, const std::vector<Parameter*>& parameters,
                                       std::size_t first, const std::unordered_set<const Parameter*>& rank_local) {
  return rank_local_split(grads, parameters, first, rank_local, false);
}

// Rank-local gradients are summed by nobody: a sharded update would
// reduce-scatter them with the rest.
void check_rank_local(const AdamW& optimizer, std::span<Parameter* const> rank_local, const char* who) {
  SG_CHECK_CODE(rank_local.empty() || !optimizer.sharded(), ErrorCode::kUnsupported, who,
                ": rank_local parameters (", rank_local.size(),
                ", e.g. expert-parallel experts) with a sharded (ZeRO-1) optimizer, which reduce-scatters every "
                "gradient; use the all-reduce data-parallel mode");
}

}  // namespace

std::string_view summed_update_stream_name(AdamW::SummedUpdateStream stream) {
  switch (stream) {
    case AdamW::SummedUpdateStream::kWeightGradient: return "wgrad";
    case AdamW::SummedUpdateStream::kCommunication: return "comm";
    case AdamW::SummedUpdateStream::kCommunicationWhenCaptured: return "captured";
  }
  return "captured";
}

AdamW::GroupedStep::GroupedStep(Context& ctx, const AdamW& optimizer, Communicator* data_parallel,
                                std::span<Parameter* const> rank_local, Communicator* rank_local_group)
    : ctx_(ctx),
      optimizer_(optimizer),
      data_parallel_(data_parallel),
      rank_local_group_(rank_local.empty() ? nullptr : rank_local_group),
      done_(optimizer.group_count(), false),
      remaining_(optimizer.group_count()) {
  SG_CHECK(remaining_ > 0, "AdamW::GroupedStep: the optimizer has no groups; call set_groups first");
  SG_CHECK_CODE(!(optimizer.step_scoped_gradients() && (reduces(data_parallel) || reduces(rank_local_group_))),
                ErrorCode::kUnsupported,
                "AdamW::GroupedStep: step-scoped gradients are not summed across data-parallel ranks yet; keep "
                "them persistent");
  check_rank_local(optimizer, rank_local, "AdamW::GroupedStep");
  const std::unordered_set<const Parameter*> local(rank_local.begin(), rank_local.end());
  if (!rank_local.empty() && reduces(data_parallel)) {
    for (const Update& group : optimizer.groups_) {
      reduced_.push_back(without_rank_local(group.grads, optimizer.parameters_, group.first, local));
    }
  }
  if (reduces(rank_local_group_)) {
    for (const Update& group : optimizer.groups_) {
      rank_local_reduced_.push_back(rank_local_split(group.grads, optimizer.parameters_, group.first, local, true));
    }
  }
}

void AdamW::GroupedStep::operator()(std::size_t group) {
  SG_CHECK(group < done_.size() && !done_[group], "AdamW::GroupedStep: group ", group, " of ", done_.size(),
           done_.size() > group ? " was already updated this step" : " does not exist");
  done_[group] = true;
  --remaining_;
  const bool summed = (reduces(data_parallel_) || reduces(rank_local_group_)) && !optimizer_.sharded();
  if (summed && reduces(data_parallel_)) {
    const std::vector<Tensor>& grads = reduced_.empty() ? optimizer_.group_gradients(group) : reduced_[group];
    if (!grads.empty()) ops::all_reduce_many_(ctx_, *data_parallel_, grads, ReduceOp::kSum);
  }
  if (summed && reduces(rank_local_group_) && !rank_local_reduced_[group].empty()) {
    ops::all_reduce_many_(ctx_, *rank_local_group_, rank_local_reduced_[group], ReduceOp::kSum);
  }
  // Note [Where summed updates run]. Every group takes the same stream, so
  // the updates stay in order on one stream (the last advances the shared
  // step counter).
  const int comm_stream = ctx_.communication_stream();
  const SummedUpdateStream where = optimizer_.summed_update_stream();
  const bool wants_comm = where == SummedUpdateStream::kCommunication ||
                          (where == SummedUpdateStream::kCommunicationWhenCaptured && ctx_.tracing());
  const bool on_comm = summed && wants_comm && comm_stream > 0 && comm_stream != WeightGradScope::kStream;
  std::optional<StreamScope> after_reduce;
  std::optional<WeightGradScope> weight_grads;
  if (on_comm) {
    after_reduce.emplace(ctx_, comm_stream);
  } else {
    weight_grads.emplace(ctx_);
  }
  if (optimizer_.skips_nonfinite()) {  // the updates wait for every check (Note [Non-finite steps])
    optimizer_.flag_nonfinite_group(ctx_, static_cast<std::ptrdiff_t>(group));
    return;
  }
  optimizer_.step_group(ctx_, group, /*advance_step=*/remaining_ == 0);
}

void AdamW::set_loss_scaling(Context& ctx, const std::optional<kernels::LossScaling>& scaling) {
  if (!scaling) {
    loss_scaling_.reset();
    loss_scale_ = {};
    return;
  }
  kernels::check_loss_scaling(*scaling);
  SG_CHECK_CODE(skips_nonfinite(), ErrorCode::kInvalidState,
                "AdamW::set_loss_scaling: loss scaling skips the steps whose scaled gradients overflow; call "
                "set_skip_nonfinite(ctx, true) first");
  loss_scaling_ = scaling;
  if (!loss_scale_.defined()) {
    loss_scale_ = ctx.persistent("adamw.loss_scale", {Shape{kernels::kLossScaleStateSize}, DType::kFloat32});
  }
  float state[kernels::kLossScaleStateSize];
  kernels::initial_loss_scale_state(*scaling, state);
  ctx.copy_from_host(loss_scale_, state, sizeof(state));
}

float AdamW::loss_scale(Context& ctx) const {
  SG_CHECK_CODE(scales_loss(), ErrorCode::kInvalidState, "AdamW::loss_scale: loss scaling is off");
  return ctx.to_vector<float>(loss_scale_).at(0);
}

void AdamW::set_skip_nonfinite(Context& ctx, bool skip) {
  if (!skip) {
    SG_CHECK_CODE(!scales_loss(), ErrorCode::kInvalidState,
                  "AdamW::set_skip_nonfinite: loss scaling needs the skip (an overflowed step must not update); "
                  "call set_loss_scaling(ctx, std::nullopt) first");
    nonfinite_flag_ = {};
    skipped_ = {};
    return;
  }
  SG_CHECK_CODE(!step_scoped_, ErrorCode::kUnsupported,
                "AdamW::set_skip_nonfinite: the skip checks persistent gradients; this optimizer's are "
                "step-scoped (use_step_scoped_gradients)");
  SG_CHECK_CODE(!sharded(), ErrorCode::kUnsupported,
                "AdamW::set_skip_nonfinite: a sharded (ZeRO-1) update reduce-scatters and all-gathers, and "
                "collectives inside a CUDA conditional node fail to instantiate (NCCL #1986); use the all-reduce "
                "data-parallel mode, or turn the skip off");
  if (skips_nonfinite()) return;
  nonfinite_flag_ = ctx.persistent("adamw.nonfinite_flag", {Shape{1}, DType::kInt32});
  skipped_ = ctx.persistent("adamw.skipped_steps", {Shape{1}, DType::kInt64});
}

void AdamW::flag_nonfinite(Context& ctx, const Tensor& x) const {
  SG_CHECK_CODE(skips_nonfinite(), ErrorCode::kInvalidState,
                "AdamW::flag_nonfinite: call set_skip_nonfinite(ctx, true) first");
  ops::flag_nonfinite_(ctx, nonfinite_flag_, x);
}

void AdamW::flag_nonfinite_group(Context& ctx, std::ptrdiff_t group) const {
  SG_CHECK_CODE(skips_nonfinite(), ErrorCode::kInvalidState,
                "AdamW::flag_nonfinite_group: call set_skip_nonfinite(ctx, true) first");
  SG_CHECK(group >= -1 && group < static_cast<std::ptrdiff_t>(groups_.size()), "AdamW::flag_nonfinite_group: group ",
           group, " of ", groups_.size());
  const Update& update = group < 0 ? all_ : groups_[static_cast<std::size_t>(group)];
  ops::adamw_flag_nonfinite_grads_(ctx, nonfinite_flag_, update.table, update.grads);
}

void AdamW::update_if_finite(Context& ctx, std::span<Communicator* const> communicators) const {
  SG_CHECK_CODE(skips_nonfinite(), ErrorCode::kInvalidState,
                "AdamW::update_if_finite: call set_skip_nonfinite(ctx, true) first");
  for (Communicator* comm : communicators) {
    if (comm != nullptr) ops::all_reduce_(ctx, *comm, nonfinite_flag_, ReduceOp::kMax);
  }
  ctx.run_if_zero(nonfinite_flag_, [&] {
    if (groups_.empty()) {
      step(ctx);
      return;
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) step_group(ctx, g, /*advance_step=*/g + 1 == groups_.size());
  });
  // Outside the conditional body: the scale backs off exactly when the body was skipped.
  if (scales_loss()) ops::loss_scale_update_(ctx, *loss_scaling_, loss_scale_, nonfinite_flag_);
  ops::count_and_clear_flag_(ctx, skipped_, nonfinite_flag_);
}

std::int64_t AdamW::skipped_steps(Context& ctx) const {
  return skips_nonfinite() ? ctx.to_vector<std::int64_t>(skipped_).at(0) : 0;
}

void AdamW::GroupedStep::finish() const {
  SG_CHECK(remaining_ == 0, "AdamW::GroupedStep: ", remaining_, " of ", done_.size(),
           " parameter groups were not updated this step (the backward did not report them)");
  optimizer_.release_step_gradients();
}

std::int64_t AdamW::steps_taken(Context& ctx) const { return ctx.to_vector<std::int64_t>(step_).at(0); }

std::vector<AdamW::Moments> AdamW::moments() const {
  SG_CHECK_CODE(!sharded(), ErrorCode::kUnsupported,
                "AdamW::moments: a sharded optimizer holds only this rank's "
                "shard of the moments");
  std::vector<Moments> out;
  for (std::size_t i = 0; i < m_.size(); ++i) out.push_back({m_[i], v_[i]});
  return out;
}

void backward_and_update(Context& ctx, const AdamW& optimizer, const BackwardWithReady& backward,
                         Communicator* data_parallel, Communicator* tensor_parallel,
                         std::span<Parameter* const> rank_local, Communicator* rank_local_group) {
  SG_CHECK_CODE(!optimizer.step_scoped_gradients() ||
                    (data_parallel == nullptr && tensor_parallel == nullptr && rank_local_group == nullptr),
                ErrorCode::kUnsupported,
                "step-scoped gradients (Note [Step-scoped gradients]) are not yet reduced across data- or "
                "tensor-parallel ranks; keep the gradients persistent for a parallel step");
  // Whatever an earlier step left (a capture that threw mid-backward keeps
  // its traced gradients' handles) is not this step's.
  optimizer.release_step_gradients();
  if (optimizer.group_count() == 0) {
    check_rank_local(optimizer, rank_local, "backward_and_update");
    backward({});
    if (reduces(data_parallel) && !optimizer.sharded()) {
      if (rank_local.empty()) {
        ops::all_reduce_many_(ctx, *data_parallel, optimizer.all_gradients(), ReduceOp::kSum);
      } else {
        const std::vector<Tensor> grads =
            without_rank_local(optimizer.all_gradients(), optimizer.parameters(), 0,
                               std::unordered_set<const Parameter*>(rank_local.begin(), rank_local.end()));
        if (!grads.empty()) ops::all_reduce_many_(ctx, *data_parallel, grads, ReduceOp::kSum);
      }
    }
    if (reduces(rank_local_group) && !rank_local.empty()) {
      const std::vector<Tensor> grads =
          rank_local_split(optimizer.all_gradients(), optimizer.parameters(), 0,
                           std::unordered_set<const Parameter*>(rank_local.begin(), rank_local.end()), true);
      if (!grads.empty()) ops::all_reduce_many_(ctx, *rank_local_group, grads, ReduceOp::kSum);
    }
    if (optimizer.skips_nonfinite()) {
      optimizer.flag_nonfinite_group(ctx, -1);
    } else {
      optimizer.step(ctx);
    }
  } else {
    AdamW::GroupedStep update(ctx, optimizer, data_parallel, rank_local, rank_local_group);
    backward(std::ref(update));
    update.finish();
  }
  if (optimizer.skips_nonfinite()) {
    Communicator* const communicators[] = {data_parallel, tensor_parallel};
    optimizer.update_if_finite(ctx, communicators);
  }
}

}  // namespace stepgraph
