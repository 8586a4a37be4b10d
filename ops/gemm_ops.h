// The GEMM op on cuBLASLt (kernels/gemm.h), in row-major terms:
//   D[m, n] = alpha * opA(A) opB(B) then the epilogue,
// D a new tensor (gemm) or an existing one overwritten (gemm_into_).
// Its cuBLASLt workspace is one more output, so it comes from the caching
// allocator in eager execution and from the pool in a captured step.
//
//   auto [y, pre, unused] = ops::gemm(ctx, x, w, {.trans_b = true, .epilogue = GemmEpilogue::kGeluAuxBias,
//                                                  .out_dtype = DType::kBFloat16}, bias);
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/gemm.h"

namespace stepgraph::ops {

struct GemmParams {
  bool trans_a = false;
  bool trans_b = false;
  kernels::GemmEpilogue epilogue = kernels::GemmEpilogue::kNone;
  float alpha = 1.0f;
  DType out_dtype = DType::kBFloat16;

  bool operator==(const GemmParams&) const = default;
  std::string to_string() const;
};

struct GemmResult {
  Tensor d;          // [m, n]
  Tensor aux;        // kGeluAuxBias: the pre-activation [m, n]
  Tensor bias_grad;  // kDGeluBGrad: [n]; kBiasGradOfA: [m]
};

// `bias` [n] for kBias and kGeluAuxBias; `aux` [m, n] for kDGeluBGrad.
GemmResult gemm(Context& ctx, const Tensor& a, const Tensor& b, const GemmParams& params, const Tensor& bias = {},
                const Tensor& aux = {});

// d = alpha opA(A) opB(B), written into the existing tensor d (e.g. a weight
// gradient into its fp32 main grad; d's old values are not read); epilogue
// kNone or kBiasGradOfA. Returns the bias gradient for kBiasGradOfA, else an
// undefined tensor.
Tensor gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& b, const GemmParams& params);

const OpDef& gemm_op();
const OpDef& gemm_into_op();

}  // namespace stepgraph::ops
