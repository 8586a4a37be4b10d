// Internal to the grouped GEMM kernels (grouped_gemm.cu, grouped_gemm_ws.cu):
// the problem a launch describes, paired element loads and stores (the
// scalar conversions are vector_io.cuh's) and the zeroing of rows outside
// every group.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <type_traits>

#include "kernels/grouped_gemm.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels::grouped {

struct Problem {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* dy = nullptr;
  const void* bias = nullptr;
  const std::int32_t* offsets = nullptr;
  void* out = nullptr;
  int tokens = 0;
  int experts = 0;
  int n = 0;
  int k = 0;
  bool accumulate = false;
  // The wgmma kernels' element types: a (x, dy) and b (w, or x for wgrad):
  // bf16, or FP8 (a E4M3 or E5M2, b E4M3) with their scale_inv.
  DType a_type = DType::kBFloat16;
  DType b_type = DType::kBFloat16;
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
  bool split_accumulation = false;  // FP8: Note [FP8 grouped GEMM]
};

// Pointer arithmetic on type-erased operands.
template <typename T>
__device__ __forceinline__ const T* at(const void* base, std::int64_t element) {
  return static_cast<const T*>(base) + element;
}

template <typename Out>
__device__ __forceinline__ void store_pair(Out* p, float v0, float v1) {
  if constexpr (std::is_same_v<Out, float>) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
  }
}

template <typename Out>
__device__ __forceinline__ float2 load_pair(const Out* p) {
  if constexpr (std::is_same_v<Out, float>) {
    return *reinterpret_cast<const float2*>(p);
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
  }
}

// Zeros the rows of the token-major output outside [offs[0], offs[E]).
template <typename Out>
__device__ void zero_rows_outside_groups(const int* offs, int experts, int tokens, int cols, Out* out) {
  const std::int64_t below = offs[0];
  const std::int64_t above = offs[experts];
  const std::int64_t count = (below + tokens - above) * cols;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    std::int64_t row = i / cols;
    if (row >= below) row += above - below;
    out[row * cols + i % cols] = from_float<Out>(0.0f);
  }
}

// The products on wgmma + TMA, warp-specialised (grouped_gemm_ws.cu): the
// bf16 forward and dgrad, and every FP8 product (Out bf16 or float; wgrad's
// float): a TMA producer warpgroup and two consumer warpgroups sharing each
// 128 x 256 tile.
template <GroupedGemmKind kKind, typename Out>
void launch_grouped_ws(const Problem& p, cudaStream_t stream);


}  // namespace stepgraph::kernels::grouped
