// Elementwise ops and a sum over fp32 tensors: the simple ops that prove the
// machinery (eager, traced, host, planned and replayed). Each is one OpDef
// (name, params, check, CUDA launcher, host reference) in elementwise_ops.cc.
//
//   Tensor h = ops::add(ctx, x, w);
//   ops::axpy_(ctx, grad, h, 0.5f);    // in place: grad += 0.5 h
//   Tensor loss = ops::sum(ctx, h);    // a scalar
#pragma once

#include "engine/context.h"
#include "engine/op.h"
#include "engine/tensor.h"

namespace stepgraph::ops {

Tensor fill(Context& ctx, const TensorMeta& meta, float value);            // a new tensor of `value`
Tensor copy(Context& ctx, const Tensor& x);                                // a new tensor equal to x
void copy_(Context& ctx, const Tensor& dst, const Tensor& src);            // dst = src, in place
Tensor axpy(Context& ctx, const Tensor& y, const Tensor& x, float alpha);  // y + alpha x
void axpy_(Context& ctx, const Tensor& y, const Tensor& x, float alpha);   // y += alpha x, in place
Tensor add(Context& ctx, const Tensor& a, const Tensor& b);
Tensor mul(Context& ctx, const Tensor& a, const Tensor& b);
Tensor sum(Context& ctx, const Tensor& x);  // fp32 scalar (shape [])
// The sums over rows of a 2-D x (fp32, bf16 or fp16): fp32 [cols], in a fixed
// order (Note [Column sums in a fixed order] in kernels/elementwise.h).
Tensor column_sum(Context& ctx, const Tensor& x);
// x converted to `dtype` (fp32, bf16, fp16), rounding to nearest even.
Tensor cast(Context& ctx, const Tensor& x, DType dtype);

// The value of a one-element tensor on the host. Needs a device-to-host read,
// so it is an Error while tracing.
float item(Context& ctx, const Tensor& x);

// The OpDefs, for the registry and for tests.
const OpDef& fill_op();
const OpDef& copy_op();
const OpDef& copy_inplace_op();
const OpDef& axpy_op();
const OpDef& axpy_inplace_op();
const OpDef& add_op();
const OpDef& mul_op();
const OpDef& sum_op();
const OpDef& column_sum_op();
const OpDef& cast_op();

}  // namespace stepgraph::ops
