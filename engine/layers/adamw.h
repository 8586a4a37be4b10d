// AdamW over a model's parameters: one multi-tensor op per step, with fp32
// master weights, fp32 moments, the model-dtype copies refreshed in the same
// launch, and the step counter kept on the device so a replayed step needs
// no value from the host.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "engine/layers/parameter.h"
#include "engine/ops/optimizer_ops.h"

namespace stepgraph {

class AdamW {
 public:
  AdamW(Context& ctx, const std::vector<Parameter*>& parameters, const kernels::AdamWHyper& hyper);

  void step(Context& ctx) const;
  // Steps taken so far (reads the device counter: not while tracing).
  std::int64_t steps_taken(Context& ctx) const;

  // The optimizer's state, for checkpoints: each parameter's moments in the
  // constructor's order, and the device step counter (int64 [1]).
  struct Moments {
    Tensor m;
    Tensor v;
  };
  std::vector<Moments> moments() const;
  const Tensor& step_counter() const { return step_; }

 private:
  ops::AdamWParams params_;
  Tensor table_;                 // the kernel's launch table (pointers), int64 words
  Tensor step_;                  // int64 [1]
  std::vector<Tensor> tensors_;  // per parameter: master, grad, m, v[, copy]
};

}  // namespace stepgraph
