// Per-rank checkpoint files that commit together (a sharded optimizer or
// model: each rank saves its own part).
//
// Note [Checkpoint sets]
// Each rank writes its part to a file of its own, named after the step, the
// rank and the part's checksum: PATH.step<S>.rank<r>-of-<n>.<16 hex digits>,
// atomically (Note [Atomic file writes]). Once every rank's part is durable
// (the ranks exchange their checksums, which is also the barrier), every
// rank writes the manifest at PATH: a checkpoint with no tensors whose
// metadata names the step, the world size and every part's checksum. The
// manifest's rename is the commit: before it, PATH names the previous set,
// whose files are all still there; after it, the new set. Only then does
// each rank delete its own parts of earlier steps. A process killed at any
// point of a save therefore leaves a complete set at PATH, and a set is
// loaded only through its manifest, each part checked against the checksum
// the manifest names. All ranks write identical manifests, so ranks that
// share a file system and ranks that do not both find one at PATH.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/atomic_file.h"
#include "checkpoint/checkpoint.h"

namespace stepgraph {

// Every rank's string, in rank order, from every rank's call (an
// all-gather; each rank calls it at the same point).
using ExchangeStrings = std::function<std::vector<std::string>(const std::string&)>;

// Which file of a set a write point belongs to.
enum class SetFile { kPart, kManifest };
using SetWriteObserver = std::function<void(SetFile, WritePoint)>;

// The file rank `rank` of `ranks` writes at step `step`, its checksum "fnv1a64:<hex>".
std::filesystem::path checkpoint_set_part_path(const std::filesystem::path& manifest, std::int64_t step, int rank,
                                               int ranks, std::string_view checksum);

// Called by every rank with its part; returns once the set is committed.
void write_checkpoint_set(const std::filesystem::path& manifest, std::int64_t step, int rank, int ranks,
                          const Checkpoint& part, const ExchangeStrings& exchange,
                          const SetWriteObserver& observer = {});

struct CheckpointSetPart {
  std::int64_t step = 0;       // the manifest's
  std::filesystem::path file;  // the part's file
  Checkpoint checkpoint;       // its contents
};

// This rank's part of the set whose manifest is at `manifest`. Error(kIo)
// for a file that is no manifest (a single-file checkpoint), a set of
// another world size, a missing part, or a part that is not the one the
// manifest names (its checksum), each naming what differs.
CheckpointSetPart read_checkpoint_set_part(const std::filesystem::path& manifest, int rank, int ranks);

}  // namespace stepgraph
