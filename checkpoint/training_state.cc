#include "checkpoint/training_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/strict_decimal.h"
#include "engine/error.h"

namespace stepgraph {
namespace {

constexpr std::uint64_t kMaxCount = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

CheckpointTensor to_checkpoint(Context& ctx, const std::string& name, const Tensor& tensor) {
  CheckpointTensor out{name, tensor.dtype(), tensor.shape().dims(), {}};
  out.bytes.resize(static_cast<std::size_t>(tensor.bytes()));
  ctx.copy_to_host(tensor, out.bytes.data(), out.bytes.size());
  return out;
}

// The first element that is NaN or infinite, for floating dtypes.
std::optional<std::size_t> first_non_finite(const CheckpointTensor& tensor) {
  const std::size_t size = dtype_size(tensor.dtype);
  std::uint32_t mask = 0;
  if (tensor.dtype == DType::kFloat32) mask = 0x7f800000u;
  if (tensor.dtype == DType::kBFloat16) mask = 0x7f80u;
  if (tensor.dtype == DType::kFloat16) mask = 0x7c00u;
  if (mask == 0) return std::nullopt;
  for (std::size_t i = 0; i * size < tensor.bytes.size(); ++i) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, tensor.bytes.data() + i * size, size);
    if ((bits & mask) == mask) return i;  // every exponent bit set: infinite or NaN
  }
  return std::nullopt;
}

// The optimizer must update exactly the model's parameters, in its order:
// moments are saved under their parameter's name.
void check_same_parameters(const ModelState& model, const AdamW& optimizer, const char* what) {
  const std::vector<Parameter*>& updated = optimizer.parameters();
  SG_CHECK(updated == model.parameters, what, ": the optimizer updates ",
           updated.size() == model.parameters.size() ? "other parameters than the model's"
                                                      : fmt::format("{} parameter(s) and the model has {}",
                                                                    updated.size(), model.parameters.size()),
           "; pass the optimizer made over this model's parameters (and only them)");
}

// Checks tensors by name and remembers which it used, so that what is left
// (another model's tensors) is refused. Nothing is copied until commit(),
// after every check: a refused checkpoint leaves the model and optimizer as
// they were.
class Loader {
 public:
  Loader(Context& ctx, const Checkpoint& checkpoint) : ctx_(ctx), checkpoint_(checkpoint) {}

  // `finite`: a value training reads (a master weight), refused when NaN or infinite.
  void load(const std::string& name, const Tensor& tensor, bool finite = false) {
    const CheckpointTensor& saved = find_tensor(checkpoint_, name);
    used_.insert(name);
    SG_CHECK_CODE(saved.dtype == tensor.dtype() && Shape(saved.shape) == tensor.shape(), ErrorCode::kIo,
                  "checkpoint tensor '", name, "' is ", Shape(saved.shape), " ", dtype_name(saved.dtype),
                  " but this model's is ", tensor.shape(), " ", dtype_name(tensor.dtype()),
                  " (written by another model, dtype or world size?)");
    SG_CHECK_CODE(static_cast<std::int64_t>(saved.bytes.size()) == tensor.bytes(), ErrorCode::kIo,
                  "checkpoint tensor '", name, "' holds ", saved.bytes.size(), " bytes, expected ", tensor.bytes());
    if (finite) {
      const std::optional<std::size_t> at = first_non_finite(saved);
      SG_CHECK_CODE(!at.has_value(), ErrorCode::kIo, "checkpoint tensor '", name,
                    "' has a NaN or infinite value (element ", at.value_or(0),
                    "): the run that wrote it had diverged; resume from an earlier checkpoint");
    }
    copies_.push_back({tensor, &saved});
  }

  // What to run once the copies are done (a dtype copy of a master, an FP8 weight cache).
  void then(std::function<void()> action) { actions_.push_back(std::move(action)); }

  // An int64 [1] counter that must lie in [0, max].
  void load_count(const std::string& name, const Tensor& tensor, std::int64_t max, const char* what) {
    const CheckpointTensor& saved = find_tensor(checkpoint_, name);
    SG_CHECK_CODE(saved.dtype == DType::kInt64 && saved.bytes.size() == sizeof(std::int64_t), ErrorCode::kIo,
                  "checkpoint tensor '", name, "' is ", Shape(saved.shape), " ", dtype_name(saved.dtype),
                  ", not one int64 (", what, ")");
    std::int64_t value = 0;
    std::memcpy(&value, saved.bytes.data(), sizeof(value));
    SG_CHECK_CODE(value >= 0 && value <= max, ErrorCode::kIo, "checkpoint tensor '", name, "' (", what, ") is ", value,
                  ", outside [0, ", max, "] for a checkpoint after ", max, " steps");
    load(name, tensor);
  }

  // Tensors of the checkpoint that nothing loaded.
  void refuse_unused() const {
    std::vector<std::string> extra;
    for (const CheckpointTensor& tensor : checkpoint_.tensors) {
      if (used_.count(tensor.name) == 0) extra.push_back(tensor.name);
    }
    if (extra.empty()) return;
    std::string names;
    for (std::size_t i = 0; i < std::min<std::size_t>(extra.size(), 8); ++i) {
      names += (i == 0 ? "" : ", ") + printable(extra[i]);
    }
    if (extra.size() > 8) names += fmt::format(" and {} more", extra.size() - 8);
    SG_THROW(ErrorCode::kIo, "the checkpoint has ", extra.size(), " tensor(s) this model does not have: ", names,
             " (written by another model or configuration?)");
  }

  // Every checked tensor into the model, then the actions.
  void commit() {
    for (const auto& [tensor, saved] : copies_) ctx_.copy_from_host(tensor, saved->bytes.data(), saved->bytes.size());
    for (const std::function<void()>& action : actions_) action();
  }

 private:
  Context& ctx_;
  const Checkpoint& checkpoint_;
  std::set<std::string> used_;
  std::vector<std::pair<Tensor, const CheckpointTensor*>> copies_;
  std::vector<std::function<void()>> actions_;
};

}  // namespace

Checkpoint save_training_state(Context& ctx, const ModelState& model, const AdamW& optimizer,
                               std::map<std::string, std::string> metadata, std::int64_t step) {
  check_same_parameters(model, optimizer, "save_training_state");
  SG_CHECK(step >= 0, "save_training_state: step must be >= 0, got ", step);
  Checkpoint out;
  out.metadata = std::move(metadata);
  out.metadata[kCheckpointStepKey] = std::to_string(step);
  for (const StateTensor& t : model.state) out.tensors.push_back(to_checkpoint(ctx, t.name, t.tensor));
  const std::vector<Parameter*>& parameters = model.parameters;
  if (optimizer.sharded()) {
    for (const Parameter* p : parameters) out.tensors.push_back(to_checkpoint(ctx, p->name, p->value));
    for (const AdamW::ShardState& shard : optimizer.shard_states()) {
      out.tensors.push_back(to_checkpoint(ctx, shard.name + ".master", shard.master));
      out.tensors.push_back(to_checkpoint(ctx, shard.name + ".adam_m", shard.m));
      out.tensors.push_back(to_checkpoint(ctx, shard.name + ".adam_v", shard.v));
    }
    out.tensors.push_back(to_checkpoint(ctx, "adamw.step", optimizer.step_counter()));
    return out;
  }
  const std::vector<AdamW::Moments> moments = optimizer.moments();
  SG_CHECK_CODE(parameters.size() == moments.size(), ErrorCode::kInternal, "save_training_state: ",
                parameters.size(), " parameters but ", moments.size(), " optimizer moments");
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const std::string& name = parameters[i]->name;
    out.tensors.push_back(to_checkpoint(ctx, name + ".master", parameters[i]->master));
    out.tensors.push_back(to_checkpoint(ctx, name + ".adam_m", moments[i].m));
    out.tensors.push_back(to_checkpoint(ctx, name + ".adam_v", moments[i].v));
  }
  out.tensors.push_back(to_checkpoint(ctx, "adamw.step", optimizer.step_counter()));
  if (optimizer.skips_nonfinite()) {
    out.tensors.push_back(to_checkpoint(ctx, "adamw.skipped_steps", optimizer.skipped_counter()));
  }
  if (optimizer.scales_loss()) {  // the scale and its run of good steps: a resume scales as the run would have
    out.tensors.push_back(to_checkpoint(ctx, "adamw.loss_scale", optimizer.loss_scale_state()));
  }
  return out;
}

std::int64_t checkpoint_step(const Checkpoint& checkpoint) {
  const auto it = checkpoint.metadata.find(kCheckpointStepKey);
  SG_CHECK_CODE(it != checkpoint.metadata.end(), ErrorCode::kIo, "the checkpoint has no '", kCheckpointStepKey,
                "' entry: it was not written by StepGraph (the trainer or sg_checkpoint_save)");
  const std::optional<std::uint64_t> value = parse_decimal(it->second, kMaxCount);
  SG_CHECK_CODE(value.has_value(), ErrorCode::kIo, "the checkpoint's '", kCheckpointStepKey, "' is ",
                printable(it->second), ", not a count (decimal digits, at most ", kMaxCount, ")");
  return static_cast<std::int64_t>(*value);
}

std::int64_t load_training_state(Context& ctx, const ModelState& model, const AdamW& optimizer,
                                 const Checkpoint& checkpoint) {
  check_same_parameters(model, optimizer, "load_training_state");
  SG_CHECK_CODE(checkpoint.metadata.count(kCheckpointSetKey) == 0, ErrorCode::kIo,
                "the checkpoint is the manifest of per-rank files (a sharded optimizer's or model's, one part per "
                "rank): load it with the world that wrote it, each rank its own part");
  const std::int64_t step = checkpoint_step(checkpoint);
  Loader loader(ctx, checkpoint);
  for (const StateTensor& t : model.state) loader.load(t.name, t.tensor);
  const std::vector<Parameter*>& parameters = model.parameters;
  if (optimizer.sharded()) {
    for (Parameter* p : parameters) {
      loader.load(p->name, p->value, /*finite=*/true);
      loader.then([&ctx, p] { run_after_update(ctx, *p); });  // what layers derive from the value (an FP8 weight cache)
    }
    for (const AdamW::ShardState& shard : optimizer.shard_states()) {
      loader.load(shard.name + ".master", shard.master, /*finite=*/true);
      loader.load(shard.name + ".adam_m", shard.m);
      loader.load(shard.name + ".adam_v", shard.v);
    }
  }
  const std::vector<AdamW::Moments> moments = optimizer.sharded() ? std::vector<AdamW::Moments>{} : optimizer.moments();
  for (std::size_t i = 0; i < moments.size(); ++i) {
    const std::string& name = parameters[i]->name;
    loader.load(name + ".master", parameters[i]->master, /*finite=*/true);
    loader.then([&ctx, p = parameters[i]] { sync_copy_from_master(ctx, *p); });
    loader.load(name + ".adam_m", moments[i].m);
    loader.load(name + ".adam_v", moments[i].v);
  }
  loader.load_count("adamw.step", optimizer.step_counter(), step, "AdamW's step counter");
  // The tally of skipped steps goes on where the checkpoint kept one.
  if (optimizer.skips_nonfinite() && has_tensor(checkpoint, "adamw.skipped_steps")) {
    loader.load_count("adamw.skipped_steps", optimizer.skipped_counter(), step, "the skipped steps");
  }
  if (optimizer.scales_loss()) loader.load("adamw.loss_scale", optimizer.loss_scale_state(), /*finite=*/true);
  loader.refuse_unused();
  loader.commit();
  return step;
}

std::int64_t steps_run(Context& ctx, const AdamW& optimizer) {
  return optimizer.steps_taken(ctx) + (optimizer.skips_nonfinite() ? optimizer.skipped_steps(ctx) : 0);
}

}  // namespace stepgraph
