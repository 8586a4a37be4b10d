// Segment attention (Note [Segment attention] in kernels/attention.h): the
// launchers, which take the tensor-core kernels (attention_forward.cu,
// attention_backward.cu, given the segment table) where self-attention would
// take them, and the plain kernels here otherwise: one warp per (query, head)
// for the forward and dq, one warp per (kv token, kv head) for dk and dv,
// with the arithmetic of the self-attention plain kernels (attention_simple.cu)
// over each query's keys. The segment table is read on the device only, made
// safe as it is read.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/attention.h"
#include "kernels/attention_paths.h"
#include "kernels/attention_warp.cuh"
#include "kernels/safe_offsets.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

using namespace attention_detail::warp;  // NOLINT(google-build-using-namespace): the plain kernels' helpers

struct SegmentParams {
  int q_tokens, kv_tokens, segments, heads, kv_heads, dim;
  bool causal;
  float scale;
};

// One segment's bounds, made safe: queries [q_begin, q_end) within [0, Tq),
// keys [k_begin, k_end) within [0, Tk).
struct Segment {
  int q_begin = 0;
  int q_end = 0;
  int k_begin = 0;
  int k_end = 0;
};

// Segments s0 .. s0 + 31, one a lane, read safely: q_offsets as Note [Safe
// cu_seqlens] reads cu_seqlens (q'[s + 1] = max(q'[s], clamp(q[s + 1])),
// q'[G] = Tq), the kv ranges clamped. `carry` is q'[s0] in and q'[s0 + 32]
// out. Lanes past the last segment get an empty one. Called by all 32 lanes.
__device__ __forceinline__ Segment load_segments(const SegmentParams& p, const std::int32_t* q_offsets,
                                                 const std::int32_t* kv_ranges, int s0, int* carry) {
  const int s = s0 + (static_cast<int>(threadIdx.x) & 31);
  int begin = 0;
  int end = 0;
  warp_safe_ranges(q_offsets, p.segments, p.q_tokens, s0, carry, &begin, &end);
  Segment seg;
  if (s < p.segments) {
    seg.q_begin = begin;
    seg.q_end = end;
    seg.k_begin = clamp_to(kv_ranges[2 * static_cast<std::int64_t>(s)], 0, p.kv_tokens);
    seg.k_end = clamp_to(kv_ranges[2 * static_cast<std::int64_t>(s) + 1], seg.k_begin, p.kv_tokens);
  }
  return seg;
}

__device__ __forceinline__ Segment shfl_segment(const Segment& seg, int lane) {
  return {__shfl_sync(0xffffffffu, seg.q_begin, lane), __shfl_sync(0xffffffffu, seg.q_end, lane),
          __shfl_sync(0xffffffffu, seg.k_begin, lane), __shfl_sync(0xffffffffu, seg.k_end, lane)};
}

// The segment of query i (every query in [0, Tq) has one), the same in every lane.
__device__ __forceinline__ bool find_segment(const SegmentParams& p, const std::int32_t* q_offsets,
                                             const std::int32_t* kv_ranges, int i, Segment* out) {
  int carry = 0;
  for (int s0 = 0; s0 < p.segments; s0 += 32) {
    const Segment seg = load_segments(p, q_offsets, kv_ranges, s0, &carry);
    const unsigned found = __ballot_sync(0xffffffffu, seg.q_begin <= i && i < seg.q_end);
    if (found != 0) {
      *out = shfl_segment(seg, __ffs(found) - 1);
      return true;
    }
  }
  return false;
}

// The keys query i of `seg` sees: [seg.k_begin, return value).
__device__ __forceinline__ int last_key(const SegmentParams& p, const Segment& seg, int i) {
  return seg.k_begin + static_cast<int>(segment_visible_keys(p.causal, seg.q_end - seg.q_begin,
                                                             seg.k_end - seg.k_begin, i - seg.q_begin));
}

// A warp's query of the forward and dq kernels: token i of query head h (kv
// head g), its segment, and where its rows lie.
struct SegmentQuery {
  int i = 0;
  int h = 0;
  int g = 0;
  Segment seg;
  RowLayout rows{};
};

// This warp's query, or false where it has none. Every lane gets the same answer.
__device__ __forceinline__ bool locate_query(const SegmentParams& p, const std::int32_t* q_offsets,
                                             const std::int32_t* kv_ranges, SegmentQuery* w) {
  if (!warp_item(p.q_tokens, p.heads, &w->i, &w->h)) return false;
  if (!find_segment(p, q_offsets, kv_ranges, w->i, &w->seg)) return false;
  w->g = w->h / (p.heads / p.kv_heads);
  w->rows = {p.dim, static_cast<std::int64_t>(p.heads) * p.dim, static_cast<std::int64_t>(p.kv_heads) * p.dim,
             p.q_tokens, p.scale};
  return true;
}

template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) segment_forward_kernel(
    SegmentParams p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const std::int32_t* __restrict__ q_offsets, const std::int32_t* __restrict__ kv_ranges, T* __restrict__ out,
    float* __restrict__ lse) {
  SegmentQuery w;
  if (!locate_query(p, q_offsets, kv_ranges, &w)) return;
  const auto& [i, h, g, seg, r] = w;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float qr[kMaxPerLane];
  float acc[kMaxPerLane];
  load_row(qr, q + i * r.q_ld + h * p.dim, p.dim, lane);
  const int last = last_key(p, seg, i);
  const auto [max, sum] = forward_over_keys(acc, qr, k, v, g, seg.k_begin, last, r, lane);
  const bool any = last > seg.k_begin;  // a query that sees no key: out 0, lse -inf
  store_row(out + i * r.q_ld + h * p.dim, acc, any ? 1.0f / sum : 0.0f, p.dim, lane);
  if (lane == 0) lse[static_cast<std::int64_t>(h) * p.q_tokens + i] = any ? max + logf(sum) : -INFINITY;
}

// dq_i = scale sum_j P_ij (dP_ij - delta_i) k_j over the keys query i sees.
template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) segment_dq_kernel(
    SegmentParams p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
    const std::int32_t* __restrict__ q_offsets, const std::int32_t* __restrict__ kv_ranges, T* __restrict__ dq) {
  SegmentQuery w;
  if (!locate_query(p, q_offsets, kv_ranges, &w)) return;
  const auto& [i, h, g, seg, r] = w;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  float qr[kMaxPerLane];
  float dor[kMaxPerLane];
  float acc[kMaxPerLane];
  load_row(qr, q + i * r.q_ld + h * p.dim, p.dim, lane);
  load_row(dor, dout + i * r.q_ld + h * p.dim, p.dim, lane);
  const float row_lse = lse[static_cast<std::int64_t>(h) * p.q_tokens + i];
  const float row_delta = delta[static_cast<std::int64_t>(h) * p.q_tokens + i];
  dq_over_keys(acc, qr, dor, row_lse, row_delta, k, v, g, seg.k_begin, last_key(p, seg, i), r, lane);
  store_row(dq + i * r.q_ld + h * p.dim, acc, p.scale, p.dim, lane);
}

// dv_j = sum_i P_ij dout_i and dk_j = scale sum_i dS_ij q_i over every
// segment whose range holds key j (in segment order), the query heads of kv
// head g and the queries that see j; one warp per (kv token, kv head). Rows
// no query reads are written as zeros.
template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) segment_dkdv_kernel(
    SegmentParams p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ lse, const T* __restrict__ dout, const float* __restrict__ delta,
    const std::int32_t* __restrict__ q_offsets, const std::int32_t* __restrict__ kv_ranges, T* __restrict__ dk,
    T* __restrict__ dv) {
  int j = 0;
  int g = 0;
  if (!warp_item(p.kv_tokens, p.kv_heads, &j, &g)) return;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int group = p.heads / p.kv_heads;
  const std::int64_t q_ld = static_cast<std::int64_t>(p.heads) * p.dim;
  const std::int64_t kv_ld = static_cast<std::int64_t>(p.kv_heads) * p.dim;
  const RowLayout r{p.dim, q_ld, kv_ld, p.q_tokens, p.scale};
  float kr[kMaxPerLane];
  float vr[kMaxPerLane];
  float dk_acc[kMaxPerLane];
  float dv_acc[kMaxPerLane];
  load_row(kr, k + j * kv_ld + g * p.dim, p.dim, lane);
  load_row(vr, v + j * kv_ld + g * p.dim, p.dim, lane);
#pragma unroll
  for (int e = 0; e < kMaxPerLane; ++e) dk_acc[e] = dv_acc[e] = 0.0f;
  int carry = 0;
  for (int s0 = 0; s0 < p.segments; s0 += 32) {
    const Segment mine = load_segments(p, q_offsets, kv_ranges, s0, &carry);
    unsigned readers = __ballot_sync(0xffffffffu, mine.q_begin < mine.q_end && mine.k_begin <= j && j < mine.k_end);
    while (readers != 0) {
      const Segment seg = shfl_segment(mine, __ffs(readers) - 1);
      readers &= readers - 1;
      // The first query that sees key j: query i sees keys up to
      // k_end - (q_end - i) when causal (bottom-right), all of them otherwise.
      int first = seg.q_begin;
      if (p.causal && seg.q_end - (seg.k_end - j) > first) first = seg.q_end - (seg.k_end - j);
      dkdv_over_queries(dk_acc, dv_acc, kr, vr, q, dout, lse, delta, g, group, first, seg.q_end, r, lane);
    }
  }
  store_row(dk + j * kv_ld + g * p.dim, dk_acc, p.scale, p.dim, lane);
  store_row(dv + j * kv_ld + g * p.dim, dv_acc, 1.0f, p.dim, lane);
}

SegmentParams params_of(const SegmentAttentionDesc& d) {
  const AttentionDesc& a = d.attention;
  return {static_cast<int>(a.tokens),   static_cast<int>(d.kv_tokens), static_cast<int>(a.sequences),
          static_cast<int>(a.heads),    static_cast<int>(a.kv_heads),  static_cast<int>(a.head_dim),
          a.causal,                     a.softmax_scale()};
}

}  // namespace

bool segment_attention_uses_tensor_cores(const SegmentAttentionDesc& desc) {
  return attention_uses_tensor_cores(desc.attention);
}

void check_segment_attention_cuda(const SegmentAttentionDesc& desc) {
  check_segment_attention(desc);
  const AttentionDesc& a = desc.attention;
  SG_CHECK(a.head_dim <= 256, "segment attention: the CUDA kernels take head_dim <= 256, got ", a.head_dim);
  constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();
  SG_CHECK(a.tokens * a.heads <= kIntMax && desc.kv_tokens * a.kv_heads <= kIntMax && a.sequences < kIntMax,
           "segment attention: query tokens * heads (", a.tokens, " * ", a.heads, "), kv tokens * kv_heads (",
           desc.kv_tokens, " * ", a.kv_heads, ") and segments (", a.sequences, ") must be < 2^31 on the CUDA kernels");
}

void launch_segment_attention_forward(const SegmentAttentionDesc& desc, const void* q, const void* k, const void* v,
                                      const std::int32_t* q_offsets, const std::int32_t* kv_ranges, void* out,
                                      float* lse, CUstream_st* stream) {
  check_segment_attention_cuda(desc);
  SG_CHECK(q != nullptr && k != nullptr && v != nullptr && q_offsets != nullptr && kv_ranges != nullptr &&
               out != nullptr && lse != nullptr,
           "segment attention forward: q, k, v, q_offsets, kv_ranges, out and lse must be device pointers, got a "
           "null one");
  if (segment_attention_uses_tensor_cores(desc) && is_aligned16(q) && is_aligned16(k) && is_aligned16(v) &&
      is_aligned16(out)) {
    const attention_detail::AttentionPointers p{
        .q = q, .k = k, .v = v, .cu_seqlens = q_offsets, .kv_ranges = kv_ranges, .out_mut = out, .lse_mut = lse};
    attention_detail::forward_wgmma(desc.attention, desc.kv_tokens, p, stream);
    return;
  }
  const SegmentParams sp = params_of(desc);
  with_element_type(desc.attention.dtype, [&](auto zero) {
    using T = decltype(zero);
    segment_forward_kernel<T>
        <<<blocks_for_items(desc.attention.tokens * desc.attention.heads), 32 * kWarpsPerBlock, 0, stream>>>(
            sp, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), q_offsets, kv_ranges,
            static_cast<T*>(out), lse);
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

std::size_t segment_attention_backward_workspace_bytes(const SegmentAttentionDesc& desc) {
  check_segment_attention_cuda(desc);
  return attention_detail::BackwardWorkspace(desc.attention).bytes();
}

void launch_segment_attention_backward(const SegmentAttentionDesc& desc, const void* q, const void* k,
                                       const void* v, const void* out, const float* lse, const void* dout,
                                       const std::int32_t* q_offsets, const std::int32_t* kv_ranges, void* dq,
                                       void* dk, void* dv, void* workspace, CUstream_st* stream) {
  check_segment_attention_cuda(desc);
  SG_CHECK(q != nullptr && k != nullptr && v != nullptr && out != nullptr && lse != nullptr && dout != nullptr &&
               q_offsets != nullptr && kv_ranges != nullptr && dq != nullptr && dk != nullptr && dv != nullptr,
           "segment attention backward: q, k, v, out, lse, dout, q_offsets, kv_ranges, dq, dk and dv must be device "
           "pointers, got a null one");
  SG_CHECK(workspace != nullptr && reinterpret_cast<std::uintptr_t>(workspace) % 256 == 0,
           "segment attention backward: workspace must be a 256-byte aligned device buffer of "
           "segment_attention_backward_workspace_bytes(desc) bytes");
  attention_detail::AttentionPointers pointers{.q = q,
                                               .k = k,
                                               .v = v,
                                               .out = out,
                                               .lse = lse,
                                               .dout = dout,
                                               .cu_seqlens = q_offsets,
                                               .kv_ranges = kv_ranges,
                                               .dq = dq,
                                               .dk = dk,
                                               .dv = dv};
  attention_detail::BackwardWorkspace(desc.attention).place(workspace, &pointers);
  // delta over the query tokens: the self-attention delta kernel, its desc's tokens being Tq.
  attention_detail::backward_delta(desc.attention, pointers, stream);
  if (segment_attention_uses_tensor_cores(desc) && is_aligned16(q) && is_aligned16(k) && is_aligned16(v) &&
      is_aligned16(dout) && is_aligned16(dq) && is_aligned16(dk) && is_aligned16(dv)) {
    attention_detail::backward_wgmma(desc.attention, desc.kv_tokens, pointers, stream);
    return;
  }
  const float* delta = pointers.delta;
  const SegmentParams sp = params_of(desc);
  with_element_type(desc.attention.dtype, [&](auto zero) {
    using T = decltype(zero);
    segment_dq_kernel<T>
        <<<blocks_for_items(desc.attention.tokens * desc.attention.heads), 32 * kWarpsPerBlock, 0, stream>>>(
            sp, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), lse,
            static_cast<const T*>(dout), delta, q_offsets, kv_ranges, static_cast<T*>(dq));
    SG_CUDA_CHECK(cudaGetLastError());
    segment_dkdv_kernel<T>
        <<<blocks_for_items(desc.kv_tokens * desc.attention.kv_heads), 32 * kWarpsPerBlock, 0, stream>>>(
            sp, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), lse,
            static_cast<const T*>(dout), delta, q_offsets, kv_ranges, static_cast<T*>(dk), static_cast<T*>(dv));
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace stepgraph::kernels
