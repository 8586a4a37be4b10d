// GEMM on cuBLASLt, in row-major terms (as tensors are stored):
//
//   D[m, n] = alpha * opA(A)[m, k] * opB(B)[k, n] (+ beta * D)   then the epilogue
//
// A is stored [m, k] (trans_a = false) or [k, m] (trans_a = true); B is stored
// [k, n] or [n, k] (trans_b = true). D is [m, n]. fp32 accumulation always.
// The three products of a linear layer y = x W^T + b:
//   forward  y[T,out]  = x[T,in]   * W[out,in]^T   A = x,  B = W (trans_b), kBias / kGeluAuxBias
//   dgrad    dx[T,in]  = dy[T,out] * W[out,in]     A = dy, B = W,           kNone / kDGeluBGrad
//   wgrad    dW[out,in]= dy[T,out]^T * x[T,in]     A = dy (trans_a), B = x, kNone / kBiasGradOfA,
//                                                  beta = 1 to accumulate into an fp32 main grad
//
// The algorithm is chosen once per GemmDesc and operand alignment and cached,
// so eager execution and graph capture use the same one: cuBLASLt's heuristic
// (the same bits on every run), or with GemmDesc::algorithm kTimed the
// fastest candidate by timing (Note [Deterministic algorithm choice] in
// engine/algorithm_choice.h). Call gemm_prepare() before capturing (it
// creates the handle and picks the algorithm, neither of which may happen
// under stream capture).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "engine/algorithm_choice.h"
#include "engine/dtype.h"
#include "kernels/fp8_block_scales.h"

namespace stepgraph::kernels {

enum class GemmEpilogue : std::uint8_t {
  kNone,         // D = alpha AB + beta D
  kBias,         // D = alpha AB + bias[n]
  kGeluAuxBias,  // aux = alpha AB + bias[n]; D = gelu_tanh(aux)       (aux: [m, n], D's dtype)
  kDGeluBGrad,   // D = (alpha AB) * gelu_tanh'(aux); bias_grad[n] = sum over m of D
  kBiasGradOfA,  // D = alpha AB + beta D; bias_grad[m] = sum over k of opA(A)   (cuBLASLt BGRADB)
};
std::string gemm_epilogue_name(GemmEpilogue epilogue);

// What an epilogue reads or writes besides A, B and D: launch_gemm, the host
// reference and ops/gemm_ops.cc all go by these.
constexpr bool epilogue_reads_bias(GemmEpilogue e) {
  return e == GemmEpilogue::kBias || e == GemmEpilogue::kGeluAuxBias;
}
constexpr bool epilogue_writes_aux(GemmEpilogue e) { return e == GemmEpilogue::kGeluAuxBias; }
constexpr bool epilogue_reads_aux(GemmEpilogue e) { return e == GemmEpilogue::kDGeluBGrad; }
constexpr bool epilogue_uses_aux(GemmEpilogue e) { return epilogue_writes_aux(e) || epilogue_reads_aux(e); }
constexpr bool epilogue_writes_bias_grad(GemmEpilogue e) {
  return e == GemmEpilogue::kDGeluBGrad || e == GemmEpilogue::kBiasGradOfA;
}

struct GemmDesc {
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
  bool trans_a = false;
  bool trans_b = false;
  // A and B share a type (bf16, fp16 or fp32), or are both FP8 (Note [FP8 GEMMs]).
  DType a_type = DType::kBFloat16;
  DType b_type = DType::kBFloat16;
  DType d_type = DType::kBFloat16;  // bf16, fp16 or fp32; bias, aux and bias_grad use it too
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  float alpha = 1.0f;
  float beta = 0.0f;  // only with kNone and kBiasGradOfA
  bool fast_accumulation = false;  // FP8 only: cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM
  // FP8 only: how each operand's scale_inv is laid out; nullopt is one scale
  // for the whole tensor (Note [FP8 GEMMs]).
  std::optional<BlockShape> a_blocks;
  std::optional<BlockShape> b_blocks;
  // How the algorithm is picked; kTimed may give other bits in another process.
  AlgorithmChoice algorithm = AlgorithmChoice::kHeuristic;

  bool operator==(const GemmDesc&) const = default;
  std::string to_string() const;
};

// Note [FP8 GEMMs]
// A and B in FP8 (E4M3 or E5M2, not both E5M2: cuBLASLt has no such kernel),
// tensor-wise scaled: D = alpha * (a_scale_inv * A)(b_scale_inv * B)^T. On
// Hopper cuBLASLt runs FP8 only as "TN", which in row-major terms is A
// [m, k] and B [n, k], both K-major: trans_a false, trans_b true. A layer
// gets every product into that form from the quantize kernels' row-wise and
// column-wise copies (kernels/fp8_quantize.h). m, n and k must be multiples
// of 16; D is bf16, fp16 or fp32; epilogues none or bias, beta 0.
//
// Block scaling (DeepSeek-V3's recipe, cuBLASLt's VEC128 / BLK128x128 modes
// on Hopper): both operands carry a scale_inv per block, 1 x 128 or
// 128 x 128, in the layouts of kernels/fp8_block_scales.h, so D[i][j] sums,
// over the k blocks, the block products times A's and B's block scale_inv.
// Not both 128 x 128 (cuBLASLt has no such kernel), k a multiple of 128, no
// fast accumulation.
//
// Throws Error naming what is wrong: unsupported dtype or combination, beta
// with an epilogue that cannot accumulate, a non-positive dimension.
void check_gemm(const GemmDesc& desc);

// The most workspace a gemm launch may use (bytes, 256-byte aligned): what
// GemmOperands::workspace_bytes defaults to.
std::size_t gemm_workspace_bytes();
inline constexpr std::size_t kGemmMaxWorkspaceBytes = std::size_t{32} << 20;

// The workspace the algorithm chosen for `desc` needs (256-byte-aligned
// operands; rounded up to 256 bytes, 0 when it needs none): what a planned
// GEMM gets in the pool. Chooses and caches the algorithm, as gemm_prepare.
std::size_t gemm_workspace_bytes(const GemmDesc& desc);

// Creates the cuBLASLt handle and caches the algorithm for `desc` with
// 256-byte-aligned operands (what pools and allocators hand out; other
// alignments get their own algorithm, chosen at their first launch).
void gemm_prepare(const GemmDesc& desc);

// Pointers by role; unused ones may be null. Pointers must be 16-byte aligned.
struct GemmOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  const void* bias = nullptr;  // kBias, kGeluAuxBias
  void* aux = nullptr;         // kGeluAuxBias (written), kDGeluBGrad (read)
  void* bias_grad = nullptr;   // kDGeluBGrad, kBiasGradOfA
  void* workspace = nullptr;   // workspace_bytes of device memory (may be null when 0)
  // The launch's algorithm is chosen among those needing at most this much
  // (gemm_workspace_bytes(desc) fits the algorithm gemm_prepare chose).
  std::size_t workspace_bytes = kGemmMaxWorkspaceBytes;
  // FP8 only: each operand's device scale_inv, 16-byte aligned: one fp32
  // scalar (null reads as 1), or with block scaling the operand's block
  // scales (BlockScaleLayout in kernels/fp8_block_scales.h).
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
};

void launch_gemm(const GemmDesc& desc, const GemmOperands& operands, cudaStream_t stream);

// What cuBLASLt's choices depend on besides the problem: the library version
// and the GPU model, e.g. "cuBLASLt 130100, NVIDIA H100 80GB HBM3 (132 SMs)".
// A run resumed elsewhere may pick other algorithms, and so other bits.
std::string gemm_library_identity();

// The algorithms this process picked by timing (GemmDesc::algorithm kTimed),
// as text for a checkpoint (kernels/gemm_algorithm_record.h), and back: a
// resumed run adopts them before its first GEMM, so it launches the same
// algorithms as the run it continues. Adopting picks recorded under another
// gemm_library_identity() is an Error naming both.
std::string export_timed_gemm_algorithms();
void adopt_timed_gemm_algorithms(const std::string& text);

}  // namespace stepgraph::kernels
