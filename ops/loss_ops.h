// Softmax cross-entropy, forward and backward in one op (kernels/cross_entropy.h):
// the mean loss over the tokens whose label is not ignore_index, and the
// gradient of that loss (times loss_scale) with respect to the logits.
// Out-of-range labels set `error_flag` (a persistent int32 [1] the caller
// owns and checks after the step); nothing is read back inside the step.
#pragma once

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

struct CrossEntropyParams {
  std::int64_t ignore_index = -100;
  float loss_scale = 1.0f;

  bool operator==(const CrossEntropyParams&) const = default;
  std::string to_string() const;
};

struct CrossEntropyResult {
  Tensor loss;     // fp32 scalar
  Tensor dlogits;  // like the logits
};

CrossEntropyResult cross_entropy(Context& ctx, const Tensor& logits, const Tensor& labels, const Tensor& error_flag,
                                 const CrossEntropyParams& params = {});

const OpDef& cross_entropy_op();

}  // namespace stepgraph::ops
