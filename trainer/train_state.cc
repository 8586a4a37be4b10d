#include "trainer/train_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>

#include "checkpoint/strict_decimal.h"
#include "checkpoint/training_state.h"
#include "engine/error.h"

namespace stepgraph::trainer {
namespace {

constexpr std::string_view kConfigPrefix = "config.";
constexpr std::uint64_t kMaxCount = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

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
  SG_CHECK_CODE(checkpoint.metadata.count(kCheckpointSetKey) == 0, ErrorCode::kIo,
                "the checkpoint is the manifest of per-rank files (written by a run with --dp-mode zero1, --tp > 1, --pp > 1 or --ep > 1); "
                "resume with the flags that wrote it");
  for (const auto& [key, value] : checkpoint.metadata) {
    if (key == kCheckpointStepKey || key == kDataPositionKey || key == kGemmLibraryKey || key == kGemmAlgorithmsKey ||
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

void check_run_config(const Checkpoint& checkpoint, const RunConfig& config) { check_metadata(checkpoint, config); }

Checkpoint save_state(Context& ctx, const ModelState& model, const AdamW& optimizer, const RunConfig& config,
                      const Progress& progress) {
  RunConfig metadata = config;
  metadata[kDataPositionKey] = std::to_string(progress.data_position);
  return save_training_state(ctx, model, optimizer, std::move(metadata), progress.step);
}

Progress load_state(Context& ctx, const ModelState& model, const AdamW& optimizer, const RunConfig& config,
                    const Checkpoint& checkpoint) {
  check_metadata(checkpoint, config);
  Progress progress;
  progress.step = checkpoint_step(checkpoint);
  progress.data_position = parse_count(checkpoint, kDataPositionKey);
  // The trainer draws one batch a step: a position that is not the step
  // would resume on other data (or past what the source can count).
  SG_CHECK_CODE(progress.data_position == static_cast<std::uint64_t>(progress.step), ErrorCode::kIo,
                "the checkpoint's '", kDataPositionKey, "' is ", progress.data_position, " but its '",
                kCheckpointStepKey, "' is ", progress.step, "; the trainer draws one batch a step, so they must be equal");
  load_training_state(ctx, model, optimizer, checkpoint);
  return progress;
}

}  // namespace stepgraph::trainer
