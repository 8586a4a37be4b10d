// One step of the dynamic loss scale's rule (Note [Loss scaling] in
// kernels/step_guard.h), the same code for the kernel and the host reference.
#pragma once

#include "kernels/host_device.h"
#include "kernels/step_guard.h"

namespace stepgraph::kernels {

SG_HOST_DEVICE void loss_scale_step(const LossScaling& scaling, float* state, bool overflowed) {
  float scale = state[0];
  float good = state[2];
  if (overflowed) {
    scale = scale * scaling.backoff_factor;
    scale = scale < scaling.min_scale ? scaling.min_scale : scale;
    good = 0.0f;
  } else {
    good = good + 1.0f;  // exact: intervals are far below 2^24
    if (good >= static_cast<float>(scaling.growth_interval)) {
      scale = scale * scaling.growth_factor;
      scale = scale > scaling.max_scale ? scaling.max_scale : scale;
      good = 0.0f;
    }
  }
  state[0] = scale;
  state[1] = 1.0f / scale;  // exact for a power of two
  state[2] = good;
}

}  // namespace stepgraph::kernels
