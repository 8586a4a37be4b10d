// Grouped GEMM for mixture-of-experts layers, with the group boundaries in a
// device tensor the kernels read (nothing about the split reaches the host,
// so a launch can be captured once and replayed for any routing).
//
// Tokens are grouped by expert: group e owns rows [offsets[e], offsets[e+1])
// of the token-major operands (x, dy, y, dx); offsets is int32 [E + 1].
// The three products of a grouped linear layer y_e = x_e w_e^T (+ bias_e):
//   kForward  y  [T, N]    = x_e [n_e, K] * w_e [N, K]^T (+ bias_e [N])
//   kDgrad    dx [T, K]    = dy_e [n_e, N] * w_e [N, K]
//   kWgrad    dw [E, N, K] (+)= dy_e^T [N, n_e] * x_e [n_e, K]   (fp32 dw; bf16 too from bf16 in)
// Rows of y / dx outside [offsets[0], offsets[E]) belong to no group and are
// written as zeros; an empty group's dw_e is zero (unchanged when accumulating).
// The kernels clamp offsets into [0, T] and make them nondecreasing before use,
// so no offsets can make them read or write out of bounds; validating that the
// split adds up is the routing op's job.
//
// Inputs x, w, dy are bf16 (tensor-core path, K and N multiples of 8) or fp32
// (a simple CUDA path); bias has the dtype of w; fp32 accumulation always.
// FP8 (in_type kFloat8E4M3; Note [FP8 grouped GEMM] in grouped_gemm_ws.cu):
// x and w in E4M3, dy in dy_type (E5M2 or E4M3), each with a tensor-wise
// scale_inv the product is multiplied by; bias bf16. FP8 wgmma reads both
// operands K-major, so the operands are the quantize kernels' copies:
//   kForward  x [T, K] and w [E, N, K] (row-wise)
//   kDgrad    dy [T, N] and w's column-wise copy [K, E * N] (of w as [E * N, K])
//   kWgrad    dy's column-wise copy [N, T] and x's [K, T]
// N and K must be multiples of 16 (16-byte rows), and T too for kWgrad.
// The launch configuration depends only on (T, E, N, K): a persistent tile
// scheduler finds each CTA's (group, m-tile, n-tile) on the device from offsets.
// All three bf16 and FP8 products run on warp-specialised wgmma fed by TMA
// (grouped_gemm_ws.cu), with the tile helpers of kernels/tile/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "engine/dtype.h"

namespace stepgraph::kernels {

enum class GroupedGemmKind : std::uint8_t { kForward, kDgrad, kWgrad };
std::string grouped_gemm_kind_name(GroupedGemmKind kind);

struct GroupedGemmDesc {
  GroupedGemmKind kind = GroupedGemmKind::kForward;
  std::int64_t tokens = 0;            // T
  std::int64_t experts = 0;           // E
  std::int64_t n = 0;                 // out features N
  std::int64_t k = 0;                 // in features K
  DType in_type = DType::kBFloat16;   // x, w, dy (and bias); FP8: x and w (kFloat8E4M3)
  DType dy_type = DType::kFloat8E5M2;  // FP8 only: dy's format (E5M2 or E4M3); ignored otherwise
  DType out_type = DType::kBFloat16;  // y, dx: bf16 or fp32; dw: fp32, or bf16 from bf16 inputs
  bool bias = false;                  // kForward only
  bool accumulate = false;            // kWgrad only: dw += instead of dw =
  // FP8 only: add each 128-deep stage's tensor-core sums into fp32 totals
  // (cuBLASLt's non-fast accumulation; Note [FP8 grouped GEMM]), slower.
  bool split_accumulation = false;

  bool operator==(const GroupedGemmDesc&) const = default;
  std::string to_string() const;
};

// Throws Error(kInvalidArgument / kUnsupported) naming what is wrong.
void check_grouped_gemm(const GroupedGemmDesc& desc);

// Pointers by role; unused ones may be null. bf16 operands 16-byte aligned.
struct GroupedGemmOperands {
  const void* x = nullptr;                // [T, K]   kForward, kWgrad
  const void* w = nullptr;                // [E, N, K] kForward, kDgrad
  const void* dy = nullptr;               // [T, N]   kDgrad, kWgrad
  const void* bias = nullptr;             // [E, N]   kForward with bias
  const std::int32_t* offsets = nullptr;  // [E + 1] device (host for host::)
  void* out = nullptr;                    // y [T, N], dx [T, K] or dw [E, N, K]
  // FP8 only: the operands' scale_inv, fp32 [1] (device; host for host::).
  const float* x_scale_inv = nullptr;
  const float* w_scale_inv = nullptr;
  const float* dy_scale_inv = nullptr;
};

inline bool is_fp8_grouped(const GroupedGemmDesc& desc) { return desc.in_type == DType::kFloat8E4M3; }

void launch_grouped_gemm(const GroupedGemmDesc& desc, const GroupedGemmOperands& operands, cudaStream_t stream);

// db [E, N] fp32 (+)= sum over the rows of group e of dy [T, N] (bf16 or fp32).
// Deterministic (no atomics); an empty group gives zeros (unchanged when accumulating).
struct GroupedBiasGradDesc {
  std::int64_t tokens = 0;
  std::int64_t experts = 0;
  std::int64_t n = 0;
  DType dy_type = DType::kBFloat16;
  bool accumulate = false;
};
void check_grouped_bias_grad(const GroupedBiasGradDesc& desc);
void launch_grouped_bias_grad(const GroupedBiasGradDesc& desc, const void* dy, const std::int32_t* offsets, float* db,
                              cudaStream_t stream);

namespace host {
// The same contracts on host memory (offsets on the host), fp32 accumulation,
// outputs rounded to nearest even. Offsets are clamped like the kernels do.
// FP8: the decoded bytes' products summed in fp32, times the two scale_inv.
void grouped_gemm(const GroupedGemmDesc& desc, const GroupedGemmOperands& operands);
void grouped_bias_grad(const GroupedBiasGradDesc& desc, const void* dy, const std::int32_t* offsets, float* db);
}  // namespace host

}  // namespace stepgraph::kernels
