// Buckets: many tensors of one dtype packed end to end into one flat tensor
// and back, so that one collective moves them all (the gradient and weight
// buckets of the sharded optimizer, optim/adamw.h). Byte copies: any dtype.
//
//   Tensor flat = ops::pack(ctx, grads, padded);   // [padded], zeros after the last tensor
//   ops::unpack_(ctx, flat, values);               // values[i] = flat[offset_i, offset_i + numel_i)
#pragma once

#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

// Tensor i starts at the sum of the numels before it; `padded_numel` (at
// least their total) sets the length, the tail is zero.
Tensor pack(Context& ctx, const std::vector<Tensor>& tensors, std::int64_t padded_numel);
// The inverse: writes each tensor from its range of `packed`.
void unpack_(Context& ctx, const Tensor& packed, const std::vector<Tensor>& tensors);

const OpDef& pack_op();
const OpDef& unpack_inplace_op();

}  // namespace stepgraph::ops
