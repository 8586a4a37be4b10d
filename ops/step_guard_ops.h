// The ops of a step that skips its update when anything is not finite
// (kernels/step_guard.h, Note [Non-finite steps] in layers/step_guard.h).
// Each writes its first input in place and reads nothing on the host.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/op.h"

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

const OpDef& flag_nonfinite_op();
const OpDef& adamw_flag_nonfinite_grads_op();
const OpDef& count_and_clear_flag_op();

}  // namespace stepgraph::ops
