// The ops of a step that skips its update when anything is not finite
// (kernels/step_guard.h; the optimizer runs its updates only where nothing
// was flagged).
// Each writes its first input in place and reads nothing on the host.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/step_guard.h"

namespace stepgraph::ops {

// flag (int32 [1]) = 1 where any value of x (fp32) is not finite.
void flag_nonfinite_(Context& ctx, const Tensor& flag, const Tensor& x);

// flag = 1 where any gradient of an AdamW launch table's parameters is not
// finite (kernels::launch_adamw_flag_nonfinite_grads). `grads` are those
// gradients, in the table's order: the op reads them.
struct FlagGradsParams {
  std::int64_t total_numel = 0;
  bool operator==(const FlagGradsParams&) const = default;
  std::string to_string() const;
};
void adamw_flag_nonfinite_grads_(Context& ctx, const Tensor& flag, const Tensor& table,
                                 const std::vector<Tensor>& grads);

// skipped (int64 [1]) += 1 where flag (int32 [1]) is not zero; then flag = 0.
void count_and_clear_flag_(Context& ctx, const Tensor& skipped, const Tensor& flag);

// Note [Loss scaling] (kernels/step_guard.h): after a step's updates, the
// scale state (fp32 [3]) backs off where the flag (int32 [1]) is set and
// grows after growth_interval good steps; the flag is read, not cleared.
struct LossScaleParams {
  kernels::LossScaling scaling;
  bool operator==(const LossScaleParams&) const = default;
  std::string to_string() const;
};
void loss_scale_update_(Context& ctx, const kernels::LossScaling& scaling, const Tensor& state, const Tensor& flag);
// x *= the scale state's scale (x fp32, bf16 or fp16), in place: the loss
// gradient a scaled backward starts from.
void scale_by_loss_scale_(Context& ctx, const Tensor& x, const Tensor& state);

const OpDef& flag_nonfinite_op();
const OpDef& adamw_flag_nonfinite_grads_op();
const OpDef& count_and_clear_flag_op();
const OpDef& loss_scale_update_op();
const OpDef& scale_by_loss_scale_op();

}  // namespace stepgraph::ops
