// Fused FP8 ops (kernels/fp8_fused.h): the norm, GeLU and GeLU's
// backward writing the FP8 copies their next GEMM reads (row-wise,
// column-wise) and their amax in the same pass, with tensor-wise scaling.
// The bytes and amax are those of the op followed by ops::quantize, bit for
// bit; the 16-bit result is written only when asked for (keep_16bit), so an
// FP8 layer need not make and read it.
//
// Each op runs in one of two modes: with a scale (the copies and the amax),
// or amax alone (params.amax_only, no scale input: current scaling's first
// pass, whose amax gives the scale the second pass quantizes with).
//
//   Tensor a = ops::gelu_fp8(ctx, pre, Tensor(), {.amax_only = true}).amax;        // current scaling
//   ops::Scales s = ops::scale_from_amax(ctx, a, {Fp8Format::kE4M3});
//   ops::FusedFp8 act = ops::gelu_fp8(ctx, pre, s.scale, {.columnwise = true});     // act.rowwise, act.columnwise
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/fp8.h"
#include "engine/op.h"
#include "ops/norm_ops.h"

namespace stepgraph::ops {

struct FusedFp8Params {
  Fp8Format format = Fp8Format::kE4M3;
  bool amax_only = false;   // no scale, no copies: max |result| alone
  bool rowwise = true;      // [rows, cols]
  bool columnwise = false;  // [cols, rows]; needs rowwise (transposed from it)
  bool keep_16bit = false;  // also the 16-bit result (the norm's y, act, d_pre)

  bool operator==(const FusedFp8Params&) const = default;
  std::string to_string() const;
};

struct FusedFp8 {
  Tensor value;       // the 16-bit result, when keep_16bit
  Tensor rowwise;     // when asked for (not amax_only)
  Tensor columnwise;  // when asked for
  Tensor amax;        // [1] fp32
};

// The norm (ops::norm_forward's kinds and statistics) and its output's FP8 copies.
struct NormFp8Params {
  NormParams norm;
  FusedFp8Params fp8;

  bool operator==(const NormFp8Params&) const = default;
  std::string to_string() const;
};
struct NormFp8 {
  FusedFp8 out;
  Tensor mean;  // [rows] fp32; undefined for RMSNorm
  Tensor rstd;  // [rows] fp32
};

// x [rows, hidden] bf16 or fp16 (hidden a multiple of 16); beta ignored for
// RMSNorm; scale [1] fp32, undefined with amax_only.
NormFp8 norm_fp8(Context& ctx, const NormFp8Params& params, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                 const Tensor& scale);
// act = gelu(pre) (ops::gelu's rounding), quantized.
FusedFp8 gelu_fp8(Context& ctx, const Tensor& pre, const Tensor& scale, const FusedFp8Params& params);
// d_pre = d_act * gelu'(pre) (ops::gelu_backward's rounding), quantized.
FusedFp8 dgelu_fp8(Context& ctx, const Tensor& d_act, const Tensor& pre, const Tensor& scale,
                   const FusedFp8Params& params);

const OpDef& norm_fp8_op();
const OpDef& gelu_fp8_op();
const OpDef& dgelu_fp8_op();

}  // namespace stepgraph::ops
