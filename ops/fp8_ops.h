// FP8 ops (issue 17; Note [FP8 scaling] in engine/fp8_recipe.h): quantizing
// a tensor with a scale read on the device, giving its row-wise and
// column-wise FP8 copies and its amax (kernels/fp8_quantize.h). The GEMM of
// FP8 operands is ops::fp8_gemm (ops/gemm_ops.h).
//
//   auto q = ops::quantize(ctx, x, scale, {.format = Fp8Format::kE4M3, .columnwise = true});
//   auto y = ops::fp8_gemm(ctx, q.rowwise, x_scale_inv, w_q.rowwise, w_scale_inv, {.trans_b = true});
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/fp8.h"
#include "engine/op.h"

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

// x: 2-D [rows, cols] fp32, bf16 or fp16; scale: [1] fp32 (q = fp8(x * scale)).
Quantized quantize(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params);

const OpDef& quantize_op();

}  // namespace stepgraph::ops
