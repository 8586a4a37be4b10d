// FP8 ops (Note [FP8 scaling] in engine/fp8_recipe.h): quantizing
// a tensor with a scale read on the device, giving its row-wise and
// column-wise FP8 copies and its amax (kernels/fp8_quantize.h), and the
// scale updates of current and delayed scaling, all inside the step. The
// GEMM of FP8 operands is ops::fp8_gemm (ops/gemm_ops.h).
//
//   auto s = ops::scale_from_amax(ctx, ops::amax(ctx, x), {.format = Fp8Format::kE4M3});   // current scaling
//   auto q = ops::quantize(ctx, x, s.scale, {.format = Fp8Format::kE4M3, .columnwise = true});
//   auto y = ops::fp8_gemm(ctx, q.rowwise, x_scale_inv, w_q.rowwise, w_scale_inv, {.trans_b = true});
#pragma once

#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/fp8.h"
#include "engine/fp8_recipe.h"
#include "engine/op.h"
#include "kernels/fp8_block_scales.h"

namespace stepgraph::ops {

struct QuantizeParams {
  Fp8Format format = Fp8Format::kE4M3;
  bool rowwise = true;
  bool columnwise = false;

  bool operator==(const QuantizeParams&) const = default;
  std::string to_string() const;
};

struct Quantized {
  Tensor rowwise;     // [rows, cols] in the format's dtype, when asked for
  Tensor columnwise;  // [cols, rows], when asked for
  Tensor amax;        // [1] fp32: max |x|
};

// x: [rows, cols] fp32, bf16 or fp16 (or [..., cols]: the rows of its last
// dimension, so a weight [E, N, K] is [E * N, K]); scale: [1] fp32 (q =
// fp8(x * scale)).
Quantized quantize(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params);

// quantize into existing tensors (persistent ones: an FP8 weight cache),
// written in place: the copies asked for and amax ([1] fp32).
void quantize_into_(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params,
                    const Tensor& rowwise, const Tensor& columnwise, const Tensor& amax);

// Block scaling (kernels/fp8_quantize.h): x 2-D [rows, cols] into FP8 with a
// scale per 1 x 128 or 128 x 128 block, each copy's scale_inv in the layout
// its GEMM reads (kernels/fp8_block_scales.h); non_finite ([1] int32) is 1
// when a block's amax was not finite.
struct BlockQuantizeParams {
  Fp8Format format = Fp8Format::kE4M3;
  kernels::BlockShape shape = kernels::BlockShape::k1x128;
  bool power_of_two = true;
  bool rowwise = true;
  bool columnwise = false;

  bool operator==(const BlockQuantizeParams&) const = default;
  std::string to_string() const;
};
struct BlockQuantized {
  Tensor rowwise;  // [rows, cols]
  Tensor rowwise_scale_inv;
  Tensor columnwise;  // [cols, rows]
  Tensor columnwise_scale_inv;
  Tensor non_finite;
};
BlockQuantized quantize_blocks(Context& ctx, const Tensor& x, const BlockQuantizeParams& params);

// max |x| ([1] fp32) of x (as quantize reads it): current scaling's first pass, before
// scale_from_amax and quantize.
Tensor amax(Context& ctx, const Tensor& x);

// Current scaling: scale and scale_inv ([1] fp32 each) from an amax ([1]
// fp32); non_finite ([1] int32) is 1 when the amax is not (scales 1 then).
struct ScaleFromAmaxParams {
  Fp8Format format = Fp8Format::kE4M3;
  bool power_of_two = false;

  bool operator==(const ScaleFromAmaxParams&) const = default;
  std::string to_string() const;
};
struct Scales {
  Tensor scale;
  Tensor scale_inv;
  Tensor non_finite;
};
Scales scale_from_amax(Context& ctx, const Tensor& amax, const ScaleFromAmaxParams& params);

// Delayed scaling, in place: the amax history ([recipe.amax_history_len]
// fp32, a persistent tensor) rolls in amax, and scale and scale_inv follow
// (kernels::delayed_scaling_update_host). Returns non_finite ([1] int32): 1
// when amax was not finite and nothing changed.
struct DelayedScalingParams {
  Fp8Recipe recipe = Fp8Recipe::delayed();
  Fp8Format format = Fp8Format::kE4M3;

  bool operator==(const DelayedScalingParams&) const = default;
  std::string to_string() const;
};
Tensor delayed_scaling_update_(Context& ctx, const DelayedScalingParams& params, const Tensor& amax,
                               const Tensor& history, const Tensor& scale, const Tensor& scale_inv);

// counter ([1] int32, persistent) += the sum of flags (each [1] int32: the
// non_finite outputs above), in place: a layer's tally of non-finite amaxes.
void count_flags_(Context& ctx, const Tensor& counter, const std::vector<Tensor>& flags);

const OpDef& quantize_op();
const OpDef& quantize_into_op();
const OpDef& count_flags_op();
const OpDef& quantize_blocks_op();
const OpDef& amax_op();
const OpDef& scale_from_amax_op();
const OpDef& delayed_scaling_update_op();

}  // namespace stepgraph::ops
