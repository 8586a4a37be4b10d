// The training loop: data source -> LanguageModel + AdamW -> TrainStep,
// run eager or captured once as a graph and replayed, with step lines, a
// progress line on a terminal, checkpoints, resume, and a summary.
//
//   step 50 loss 2.3456 tokens/s 123456 step_ms 1.23
//   step 50 loss 2.3456 aux 0.01234 tokens/s 123456 step_ms 1.23   (with --moe-aux-loss)
//
// tokens/s counts predicted tokens (one per example: batch per step); the
// time of a step is the wall time from copying its batch in to reading its
// loss and input checks back (every step reads both), with the next batch
// drawn meanwhile (Note [Drawing the next batch during the step]).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "engine/communicator.h"
#include "engine/device.h"
#include "engine/tensor.h"
#include "trainer/options.h"

namespace stepgraph::trainer {

struct TrainResult {
  std::int64_t first_step = 1;  // the first step this run took (after a resume: checkpoint step + 1)
  std::vector<float> losses;    // the loss of every step this run took, in order
  std::vector<float> aux_losses;  // with --moe-aux-loss: every step's MoE auxiliary loss (summed over the blocks)
  std::optional<double> entropy_rate;
  double mean_tokens_per_s = 0;
  // The mean loss of the last kFloorWindow steps, and the first step at which
  // that moving mean came within kFloorMargin nats of the entropy rate.
  double final_mean_loss = 0;
  std::optional<std::int64_t> floor_step;
};

inline constexpr std::int64_t kFloorWindow = 50;
inline constexpr double kFloorMargin = 0.05;

// `options` as returned by resolve_defaults for `device`. Writes the log to
// `out`; a progress line goes to stderr when it is a terminal.
//
// With `world` (a communicator of N > 1 ranks: trainer/distributed.h) this
// rank trains data-parallel: every rank draws the same global batch of
// --batch examples and trains on its 1/N slice; the gradients are summed
// across the ranks inside the step and the loss is the global mean, so every
// rank holds the same model. Rank 0 writes the checkpoints (the state is the
// same on every rank), or where ranks hold different state (--tp, --pp,
// --ep, ZeRO-1) each rank its part (trainer/checkpoint_layout.h); the ranks
// compare their flags first. --tp, --cp, --pp and --ep split the world
// otherwise (trainer/README.md, Several GPUs).
TrainResult train(const TrainerOptions& options, Device device, std::ostream& out, Communicator* world = nullptr);

}  // namespace stepgraph::trainer
