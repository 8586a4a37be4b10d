#include "trainer/train_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/error.h"
#include "layers/parameter.h"
#include "checkpoint/strict_decimal.h"

namespace stepgraph::trainer {
namespace {

constexpr const char* kStepKey = "stepgraph.step";
constexpr const char* kPositionKey = "stepgraph.data_position";
constexpr std::string_view kConfigPrefix = "config.";
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

// Loads tensors by name and remembers which it used, so that what is left
// (another model's tensors) is refused.
class Loader {
 public:
  Loader(Context& ctx, const Checkpoint& checkpoint) : ctx_(ctx), checkpoint_(checkpoint) {}

  // `finite`: a value training reads (a master weight), refused when NaN or infinite.
  const CheckpointTensor& load(const std::string& name, const Tensor& tensor, bool finite = false) {
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
    ctx_.copy_from_host(tensor, saved.bytes.data(), saved.bytes.size());
    return saved;
  }

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

 private:
  Context& ctx_;
  const Checkpoint& checkpoint_;
  std::set<std::string> used_;
};

std::uint64_t parse_count(const Checkpoint& checkpoint, const char* key) {
  const auto it = checkpoint.metadata.find(key);
  SG_CHECK_CODE(it != checkpoint.metadata.end(), ErrorCode::kIo, "the checkpoint has no '", key,
                "' entry: it was not written by the trainer");
  const std::optional<std::uint64_t> value = parse_decimal(it->second, kMaxCount);
  SG_CHECK_CODE(value.has_value(), ErrorCode::kIo, "the checkpoint's '", key, "' is ", printable(it->second),
                ", not a count (decimal digits, at most ", kMaxCount, ")");
  return *value;
}

// `text` as it is where it is short plain ASCII, else escaped.
std::string shown(const std::string& text) {
  const bool plain = text.size() <= 200 && std::all_of(text.begin(), text.end(), [](char c) {
                       return c >= 0x20 && c < 0x7f && c != '\'' && c != '\\';
                     });
  return plain ? text : printable(text, 200);
}

// Every metadata entry is one this run writes: the configuration (compared
// key by key, both ways), the step and the data position, and the GEMM
// record (read by the trainer's resume).
void check_metadata(const Checkpoint& checkpoint, const RunConfig& config) {
  constexpr int kShown = 24;  // differences listed; the rest counted
  std::string differences;
  int count = 0;
  const auto differ = [&](const std::string& line) {
    if (count++ < kShown) differences += "\n  " + line;
  };
  for (const auto& [key, value] : config) {
    const auto it = checkpoint.metadata.find(key);
    const std::string saved = it == checkpoint.metadata.end() ? "(not recorded)" : shown(it->second);
    if (it == checkpoint.metadata.end() || it->second != value)
      differ(key + ": checkpoint " + saved + ", this run " + value);
  }
  SG_CHECK_CODE(checkpoint.metadata.count("stepgraph.checkpoint_set") == 0, ErrorCode::kIo,
                "the checkpoint is the manifest of per-rank files (written by a run with --dp-mode zero1 or --tp > 1); "
                "resume with the flags that wrote it");
  for (const auto& [key, value] : checkpoint.metadata) {
    if (key == kStepKey || key == kPositionKey || key == kGemmLibraryKey || key == kGemmAlgorithmsKey ||
        config.count(key) != 0) {
      continue;
    }
    SG_CHECK_CODE(key.compare(0, kConfigPrefix.size(), kConfigPrefix) == 0, ErrorCode::kIo,
                  "the checkpoint has an unknown metadata entry ", printable(key),
                  "; it was not written by this trainer");
    // A setting the checkpoint's run made and this run does not (e.g. a
    // schedule where this run has none): the runs differ.
    differ(shown(key) + ": checkpoint " + shown(value) + ", this run (not set: pass --" +
           shown(key.substr(kConfigPrefix.size())) + " as the checkpoint's run did)");
  }
  if (count > kShown) differences += fmt::format("\n  and {} more", count - kShown);
  SG_CHECK(differences.empty(),
           "the checkpoint was written by a run with another configuration; resume with the "
           "same flags or start a new checkpoint:",
           differences);
}

}  // namespace

Checkpoint save_state(Context& ctx, LanguageModel& model, const AdamW& optimizer, const RunConfig& config,
                      const Progress& progress) {
  Checkpoint out;
  out.metadata = config;
  out.metadata[kStepKey] = std::to_string(progress.step);
  out.metadata[kPositionKey] = std::to_string(progress.data_position);
  for (const StateTensor& t : model.state()) out.tensors.push_back(to_checkpoint(ctx, t.name, t.tensor));
  const std::vector<Parameter*> parameters = model.parameters();
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
  SG_CHECK_CODE(parameters.size() == moments.size(), ErrorCode::kInternal, "save_state: ", parameters.size(),
                " parameters but ", moments.size(), " optimizer moments");
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

Progress load_state(Context& ctx, LanguageModel& model, const AdamW& optimizer, const RunConfig& config,
                    const Checkpoint& checkpoint) {
  check_metadata(checkpoint, config);
  Progress progress;
  progress.step = static_cast<std::int64_t>(parse_count(checkpoint, kStepKey));
  progress.data_position = parse_count(checkpoint, kPositionKey);
  // The trainer draws one batch a step: a position that is not the step
  // would resume on other data (or past what the source can count).
  SG_CHECK_CODE(progress.data_position == static_cast<std::uint64_t>(progress.step), ErrorCode::kIo,
                "the checkpoint's '", kPositionKey, "' is ", progress.data_position, " but its '", kStepKey, "' is ",
                progress.step, "; the trainer draws one batch a step, so they must be equal");

  Loader loader(ctx, checkpoint);
  for (const StateTensor& t : model.state()) loader.load(t.name, t.tensor);
  const std::vector<Parameter*> parameters = model.parameters();
  if (optimizer.sharded()) {
    for (const Parameter* p : parameters) {
      loader.load(p->name, p->value, /*finite=*/true);
      run_after_update(ctx, *p);  // what layers derive from the value (an FP8 weight cache)
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
    sync_copy_from_master(ctx, *parameters[i]);
    loader.load(name + ".adam_m", moments[i].m);
    loader.load(name + ".adam_v", moments[i].v);
  }
  loader.load_count("adamw.step", optimizer.step_counter(), progress.step, "AdamW's step counter");
  // The tally of skipped steps goes on where the checkpoint kept one.
  if (optimizer.skips_nonfinite() && has_tensor(checkpoint, "adamw.skipped_steps")) {
    loader.load_count("adamw.skipped_steps", optimizer.skipped_counter(), progress.step, "the skipped steps");
  }
  if (optimizer.scales_loss()) loader.load("adamw.loss_scale", optimizer.loss_scale_state(), /*finite=*/true);
  loader.refuse_unused();
  return progress;
}

}  // namespace stepgraph::trainer
