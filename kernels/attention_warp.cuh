// Device helpers of the plain attention kernels (attention_simple.cu,
// attention_segments.cu): one warp per row, head_dim <= 256 spread over the
// 32 lanes (lane + 32 e), fp32 arithmetic, warp sums by butterfly shuffles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
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

// Where a warp loop finds its rows: q, out, dout and dq rows of pitch q_ld,
// k, v, dk and dv rows of pitch kv_ld (head h at h * dim), lse and delta as
// [heads, stat_tokens] with stat_tokens the query tokens.
struct RowLayout {
  int dim;
  std::int64_t q_ld;
  std::int64_t kv_ld;
  int stat_tokens;
  float scale;
};

// The running max and sum of exp(s - max) of the forward's online softmax.
struct SoftmaxRunning {
  float max;
  float sum;
};

// The forward of one query row qr (kv head g) over keys [begin, end) in
// order: acc = sum_j exp(s_j - max) v_j. With no key, max is -inf and sum 0.
template <typename T>
__device__ __forceinline__ SoftmaxRunning forward_over_keys(float (&acc)[kMaxPerLane], const float (&qr)[kMaxPerLane],
                                                            const T* k, const T* v, int g, int begin, int end,
                                                            const RowLayout& r, int lane) {
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) acc[e] = 0.0f;
  float max = -INFINITY;
  float sum = 0.0f;
  for (int j = begin; j < end; ++j) {
    const T* k_row = k + j * r.kv_ld + g * r.dim;
    const T* v_row = v + j * r.kv_ld + g * r.dim;
    const float s = r.scale * row_dot(qr, k_row, r.dim, lane);
    const float new_max = fmaxf(max, s);
    const float alpha = expf(max - new_max);  // 0 on the first key
    const float w = expf(s - new_max);
    sum = sum * alpha + w;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      acc[e] = acc[e] * alpha + (d < r.dim ? w * to_float(v_row[d]) : 0.0f);
    }
    max = new_max;
  }
  return {max, sum};
}

// acc = sum_j P_ij (dP_ij - delta_i) k_j over keys [begin, end) of query row
// qr (its dout row dor, kv head g); dq_i is scale * acc.
template <typename T>
__device__ __forceinline__ void dq_over_keys(float (&acc)[kMaxPerLane], const float (&qr)[kMaxPerLane],
                                             const float (&dor)[kMaxPerLane], float row_lse, float row_delta,
                                             const T* k, const T* v, int g, int begin, int end, const RowLayout& r,
                                             int lane) {
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) acc[e] = 0.0f;
  for (int j = begin; j < end; ++j) {
    const T* k_row = k + j * r.kv_ld + g * r.dim;
    const float prob = expf(r.scale * row_dot(qr, k_row, r.dim, lane) - row_lse);
    const float dp = row_dot(dor, v + j * r.kv_ld + g * r.dim, r.dim, lane);
    const float ds = prob * (dp - row_delta);
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      const int d = lane + 32 * e;
      if (d < r.dim) acc[e] += ds * to_float(k_row[d]);
    }
  }
}

// Adds to dv_acc sum_i P_ij dout_i and to dk_acc sum_i dS_ij q_i for key row
// kr (value row vr) of kv head g, over its query heads (group of them) and
// queries [first, end); dk_j is scale * dk_acc.
template <typename T>
__device__ __forceinline__ void dkdv_over_queries(float (&dk_acc)[kMaxPerLane], float (&dv_acc)[kMaxPerLane],
                                                  const float (&kr)[kMaxPerLane], const float (&vr)[kMaxPerLane],
                                                  const T* q, const T* dout, const float* lse, const float* delta,
                                                  int g, int group, int first, int end, const RowLayout& r, int lane) {
  for (int h = g * group; h < (g + 1) * group; ++h) {
    for (int i = first; i < end; ++i) {
      const T* q_row = q + i * r.q_ld + h * r.dim;
      const T* do_row = dout + i * r.q_ld + h * r.dim;
      const std::int64_t stat = static_cast<std::int64_t>(h) * r.stat_tokens + i;
      const float prob = expf(r.scale * row_dot(kr, q_row, r.dim, lane) - lse[stat]);
      const float dp = row_dot(vr, do_row, r.dim, lane);
      const float ds = prob * (dp - delta[stat]);
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int d = lane + 32 * e;
        if (d < r.dim) {
          dv_acc[e] += prob * to_float(do_row[d]);
          dk_acc[e] += ds * to_float(q_row[d]);
        }
      }
    }
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
