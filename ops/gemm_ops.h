// The GEMM op on cuBLASLt (kernels/gemm.h), in row-major terms:
//   D[m, n] = alpha * opA(A) opB(B) then the epilogue,
// D a new tensor (gemm) or an existing one overwritten (gemm_into_).
// Its cuBLASLt workspace is one more output, so it comes from the caching
// allocator in eager execution and from the pool in a captured step.
//
// Note [Row windows of a GEMM]
// A tensor-parallel layer that overlaps its communication with its GEMMs
// (layers/comm_gemm_overlap.h) multiplies one token chunk at a time: the
// rows of A it reads and the rows of D it writes are windows of larger
// tensors. GemmParams::rows (0: all of A) is the chunk's row count m;
// a_row its first row in A (A not transposed); d_row its first row in D and
// in the aux tensor (gemm_into_ only: a fresh D is the chunk itself). The
// windows are pointer offsets into the same row-major memory, so a chunk is
// the same arithmetic as those rows of the whole GEMM, and no copy is made.
//
//   auto [y, pre, unused] = ops::gemm(ctx, x, w, {.trans_b = true, .epilogue = GemmEpilogue::kGeluAuxBias,
//                                                  .out_dtype = DType::kBFloat16}, bias);
#pragma once

#include <optional>
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
  // Row windows: See Note [Row windows of a GEMM].
  std::int64_t rows = 0;   // m; 0: every row of opA(A)
  std::int64_t a_row = 0;  // first row of A read (A not transposed)
  std::int64_t d_row = 0;  // first row of D and aux (gemm_into_)
  // FP8 A and B (Note [FP8 GEMMs] in kernels/gemm.h): their scale_inv
  // tensors ([1] fp32) follow the epilogue's inputs. Set by fp8_gemm.
  bool fp8_scales = false;
  bool fast_accumulation = false;
  // Block-scaled FP8: each operand's scale_inv is its block scales
  // ([BlockScaleLayout::count()] fp32) instead of one scalar.
  std::optional<kernels::BlockShape> a_blocks;
  std::optional<kernels::BlockShape> b_blocks;
  // The cuBLASLt workspace the GEMM gets in the pool (an output of the op):
  // what its algorithm needs on the context's GPU, none on the host. Set by
  // the functions below (Backend::library_scratch_bytes).
  std::int64_t workspace_bytes = 0;
  // gemm_into_ with kBiasGradOfA or kDGeluBGrad: the bias gradient is written
  // into an existing tensor (an input after D, e.g. a bias's fp32 grad)
  // instead of a new output, so no copy follows. Set by gemm_into_.
  bool bias_grad_into = false;
  // How cuBLASLt's algorithm is picked: the context's choice, set by the
  // functions below (Note [Deterministic algorithm choice]).
  AlgorithmChoice algorithm = AlgorithmChoice::kHeuristic;

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

// D = alpha (a_scale_inv A)(b_scale_inv B)^T (+ bias) for FP8 A [m, k] and B
// [n, k] (TN, as Hopper's FP8 GEMMs need; the quantize op's copies give every
// product that form); scale_inv tensors are [1] fp32, read on the device,
// or with params.a_blocks / b_blocks the block scales of quantize_blocks.
// params.trans_b must be set and trans_a clear; fp8_scales is set here.
GemmResult fp8_gemm(Context& ctx, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                    const Tensor& b_scale_inv, GemmParams params, const Tensor& bias = {});
// fp8_gemm written into the existing tensor d (gemm_into_'s rules), e.g. an
// FP8 weight gradient straight into its fp32 main grad.
void fp8_gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                    const Tensor& b_scale_inv, GemmParams params);

// d = alpha opA(A) opB(B), written into the existing tensor d (e.g. a weight
// gradient into its fp32 main grad; d's old values are not read), rows
// [d_row, d_row + m) of it. Any epilogue: `bias` [n] for kBias and
// kGeluAuxBias, `aux` (an existing tensor shaped like d, the same rows) written
// by kGeluAuxBias and read by kDGeluBGrad. Returns the bias gradient for
// kBiasGradOfA and kDGeluBGrad, else an undefined tensor: written into
// `bias_grad` when given (its length and out_dtype), else a new tensor.
Tensor gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& b, const GemmParams& params,
                  const Tensor& bias = {}, const Tensor& aux = {}, const Tensor& bias_grad = {});

const OpDef& gemm_op();
const OpDef& gemm_into_op();

}  // namespace stepgraph::ops
