// GeLU (tanh) forward and backward, and the residual add, for bf16, fp16 and
// fp32 tensors (kernels/activation.h). Used where GeLU is not fused into a
// GEMM epilogue.
#pragma once

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

Tensor gelu(Context& ctx, const Tensor& x);
Tensor gelu_backward(Context& ctx, const Tensor& dy, const Tensor& x);
Tensor residual_add(Context& ctx, const Tensor& a, const Tensor& b);

const OpDef& gelu_op();
const OpDef& gelu_backward_op();
const OpDef& residual_add_op();

}  // namespace stepgraph::ops
