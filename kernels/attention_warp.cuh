// Device helpers of the plain attention kernels (attention_simple.cu,
// attention_segments.cu): one warp per row, head_dim <= 256 spread over the
// 32 lanes (lane + 32 e), fp32 arithmetic, warp sums by butterfly shuffles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "engine/dtype.h"
#include "engine/error.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels::attention_detail::warp {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxPerLane = 8;  // head_dim <= 256

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// This warp's (token or key, head) of a [tokens x heads] problem, or false.
__device__ __forceinline__ bool warp_item(int tokens, int heads, int* token, int* head) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= static_cast<std::int64_t>(tokens) * heads) return false;
  *token = static_cast<int>(item / heads);
  *head = static_cast<int>(item % heads);
  return true;
}

// x[e] = row[lane + 32 e] as fp32 (0 past dim).
template <typename T>
__device__ __forceinline__ void load_row(float (&x)[kMaxPerLane], const T* row, int dim, int lane) {
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    x[e] = d < dim ? to_float(row[d]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ float row_dot(const float (&x)[kMaxPerLane], const T* row, int dim, int lane) {
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < dim) sum += x[e] * to_float(row[d]);
  }
  return warp_sum(sum);
}

template <typename T>
__device__ __forceinline__ void store_row(T* row, const float (&x)[kMaxPerLane], float factor, int dim, int lane) {
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) {
    const int d = lane + 32 * e;
    if (d < dim) row[d] = from_float<T>(x[e] * factor);
  }
}

inline unsigned blocks_for_items(std::int64_t items) {
  return static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// Calls f(T{}) with T the element type of `dtype`.
template <typename F>
void with_element_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); return;
    case DType::kBFloat16: f(__nv_bfloat16{}); return;
    case DType::kFloat16: f(__half{}); return;
    default: SG_CHECK(false, "attention: no kernels for dtype ", dtype_name(dtype));
  }
}

}  // namespace stepgraph::kernels::attention_detail::warp
