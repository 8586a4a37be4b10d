#include "trainer/train_state.h"

#include <cstddef>
#include <string>
#include <vector>

#include "engine/error.h"
#include "layers/parameter.h"

namespace stepgraph::trainer {
namespace {

constexpr const char* kStepKey = "stepgraph.step";
constexpr const char* kPositionKey = "stepgraph.data_position";

CheckpointTensor to_checkpoint(Context& ctx, const std::string& name, const Tensor& tensor) {
  CheckpointTensor out{name, tensor.dtype(), tensor.shape().dims(), {}};
  out.bytes.resize(static_cast<std::size_t>(tensor.bytes()));
  ctx.copy_to_host(tensor, out.bytes.data(), out.bytes.size());
  return out;
}

void from_checkpoint(Context& ctx, const Checkpoint& checkpoint, const std::string& name, const Tensor& tensor) {
  const CheckpointTensor& saved = find_tensor(checkpoint, name);
  SG_CHECK_CODE(saved.dtype == tensor.dtype() && Shape(saved.shape) == tensor.shape(), ErrorCode::kIo,
                "checkpoint tensor '", name, "' is ", Shape(saved.shape), " ", dtype_name(saved.dtype),
                " but this model's is ", tensor.shape(), " ", dtype_name(tensor.dtype()));
  SG_CHECK_CODE(static_cast<std::int64_t>(saved.bytes.size()) == tensor.bytes(), ErrorCode::kIo, "checkpoint tensor '",
                name, "' holds ", saved.bytes.size(), " bytes, expected ", tensor.bytes());
  ctx.copy_from_host(tensor, saved.bytes.data(), saved.bytes.size());
}

std::uint64_t parse_count(const Checkpoint& checkpoint, const char* key) {
  const auto it = checkpoint.metadata.find(key);
  SG_CHECK_CODE(it != checkpoint.metadata.end(), ErrorCode::kIo, "the checkpoint has no '", key,
                "' entry: it was not written by the trainer");
  try {
    std::size_t used = 0;
    const unsigned long long value = std::stoull(it->second, &used);
    if (used == it->second.size()) return value;
  } catch (const std::exception&) {
  }
  SG_THROW(ErrorCode::kIo, "the checkpoint's '", key, "' is '", it->second, "', not a count");
}

}  // namespace

std::string shard_checkpoint_path(const std::string& path, int rank, int ranks) {
  return path + ".rank" + std::to_string(rank) + "-of-" + std::to_string(ranks);
}

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
  std::string differences;
  for (const auto& [key, value] : config) {
    const auto it = checkpoint.metadata.find(key);
    const std::string saved = it == checkpoint.metadata.end() ? "(absent)" : it->second;
    if (saved != value) differences += "\n  " + key + ": checkpoint " + saved + ", this run " + value;
  }
  SG_CHECK(differences.empty(),
           "the checkpoint was written by a run with another configuration; resume with the "
           "same flags or start a new checkpoint:",
           differences);

  for (const StateTensor& t : model.state()) from_checkpoint(ctx, checkpoint, t.name, t.tensor);
  const std::vector<Parameter*> parameters = model.parameters();
  if (optimizer.sharded()) {
    for (const Parameter* p : parameters) {
      from_checkpoint(ctx, checkpoint, p->name, p->value);
      run_after_update(ctx, *p);  // what layers derive from the value (an FP8 weight cache)
    }
    for (const AdamW::ShardState& shard : optimizer.shard_states()) {
      from_checkpoint(ctx, checkpoint, shard.name + ".master", shard.master);
      from_checkpoint(ctx, checkpoint, shard.name + ".adam_m", shard.m);
      from_checkpoint(ctx, checkpoint, shard.name + ".adam_v", shard.v);
    }
  }
  const std::vector<AdamW::Moments> moments = optimizer.sharded() ? std::vector<AdamW::Moments>{} : optimizer.moments();
  for (std::size_t i = 0; i < moments.size(); ++i) {
    const std::string& name = parameters[i]->name;
    from_checkpoint(ctx, checkpoint, name + ".master", parameters[i]->master);
    sync_copy_from_master(ctx, *parameters[i]);
    from_checkpoint(ctx, checkpoint, name + ".adam_m", moments[i].m);
    from_checkpoint(ctx, checkpoint, name + ".adam_v", moments[i].v);
  }
  from_checkpoint(ctx, checkpoint, "adamw.step", optimizer.step_counter());
  // The tally of skipped steps goes on where the checkpoint kept one.
  if (optimizer.skips_nonfinite() && has_tensor(checkpoint, "adamw.skipped_steps")) {
    from_checkpoint(ctx, checkpoint, "adamw.skipped_steps", optimizer.skipped_counter());
  }
  if (optimizer.scales_loss()) from_checkpoint(ctx, checkpoint, "adamw.loss_scale", optimizer.loss_scale_state());
  Progress progress;
  progress.step = static_cast<std::int64_t>(parse_count(checkpoint, kStepKey));
  progress.data_position = parse_count(checkpoint, kPositionKey);
  return progress;
}

}  // namespace stepgraph::trainer
