// Grouped linear ops for mixture-of-experts layers (kernels/grouped_gemm.h):
// the split of the tokens among the experts is a device tensor, offsets int32
// [E + 1], that the kernels read, so these ops trace and replay in a captured
// step whatever the routing does. Group e = rows [offsets[e], offsets[e+1]) of
// x / dy / y / dx; rows outside [offsets[0], offsets[E]) of y / dx are zeros.
// Offsets are validated by the routing op that makes them; the kernels clamp
// them into [0, T] so no offsets can make them access memory out of bounds.
//
//   Tensor y  = ops::grouped_linear_forward(ctx, x, w, offsets, bias, DType::kBFloat16);
//   Tensor dx = ops::grouped_linear_dgrad(ctx, dy, w, offsets, DType::kBFloat16);
//   ops::grouped_linear_wgrad_(ctx, dw_main_grad, dy, x, offsets, /*accumulate=*/true);
//   ops::grouped_bias_grad_(ctx, db_main_grad, dy, offsets, /*accumulate=*/true);
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

struct GroupedGemmParams {
  DType out_dtype = DType::kBFloat16;  // forward and dgrad
  bool bias = false;                   // forward: a bias input follows offsets
  bool accumulate = false;             // wgrad_ and bias_grad_: += instead of =
  bool split_accumulation = false;     // FP8 products only (kernels/grouped_gemm.h)

  bool operator==(const GroupedGemmParams&) const = default;
  std::string to_string() const;
};

// y [T, N] = x_e [n_e, K] w_e [N, K]^T (+ bias_e [N]). x, w (and bias): one
// dtype, bf16 (tensor cores) or fp32; out bf16 or fp32. bias may be undefined.
Tensor grouped_linear_forward(Context& ctx, const Tensor& x, const Tensor& w /*[E,N,K]*/, const Tensor& offsets,
                              const Tensor& bias /*[E,N] or undefined*/, DType out_dtype);
// dx [T, K] = dy_e [n_e, N] w_e [N, K].
Tensor grouped_linear_dgrad(Context& ctx, const Tensor& dy /*[T,N]*/, const Tensor& w, const Tensor& offsets,
                            DType out_dtype);
// dw_e (+)= dy_e^T x_e, dw [E, N, K] fp32 in place; an empty group gives zeros
// (unchanged when accumulating).
void grouped_linear_wgrad_(Context& ctx, const Tensor& dw /*[E,N,K] fp32*/, const Tensor& dy, const Tensor& x,
                           const Tensor& offsets, bool accumulate);
// db_e (+)= sum of the rows of dy_e, db [E, N] fp32 in place.
void grouped_bias_grad_(Context& ctx, const Tensor& db /*[E,N] fp32*/, const Tensor& dy, const Tensor& offsets,
                        bool accumulate);

const OpDef& grouped_linear_forward_op();  // inputs x, w, offsets[, bias]
const OpDef& grouped_linear_dgrad_op();    // inputs dy, w, offsets
const OpDef& grouped_linear_wgrad_op();    // inputs dw (written), dy, x, offsets
const OpDef& grouped_bias_grad_op();       // inputs db (written), dy, offsets

}  // namespace stepgraph::ops
