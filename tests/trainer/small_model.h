// The trainer tests' small model, as flags before resolve_defaults: two
// blocks of hidden 32 and ffn 64, the sequence model or the window model,
// and the run's length, logging, dtype and seed named by each test.
#pragma once

#include <cstdint>

#include "engine/dtype.h"
#include "trainer/options.h"

namespace stepgraph::trainer::testing {

// kSequence: 2 heads over 4 sequences of 8 tokens a step; kWindow: MLP
// blocks over 16 examples of 2 tokens a step.
enum class SmallModel : std::uint8_t { kSequence, kWindow };

struct SmallRun {
  std::int64_t steps = 0;
  std::int64_t log_every = 0;
  DType dtype = DType::kFloat32;
  std::uint64_t seed = 1;
};

inline TrainerOptions small_model_flags(SmallModel model, const SmallRun& run) {
  TrainerOptions o;
  o.steps = run.steps;
  o.layers = 2;
  o.hidden = 32;
  o.ffn = 64;
  if (model == SmallModel::kWindow) {
    o.heads = 0;
    o.batch = 16;
    o.context = 2;
  } else {
    o.heads = 2;
    o.batch = 4;
    o.seq_len = 8;
  }
  o.log_every = run.log_every;
  o.dtype = run.dtype;
  o.seed = run.seed;
  return o;
}

}  // namespace stepgraph::trainer::testing
