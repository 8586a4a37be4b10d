// Dropout whose generator state is on the device (kernels/dropout.h): the
// ops read {seed, counter} (int64 [2], persistent) at every launch, so a
// captured step draws new numbers once rng_advance_ moves the counter.
#pragma once

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

struct DropoutParams {
  float p = 0.0f;
  std::int64_t offset = 0;  // draws before this call's in the step (kernels::dropout_draws of the earlier calls)
  bool operator==(const DropoutParams&) const = default;
  std::string to_string() const;
};

// x * keep / (1 - p) (a new tensor like x); the same state and offset keep
// the same elements, so dropout(dy, ...) with a forward's offset is its backward.
Tensor dropout(Context& ctx, const Tensor& x, const Tensor& state, const DropoutParams& params);
// state[1] += draws.
void rng_advance_(Context& ctx, const Tensor& state, std::int64_t draws);

const OpDef& dropout_op();
const OpDef& rng_advance_op();

}  // namespace stepgraph::ops
