// The runner tests' short run: 3 warmup steps, 3 timed steps and a loss
// check over 3 steps, on `device`.
#pragma once

#include "benchmarks/step_runner.h"

namespace stepgraph::bench {

inline StepRunOptions quick(Device device) {
  StepRunOptions options;
  options.device = device;
  options.steps = 3;
  options.warmup = 3;
  options.loss_check_steps = 3;
  return options;
}

}  // namespace stepgraph::bench
