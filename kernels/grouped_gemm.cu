// Grouped GEMM kernels (contract in grouped_gemm.h): the launchers, the
// simple fp32 kernel and the bias gradient.
//
// bf16 and FP8 inputs take the cooperative warp-specialised wgmma + TMA
// kernel (grouped_gemm_ws.cu): a persistent grid of at most one block per SM
// walks a tile schedule over (group, m-tile, n-tile) that every block
// computes from the device offsets. Wgrad's reduction runs over each group's
// ragged token range. (The forms that lost to it: Note [Grouped GEMM
// variants that lost].)
// fp32 inputs take a simple one-thread-per-output kernel over the same
// clamped offsets. Which kernel runs depends only on the desc, and the grid
// size only on (T, E, N, K, SM count), so a captured graph is fixed by them.
//
// Note [Grouped GEMM variants that lost]
// On the H100 the cooperative kernel beat every other form tried against
// torch._grouped_mm: mma.sync (the Ampere instruction; also for the wgrad),
// ping-pong warpgroups on 128 x 128 tiles (less work per byte moved from L2,
// which is what limits these kernels), 2-block clusters sharing the weight
// box by TMA multicast, and raster bands other than 16 m-tiles. They are
// deleted; docs/grouped_gemm_variants.md has the numbers and the commits
// that still hold them.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tensor_map.h"
#include "kernels/tile/group_schedule.cuh"

namespace stepgraph::kernels {
namespace {

using namespace grouped;  // NOLINT(google-build-using-namespace): this file implements them

// fp32 (or any In) inputs: one thread per output element, the same clamped
// offsets; the group of a token row by binary search.
template <GroupedGemmKind kKind, typename In, typename Out>
__global__ void grouped_gemm_simple_kernel(Problem p) {
  extern __shared__ int offs[];
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);
  const In* x = static_cast<const In*>(p.x);
  const In* w = static_cast<const In*>(p.w);
  const In* dy = static_cast<const In*>(p.dy);
  const In* bias = static_cast<const In*>(p.bias);
  Out* out = static_cast<Out*>(p.out);
  const std::int64_t n = p.n;
  const std::int64_t k = p.k;
  const std::int64_t cols = kKind == GroupedGemmKind::kForward ? n : k;
  const std::int64_t count = kKind == GroupedGemmKind::kWgrad ? p.experts * n * k : p.tokens * cols;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float sum = 0.0f;
    if constexpr (kKind == GroupedGemmKind::kWgrad) {
      const std::int64_t e = i / (n * k);
      const std::int64_t row = i / k % n;
      const std::int64_t col = i % k;
      for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t) sum += to_float(dy[t * n + row]) * to_float(x[t * k + col]);
      if (p.accumulate) sum += to_float(out[i]);
    } else {
      const std::int64_t row = i / cols;
      const std::int64_t col = i % cols;
      if (row >= offs[0] && row < offs[p.experts]) {
        const int e = tile::group_of_tile(offs, p.experts, static_cast<int>(row));
        const In* we = w + e * n * k;
        if constexpr (kKind == GroupedGemmKind::kForward) {
          for (std::int64_t j = 0; j < k; ++j) sum += to_float(x[row * k + j]) * to_float(we[col * k + j]);
          if (bias != nullptr) sum += to_float(bias[e * n + col]);
        } else {
          for (std::int64_t j = 0; j < n; ++j) sum += to_float(dy[row * n + j]) * to_float(we[j * k + col]);
        }
      }
    }
    out[i] = from_float<Out>(sum);
  }
}

// db[e, col] (+)= sum over the rows of group e of dy[row, col]: a block per
// (32 columns, group), 8 row lanes, a fixed-order reduction.
template <typename In>
__global__ void grouped_bias_grad_kernel(const In* dy, const std::int32_t* offsets, int tokens, int experts, int n,
                                         bool accumulate, float* db) {
  extern __shared__ int offs[];
  __shared__ float partial[8][33];
  tile::load_group_offsets(offsets, experts, tokens, offs);
  const int e = static_cast<int>(blockIdx.y);
  const int col = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  float sum = 0.0f;
  if (col < n) {
    for (std::int64_t row = offs[e] + threadIdx.y; row < offs[e + 1]; row += blockDim.y) {
      sum += to_float(dy[row * n + col]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float total = 0.0f;
    for (int y = 0; y < 8; ++y) total += partial[y][threadIdx.x];
    float* dst = db + static_cast<std::int64_t>(e) * n + col;
    *dst = accumulate ? *dst + total : total;
  }
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

template <GroupedGemmKind kKind, typename Out>
void launch_simple(const Problem& p, cudaStream_t stream) {
  const std::int64_t cols = kKind == GroupedGemmKind::kForward ? p.n : p.k;
  const std::int64_t count =
      kKind == GroupedGemmKind::kWgrad ? static_cast<std::int64_t>(p.experts) * p.n * p.k : p.tokens * cols;
  const int blocks = static_cast<int>(std::clamp<std::int64_t>(ceil_div(count, 256), 1, 8192));
  const std::size_t smem = sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  grouped_gemm_simple_kernel<kKind, float, Out><<<blocks, 256, smem, stream>>>(p);
  SG_CUDA_CHECK(cudaGetLastError());
}

template <GroupedGemmKind kKind>
void launch_kind(const GroupedGemmDesc& d, const Problem& p, cudaStream_t stream) {
  const bool bf16_out = d.out_type == DType::kBFloat16;
  if (is_fp8_grouped(d)) {
    if constexpr (kKind == GroupedGemmKind::kWgrad) {
      launch_grouped_ws<kKind, float>(p, stream);
    } else {
      bf16_out ? launch_grouped_ws<kKind, __nv_bfloat16>(p, stream) : launch_grouped_ws<kKind, float>(p, stream);
    }
  } else if (d.in_type == DType::kBFloat16) {
    bf16_out ? launch_grouped_ws<kKind, __nv_bfloat16>(p, stream) : launch_grouped_ws<kKind, float>(p, stream);
  } else {
    if constexpr (kKind == GroupedGemmKind::kWgrad) {
      launch_simple<kKind, float>(p, stream);
    } else {
      bf16_out ? launch_simple<kKind, __nv_bfloat16>(p, stream) : launch_simple<kKind, float>(p, stream);
    }
  }
}

void check_pointer(const GroupedGemmDesc& d, const void* pointer, const char* name) {
  SG_CHECK(pointer != nullptr, "grouped_gemm ", grouped_gemm_kind_name(d.kind), ": ", name,
           " is null; pass a device pointer");
  const bool tensor_cores = d.in_type == DType::kBFloat16 || is_fp8_grouped(d);
  SG_CHECK(!tensor_cores || reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0, "grouped_gemm ",
           grouped_gemm_kind_name(d.kind), ": ", name, " (", pointer,
           ") is not 16-byte aligned; the tensor-core path copies 16-byte chunks");
}

}  // namespace

void launch_grouped_gemm(const GroupedGemmDesc& desc, const GroupedGemmOperands& o, cudaStream_t stream) {
  check_grouped_gemm(desc);
  const bool token_output = desc.kind != GroupedGemmKind::kWgrad;
  if (token_output && desc.tokens == 0) return;  // nothing to write
  Problem p;
  p.x = o.x;
  p.w = o.w;
  p.dy = o.dy;
  p.bias = desc.bias ? o.bias : nullptr;
  p.offsets = o.offsets;
  p.out = o.out;
  p.tokens = static_cast<int>(desc.tokens);
  p.experts = static_cast<int>(desc.experts);
  p.n = static_cast<int>(desc.n);
  p.k = static_cast<int>(desc.k);
  p.accumulate = desc.accumulate;
  if (is_fp8_grouped(desc)) {
    // a: x (forward) or dy; b: w, or x for wgrad.
    const bool forward = desc.kind == GroupedGemmKind::kForward;
    p.a_type = forward ? desc.in_type : desc.dy_type;
    p.b_type = desc.in_type;
    p.a_scale_inv = forward ? o.x_scale_inv : o.dy_scale_inv;
    p.b_scale_inv = desc.kind == GroupedGemmKind::kWgrad ? o.x_scale_inv : o.w_scale_inv;
    p.split_accumulation = desc.split_accumulation;
    SG_CHECK(p.a_scale_inv != nullptr && p.b_scale_inv != nullptr, "grouped_gemm ",
             grouped_gemm_kind_name(desc.kind), ": FP8 operands need their scale_inv pointers");
  }
  SG_CHECK(o.offsets != nullptr, "grouped_gemm: offsets is null; pass the device int32 [E + 1] offsets");
  check_pointer(desc, o.out, "out");
  switch (desc.kind) {
    case GroupedGemmKind::kForward:
      check_pointer(desc, o.x, "x");
      check_pointer(desc, o.w, "w");
      if (desc.bias) SG_CHECK(o.bias != nullptr, "grouped_gemm forward: bias is null but desc.bias is set");
      launch_kind<GroupedGemmKind::kForward>(desc, p, stream);
      break;
    case GroupedGemmKind::kDgrad:
      check_pointer(desc, o.dy, "dy");
      check_pointer(desc, o.w, "w");
      launch_kind<GroupedGemmKind::kDgrad>(desc, p, stream);
      break;
    case GroupedGemmKind::kWgrad:
      if (desc.tokens > 0) {
        check_pointer(desc, o.dy, "dy");
        check_pointer(desc, o.x, "x");
      }
      launch_kind<GroupedGemmKind::kWgrad>(desc, p, stream);
      break;
  }
}

void launch_grouped_bias_grad(const GroupedBiasGradDesc& desc, const void* dy, const std::int32_t* offsets, float* db,
                              cudaStream_t stream) {
  check_grouped_bias_grad(desc);
  SG_CHECK(offsets != nullptr && db != nullptr && (dy != nullptr || desc.tokens == 0),
           "grouped_bias_grad: null pointer (dy, offsets and db must be device pointers)");
  const dim3 grid(static_cast<unsigned>(ceil_div(desc.n, 32)), static_cast<unsigned>(desc.experts));
  const dim3 block(32, 8);
  const std::size_t smem = sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(desc.experts));
  const int tokens = static_cast<int>(desc.tokens);
  const int experts = static_cast<int>(desc.experts);
  const int n = static_cast<int>(desc.n);
  if (desc.dy_type == DType::kBFloat16) {
    grouped_bias_grad_kernel<<<grid, block, smem, stream>>>(static_cast<const __nv_bfloat16*>(dy), offsets, tokens,
                                                            experts, n, desc.accumulate, db);
  } else {
    grouped_bias_grad_kernel<<<grid, block, smem, stream>>>(static_cast<const float*>(dy), offsets, tokens, experts, n,
                                                            desc.accumulate, db);
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
