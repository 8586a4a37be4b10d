// The plain attention kernels (fp32, and every head_dim <= 256): one warp per
// (query, head) for the forward and dq, one warp per (key, kv head) for dk
// and dv, each walking its keys (or queries) in order with fp32 arithmetic.
// Correct and deterministic, not fast; the tensor-core kernels
// (attention_forward.cu, attention_backward.cu) take bf16/fp16 at head_dim 64
// and 128. Also the delta kernel both backward paths share.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/attention_paths.h"
#include "kernels/attention_warp.cuh"
#include "kernels/tile/attention_tile.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels::attention_detail {
namespace {

using namespace warp;  // NOLINT(google-build-using-namespace): the plain kernels' shared helpers

struct SimpleParams {
  int tokens, sequences, heads, kv_heads, dim;
  bool causal;
  float scale;
};

// A warp's query of the forward and dq kernels: token i of query head h (kv
// head g), its sequence, and the row pitches of q (and out, dout, dq) and of k, v.
struct WarpQuery {
  int i = 0;
  int h = 0;
  int g = 0;
  tile::SequenceTile seq;
  std::int64_t q_ld = 0;
  std::int64_t kv_ld = 0;
};

// This warp's query, or false where it has none. Every lane gets the same answer.
__device__ __forceinline__ bool locate_query(const SimpleParams& p, const std::int32_t* cu_seqlens, WarpQuery* w) {
  if (!warp_item(p.tokens, p.heads, &w->i, &w->h)) return false;
  if (!tile::warp_locate_tile(cu_seqlens, p.sequences, p.tokens, 1, w->i, &w->seq)) return false;
  w->g = w->h / (p.heads / p.kv_heads);
  w->q_ld = static_cast<std::int64_t>(p.heads) * p.dim;
  w->kv_ld = static_cast<std::int64_t>(p.kv_heads) * p.dim;
  return true;
}

// The keys query i sees: [seq.begin, return value).
__device__ __forceinline__ int last_key(const SimpleParams& p, const tile::SequenceTile& seq, int i) {
  const int causal_last = i + 1;
  return p.causal ? causal_last : seq.end;
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) attention_forward_simple_kernel(
    SimpleParams p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const std::int32_t* __restrict__ cu_seqlens, T* __restrict__ out, float* __restrict__ lse) {
  WarpQuery w;
  if (!locate_query(p, cu_seqlens, &w)) return;
  const auto [i, h, g, seq, q_ld, kv_ld] = w;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float qr[kMaxPerLane];
  float acc[kMaxPerLane];
  load_row(qr, q + i * q_ld + h * p.dim, p.dim, lane);
  const RowLayout r{p.dim, q_ld, kv_ld, p.tokens, p.scale};
  const auto [max, sum] = forward_over_keys(acc, qr, k, v, g, seq.begin, last_key(p, seq, i), r, lane);
  store_row(out + i * q_ld + h * p.dim, acc, 1.0f / sum, p.dim, lane);
  if (lane == 0) lse[static_cast<std::int64_t>(h) * p.tokens + i] = max + logf(sum);
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) attention_delta_kernel(
    SimpleParams p, const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ delta) {
  int i = 0;
  int h = 0;
  if (!warp_item(p.tokens, p.heads, &i, &h)) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t row = (static_cast<std::int64_t>(i) * p.heads + h) * p.dim;
  float sum = 0.0f;
  for (int d = lane; d < p.dim; d += 32) sum += to_float(dout[row + d]) * to_float(out[row + d]);
  sum = warp_sum(sum);
  if (lane == 0) delta[static_cast<std::int64_t>(h) * p.tokens + i] = sum;
}

// dq_i = scale sum_j P_ij (dP_ij - delta_i) k_j, one warp per (query, head).
template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) attention_dq_simple_kernel(
    SimpleParams p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
    const std::int32_t* __restrict__ cu_seqlens, T* __restrict__ dq) {
  WarpQuery w;
  if (!locate_query(p, cu_seqlens, &w)) return;
  const auto [i, h, g, seq, q_ld, kv_ld] = w;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float qr[kMaxPerLane];
  float dor[kMaxPerLane];
  float acc[kMaxPerLane];
  load_row(qr, q + i * q_ld + h * p.dim, p.dim, lane);
  load_row(dor, dout + i * q_ld + h * p.dim, p.dim, lane);
  const float row_lse = lse[static_cast<std::int64_t>(h) * p.tokens + i];
  const float row_delta = delta[static_cast<std::int64_t>(h) * p.tokens + i];
  const RowLayout r{p.dim, q_ld, kv_ld, p.tokens, p.scale};
  dq_over_keys(acc, qr, dor, row_lse, row_delta, k, v, g, seq.begin, last_key(p, seq, i), r, lane);
  store_row(dq + i * q_ld + h * p.dim, acc, p.scale, p.dim, lane);
}

// dv_j = sum_i P_ij dout_i and dk_j = scale sum_i dS_ij q_i over the query
// heads of kv head g and the queries that see key j; one warp per (key, kv head).
template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) attention_dkdv_simple_kernel(
    SimpleParams p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
    const std::int32_t* __restrict__ cu_seqlens, T* __restrict__ dk, T* __restrict__ dv) {
  int j = 0;
  int g = 0;
  if (!warp_item(p.tokens, p.kv_heads, &j, &g)) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  tile::SequenceTile seq;
  if (!tile::warp_locate_tile(cu_seqlens, p.sequences, p.tokens, 1, j, &seq)) return;
  const int group = p.heads / p.kv_heads;
  const std::int64_t q_ld = static_cast<std::int64_t>(p.heads) * p.dim;
  const std::int64_t kv_ld = static_cast<std::int64_t>(p.kv_heads) * p.dim;
  float kr[kMaxPerLane];
  float vr[kMaxPerLane];
  float dk_acc[kMaxPerLane];
  float dv_acc[kMaxPerLane];
  load_row(kr, k + j * kv_ld + g * p.dim, p.dim, lane);
  load_row(vr, v + j * kv_ld + g * p.dim, p.dim, lane);
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) dk_acc[e] = dv_acc[e] = 0.0f;
  const RowLayout r{p.dim, q_ld, kv_ld, p.tokens, p.scale};
  dkdv_over_queries(dk_acc, dv_acc, kr, vr, q, dout, lse, delta, g, group, p.causal ? j : seq.begin, seq.end, r, lane);
  store_row(dk + j * kv_ld + g * p.dim, dk_acc, p.scale, p.dim, lane);
  store_row(dv + j * kv_ld + g * p.dim, dv_acc, 1.0f, p.dim, lane);
}

SimpleParams params_of(const AttentionDesc& d) {
  return {static_cast<int>(d.tokens), static_cast<int>(d.sequences), static_cast<int>(d.heads),
          static_cast<int>(d.kv_heads), static_cast<int>(d.head_dim), d.causal, d.softmax_scale()};
}

}  // namespace

void forward_simple(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream) {
  const SimpleParams sp = params_of(desc);
  with_element_type(desc.dtype, [&](auto zero) {
    using T = decltype(zero);
    attention_forward_simple_kernel<T><<<blocks_for_items(desc.tokens * desc.heads), 32 * kWarpsPerBlock, 0, stream>>>(
        sp, static_cast<const T*>(p.q), static_cast<const T*>(p.k), static_cast<const T*>(p.v), p.cu_seqlens,
        static_cast<T*>(p.out_mut), p.lse_mut);
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

void backward_delta(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream) {
  const SimpleParams sp = params_of(desc);
  with_element_type(desc.dtype, [&](auto zero) {
    using T = decltype(zero);
    attention_delta_kernel<T><<<blocks_for_items(desc.tokens * desc.heads), 32 * kWarpsPerBlock, 0, stream>>>(
        sp, static_cast<const T*>(p.out), static_cast<const T*>(p.dout), p.delta);
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

void backward_simple(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream) {
  const SimpleParams sp = params_of(desc);
  with_element_type(desc.dtype, [&](auto zero) {
    using T = decltype(zero);
    attention_dq_simple_kernel<T><<<blocks_for_items(desc.tokens * desc.heads), 32 * kWarpsPerBlock, 0, stream>>>(
        sp, static_cast<const T*>(p.q), static_cast<const T*>(p.k), static_cast<const T*>(p.v), p.lse,
        static_cast<const T*>(p.dout), p.delta, p.cu_seqlens, static_cast<T*>(p.dq));
    SG_CUDA_CHECK(cudaGetLastError());
    attention_dkdv_simple_kernel<T>
        <<<blocks_for_items(desc.tokens * desc.kv_heads), 32 * kWarpsPerBlock, 0, stream>>>(
            sp, static_cast<const T*>(p.q), static_cast<const T*>(p.k), static_cast<const T*>(p.v), p.lse,
            static_cast<const T*>(p.dout), p.delta, p.cu_seqlens, static_cast<T*>(p.dk), static_cast<T*>(p.dv));
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace stepgraph::kernels::attention_detail
