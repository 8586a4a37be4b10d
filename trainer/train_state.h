// The trainer's state as a checkpoint (checkpoint/checkpoint.h) and back: every
// parameter's fp32 master, AdamW's m and v, the model's other persistent state
// (FP8 delayed scaling's amax histories and scales), the device step counter, the data
// source's position, and the run's configuration as metadata, so resuming
// with another configuration is a clear error instead of a silently different
// run. Resuming restores everything a step reads, so the steps after a resume
// equal an uninterrupted run's bit for bit.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "engine/context.h"
#include "optim/adamw.h"
#include "layers/language_model.h"
#include "checkpoint/checkpoint.h"

namespace stepgraph::trainer {

struct Progress {
  std::int64_t step = 0;            // steps completed
  std::uint64_t data_position = 0;  // DataSource::position() after them
};

using RunConfig = std::map<std::string, std::string>;  // "config.<name>" -> value

// What the trainer records of its GEMM algorithms (Note [Deterministic
// algorithm choice] in engine/algorithm_choice.h): the library and GPU they
// were picked for, and a timed run's picks. load_state leaves them to the
// trainer's resume.
inline constexpr const char* kGemmLibraryKey = "stepgraph.gemm_library";
inline constexpr const char* kGemmAlgorithmsKey = "stepgraph.gemm_algorithms";

// A sharded optimizer (ZeRO-1) is saved per rank: this rank's shards of the
// masters and moments, the step counter, and every parameter's value (what
// the layers read), so each rank's part restores that rank alone (the parts
// commit together: checkpoint/checkpoint_set.h).
Checkpoint save_state(Context& ctx, LanguageModel& model, const AdamW& optimizer, const RunConfig& config,
                      const Progress& progress);

// Checks `checkpoint`'s configuration against `config` both ways
// (Error(kInvalidArgument) listing every difference, a setting recorded in
// the checkpoint but absent from this run included), loads every tensor into
// the model and optimizer and returns the progress. Error(kIo) for a missing
// tensor, one this model does not have, a wrong shape or dtype, a NaN or
// infinite master, an unknown metadata entry, a step or data position that is
// not a decimal count (or not equal), and counters outside [0, step].
Progress load_state(Context& ctx, LanguageModel& model, const AdamW& optimizer, const RunConfig& config,
                    const Checkpoint& checkpoint);

}  // namespace stepgraph::trainer
