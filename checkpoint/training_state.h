// A model's and its AdamW's whole training state as a checkpoint
// (checkpoint/checkpoint.h) and back: every parameter's fp32 master, AdamW's
// m and v, the device step counter, the tally of skipped steps and the loss
// scale where the optimizer keeps them, and the model's other persistent
// state (its StateTensors: FP8 delayed scaling's amax histories and scales,
// the dropout generator). A sharded optimizer (ZeRO-1) is saved per rank:
// this rank's shards of the masters and moments, the step counter, and every
// parameter's value (what the layers read), so each rank's part restores that
// rank alone (the parts commit together: checkpoint/checkpoint_set.h).
// Loading restores everything a step reads, so the steps after a load equal
// an uninterrupted run's bit for bit.
//
// The trainer (trainer/train_state.h) and the C API (sg_checkpoint_save and
// sg_checkpoint_load) both save and load through here. Besides the step,
// a checkpoint's metadata is its writer's: the trainer's flags and data
// position, a script's key/value pairs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "engine/context.h"
#include "layers/parameter.h"
#include "optim/adamw.h"

namespace stepgraph {

// The metadata entry of the steps the run completed, a decimal count.
inline constexpr const char* kCheckpointStepKey = "stepgraph.step";
// The entry that marks the manifest of per-rank files (Note [Checkpoint sets]).
inline constexpr const char* kCheckpointSetKey = "stepgraph.checkpoint_set";

// What is saved of a model: its parameters, in the order its optimizer was
// made over them, and the rest of its persistent state.
struct ModelState {
  std::vector<Parameter*> parameters;
  std::vector<StateTensor> state;
};

// The state of `model` and `optimizer` after `step` steps, with `metadata`
// (kCheckpointStepKey is set to `step`). Error(kInvalidArgument) where the
// optimizer updates other parameters than the model's.
Checkpoint save_training_state(Context& ctx, const ModelState& model, const AdamW& optimizer,
                               std::map<std::string, std::string> metadata, std::int64_t step);

// The checkpoint's kCheckpointStepKey; Error(kIo) where it is missing or not
// a decimal count.
std::int64_t checkpoint_step(const Checkpoint& checkpoint);

// Loads every tensor of `checkpoint` into the model and optimizer and returns
// its step. Error(kIo) for a manifest of per-rank files (load the part of
// this rank instead), a missing tensor, one this model does not have, a wrong
// shape or dtype (each naming the tensor), a NaN or infinite master, and
// counters outside [0, step]. Metadata other than the step is not read: it
// is the caller's to check.
std::int64_t load_training_state(Context& ctx, const ModelState& model, const AdamW& optimizer,
                                 const Checkpoint& checkpoint);

// The steps `optimizer` has run: its updates and, with the non-finite skip,
// the steps it skipped. Reads the device (not while tracing).
std::int64_t steps_run(Context& ctx, const AdamW& optimizer);

}  // namespace stepgraph
