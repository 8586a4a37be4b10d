#include "trainer/checkpoint_layout.h"

#include <limits>
#include <vector>

#include "checkpoint/checkpoint_set.h"
#include "checkpoint/strict_decimal.h"
#include "checkpoint/training_state.h"
#include "engine/error.h"

namespace stepgraph::trainer {
namespace {

// The manifest's world size (Note [Checkpoint sets]); 0 where it has none
// that reads as one (read_checkpoint_set_part then says what is wrong).
constexpr const char* kSetWorldKey = "stepgraph.world_size";

int set_world(const Checkpoint& manifest) {
  const auto it = manifest.metadata.find(kSetWorldKey);
  if (it == manifest.metadata.end()) return 0;
  const std::optional<std::uint64_t> world =
      parse_decimal(it->second, static_cast<std::uint64_t>(std::numeric_limits<int>::max()));
  return world ? static_cast<int>(*world) : 0;
}

// Names the flags a set's run differs in from `run`: reads this rank's part,
// or rank 0's where the set has another world size. Where no part can be
// read (another host's disk, a broken set) it says nothing, and what follows
// reports the set.
void name_set_flags(const std::string& path, const Checkpoint& manifest, int rank, int ranks, const RunConfig& run,
                    const CanonicalFlags& canonical) {
  const int world = set_world(manifest);
  if (world < 1) return;
  std::optional<CheckpointSetPart> part;
  try {
    part = read_checkpoint_set_part(path, world == ranks ? rank : 0, world);
  } catch (const Error&) {
    return;
  }
  canonical(part->checkpoint);
  check_run_config(part->checkpoint, run);
}

}  // namespace

CheckpointLayout checkpoint_layout(const TrainerOptions& o, bool sharded_optimizer) {
  std::vector<std::string> flags;
  if (sharded_optimizer) flags.push_back("--dp-mode zero1");
  if (o.tp > 1) flags.push_back("--tp " + std::to_string(o.tp));
  if (o.pp > 1) flags.push_back("--pp " + std::to_string(o.pp));
  if (o.ep > 1) flags.push_back("--ep " + std::to_string(o.ep));
  CheckpointLayout layout;
  layout.per_rank = !flags.empty();
  for (const std::string& flag : flags) layout.why += (layout.why.empty() ? "" : ", ") + flag;
  return layout;
}

ResumeSource read_resume_checkpoint(const std::string& path, int rank, int ranks, const CheckpointLayout& layout,
                                    const RunConfig& run, const CanonicalFlags& canonical) {
  // The one file, or a set's manifest (no tensors).
  Checkpoint top = read_checkpoint(path);
  const bool set = top.metadata.count(kCheckpointSetKey) != 0;
  if (layout.per_rank) {
    if (!set) {
      // One file: a run whose ranks held the same state wrote it.
      canonical(top);
      check_run_config(top, run);
    } else if (set_world(top) != ranks) {
      name_set_flags(path, top, rank, ranks, run, canonical);
    }
    CheckpointSetPart part = read_checkpoint_set_part(path, rank, ranks);
    canonical(part.checkpoint);
    return {std::move(part.checkpoint), part.step, part.file.string()};
  }
  // A set of parts where this run reads one file: name the flags that made it.
  if (set) name_set_flags(path, top, rank, ranks, run, canonical);
  canonical(top);
  return {std::move(top), std::nullopt, path};
}

void write_rank_checkpoint(const std::string& path, const CheckpointLayout& layout, std::int64_t step, int rank,
                           int ranks, const Checkpoint& state, Communicator* world) {
  if (!layout.per_rank) {
    if (rank == 0) write_checkpoint(path, state);
    return;
  }
  write_checkpoint_set(path, step, rank, ranks, state, [&](const std::string& checksum) {
    return world != nullptr ? world->exchange(checksum, "checkpoint checksums") : std::vector<std::string>{checksum};
  });
}

}  // namespace stepgraph::trainer
