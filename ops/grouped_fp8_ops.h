// FP8 grouped linear ops (Note [FP8 grouped GEMM] in kernels/grouped_gemm_ws.cu):
// the grouped products of ops/grouped_gemm_ops.h on FP8 operands, each with
// the scale_inv ([1] fp32, on the device) it was quantized with. FP8 wgmma
// reads both operands K-major, so each product takes the quantize op's copy
// (ops/fp8_ops.h) its layout needs. `split_accumulation`: the tensor cores'
// sums promoted to fp32 every 128 of the reduction (slower; without it
// "fast accumulation", Note [FP8 grouped GEMM] in kernels/grouped_gemm_ws.cu).
//
//   Tensor y  = ops::grouped_fp8_forward(ctx, x_q, x_si, w_q, w_si, offsets, bias, DType::kBFloat16);
//   Tensor dx = ops::grouped_fp8_dgrad(ctx, dy_q, dy_si, w_qt, w_si, offsets, DType::kBFloat16);
//   ops::grouped_fp8_wgrad_(ctx, dw, dy_qt, dy_si, x_qt, x_si, offsets, /*accumulate=*/false);
#pragma once

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

// y [T, N] = x_e w_e^T (+ bias_e) from x [T, K] E4M3 and w E4M3 as the
// quantize op's row-wise copy of w [E, N, K]: [E * N, K]; bias [E, N] bf16
// or undefined; out bf16 or fp32.
Tensor grouped_fp8_forward(Context& ctx, const Tensor& x, const Tensor& x_scale_inv, const Tensor& w,
                           const Tensor& w_scale_inv, const Tensor& offsets, const Tensor& bias, DType out_dtype,
                           bool split_accumulation = false);
// dx [T, K] = dy_e w_e from dy [T, N] (E5M2 or E4M3) and w_t [K, E * N]
// E4M3, the column-wise copy of w as [E * N, K].
Tensor grouped_fp8_dgrad(Context& ctx, const Tensor& dy, const Tensor& dy_scale_inv, const Tensor& w_t,
                         const Tensor& w_scale_inv, const Tensor& offsets, DType out_dtype,
                         bool split_accumulation = false);
// dw [E, N, K] fp32 (+)= dy_e^T x_e, in place, from the column-wise copies
// dy_t [N, T] (E5M2 or E4M3) and x_t [K, T] E4M3.
void grouped_fp8_wgrad_(Context& ctx, const Tensor& dw, const Tensor& dy_t, const Tensor& dy_scale_inv,
                        const Tensor& x_t, const Tensor& x_scale_inv, const Tensor& offsets, bool accumulate,
                        bool split_accumulation = false);

const OpDef& grouped_fp8_forward_op();  // inputs x, x_scale_inv, w, w_scale_inv, offsets[, bias]
const OpDef& grouped_fp8_dgrad_op();    // inputs dy, dy_scale_inv, w_t, w_scale_inv, offsets
const OpDef& grouped_fp8_wgrad_op();    // inputs dw (written), dy_t, dy_scale_inv, x_t, x_scale_inv, offsets

}  // namespace stepgraph::ops
