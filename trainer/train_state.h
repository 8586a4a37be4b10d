// The trainer's state as a checkpoint and back: the model's and optimizer's
// whole state (checkpoint/training_state.h), the data source's position, and
// the run's configuration as metadata, so resuming with another
// configuration is a clear error instead of a silently different run.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "checkpoint/checkpoint.h"
#include "engine/context.h"
#include "checkpoint/training_state.h"
#include "optim/adamw.h"

namespace stepgraph::trainer {

struct Progress {
  std::int64_t step = 0;            // steps completed
  std::uint64_t data_position = 0;  // DataSource::position() after them
};

using RunConfig = std::map<std::string, std::string>;  // "config.<name>" -> value

// Where the data source stands after the checkpoint's steps, a decimal count.
inline constexpr const char* kDataPositionKey = "stepgraph.data_position";
// What the trainer records of its GEMM algorithms (Note [Deterministic
// algorithm choice] in engine/algorithm_choice.h): the library and GPU they
// were picked for, and a timed run's picks. load_state leaves them to the
// trainer's resume.
inline constexpr const char* kGemmLibraryKey = "stepgraph.gemm_library";
inline constexpr const char* kGemmAlgorithmsKey = "stepgraph.gemm_algorithms";

// `config` and the data position as metadata over save_training_state.
// `model`: a LanguageModel's parameters and state, or a pipeline stage's
// parameters (each stage saves its own).
Checkpoint save_state(Context& ctx, const ModelState& model, const AdamW& optimizer, const RunConfig& config,
                      const Progress& progress);

// Error(kInvalidArgument) listing every difference between `checkpoint`'s
// configuration and `config`, both ways (load_state's first check).
void check_run_config(const Checkpoint& checkpoint, const RunConfig& config);

// Checks `checkpoint`'s configuration against `config` both ways
// (Error(kInvalidArgument) listing every difference, a setting recorded in
// the checkpoint but absent from this run included), loads every tensor into
// the model and optimizer (load_training_state) and returns the progress.
// Error(kIo) for an unknown metadata entry, a step or data position that is
// not a decimal count (or not equal), and what load_training_state refuses.
Progress load_state(Context& ctx, const ModelState& model, const AdamW& optimizer, const RunConfig& config,
                    const Checkpoint& checkpoint);

}  // namespace stepgraph::trainer
