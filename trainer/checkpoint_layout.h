// Which ranks of a run write its checkpoint, and what a resume reads.
//
// Note [Checkpoint parts in the trainer]
// Where every rank holds the same state (one rank, or data-parallel
// replicas), rank 0 writes one file at --checkpoint. Where ranks hold
// different state, every rank writes its own part of a set that the
// manifest at --checkpoint commits (Note [Checkpoint sets] in
// checkpoint/checkpoint_set.h): a sharded optimizer (--dp-mode zero1: its
// shards), a model split over the ranks (--tp: a slice of every weight;
// --pp: its stage's blocks; --ep: its experts). Every part records the run's
// flags. A resume reads the layout its own flags write; a checkpoint laid out
// otherwise (one file against a set, or a set of another world size) first
// has the flags that differ from its own record named, before any load.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "engine/communicator.h"
#include "trainer/options.h"
#include "trainer/train_state.h"

namespace stepgraph::trainer {

struct CheckpointLayout {
  bool per_rank = false;
  std::string why;  // the flags that make it a part per rank ("--ep 2"); empty for one file
};

// The layout of `o`'s checkpoints; `sharded_optimizer`: the optimizer is ZeRO-1's.
CheckpointLayout checkpoint_layout(const TrainerOptions& o, bool sharded_optimizer);

// Rewrites a checkpoint's recorded flag texts into the spelling this run
// records them in, before they are compared (train_loop.cc's canonical_saved_flags).
using CanonicalFlags = std::function<void(Checkpoint&)>;

struct ResumeSource {
  Checkpoint checkpoint;                      // this rank's part, or the one file; its flags canonical
  std::optional<std::int64_t> manifest_step;  // a part's: the step its manifest commits
  std::string file;                           // where it was read, for messages
};

// What rank `rank` of `ranks` resumes from at `path` under `layout`. Error
// (kInvalidArgument) listing the flags that differ from the checkpoint's own
// record where it is laid out otherwise; Error(kIo) for what cannot be read
// (read_checkpoint, read_checkpoint_set_part).
ResumeSource read_resume_checkpoint(const std::string& path, int rank, int ranks, const CheckpointLayout& layout,
                                    const RunConfig& run, const CanonicalFlags& canonical);

// Writes `state` at `path` as `layout` says: rank 0's one file (the other
// ranks write nothing), or this rank's part of the set at step `step`, every
// rank calling (their checksums exchanged over `world`, null for one rank).
void write_rank_checkpoint(const std::string& path, const CheckpointLayout& layout, std::int64_t step, int rank,
                           int ranks, const Checkpoint& state, Communicator* world);

}  // namespace stepgraph::trainer
