// Device pieces shared by the expert-parallel exchange kernels (the plan and
// the padded copies in moe_exchange.cu, the route table and the peer copy in
// moe_exchange_peer.cu): the warp scans over counts and the row copy with its
// word width. Integer scans and pure copies: any dtype moves bit for bit.
// Compiled by nvcc only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_exchange.h"

namespace stepgraph::kernels::ep {

// A running sum over 32 lanes (inclusive), in int64: counts are device values.
__device__ __forceinline__ std::int64_t warp_inclusive_scan(std::int64_t value) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const std::int64_t other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// The clamped running sums of one rank's counts `counts` [E] (Note
// [Expert-parallel plan]), by one whole warp, 32 experts at a time: every
// lane calls f(g0, g, c_g, c_next) with g = g0 + lane, c_g = c_p[g] and
// c_next = c_p[g + 1] (lanes with g >= E too, so f may shuffle; they must
// not store). Returns the unclamped sum of the counts (every lane).
template <typename F>
__device__ __forceinline__ std::int64_t warp_clamped_sums(const std::int32_t* __restrict__ counts, std::int64_t experts,
                                                          std::int64_t rows, F&& f) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  std::int64_t carry = 0;  // the sum of the counts before this chunk
  for (std::int64_t g0 = 0; g0 < experts; g0 += 32) {
    const std::int64_t g = g0 + lane;
    const std::int64_t v = g < experts ? max(counts[g], 0) : 0;
    const std::int64_t inclusive = carry + warp_inclusive_scan(v);
    f(g0, g, static_cast<std::int32_t>(min(inclusive - v, rows)), static_cast<std::int32_t>(min(inclusive, rows)));
    carry = __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return carry;
}

// Where each of n lengths `lengths` starts, by one whole warp: f(i, start)
// for every i < n, start the sum of the lengths before i. Returns the sum of
// all n (every lane).
template <typename F>
__device__ __forceinline__ std::int64_t warp_starts(const std::int32_t* lengths, std::int64_t n, F&& f) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  std::int64_t carry = 0;
  for (std::int64_t i0 = 0; i0 < n; i0 += 32) {
    const std::int64_t i = i0 + lane;
    const std::int64_t v = i < n ? lengths[i] : 0;
    const std::int64_t inclusive = carry + warp_inclusive_scan(v);
    if (i < n) f(i, static_cast<std::int32_t>(inclusive - v));
    carry = __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return carry;
}

// One row pointer per rank (a pack's slots, an unpack's sources, a peer
// copy's receivers), passed to a kernel by value.
template <typename W>
struct RankRows {
  W* at[kMaxEpRanks];
};

// Copies `words` words of W from src to dst (zero when src is null), lanes striding.
template <typename W>
__device__ __forceinline__ void copy_row(W* __restrict__ dst, const W* __restrict__ src, std::int64_t words, int lane) {
  if (src == nullptr) {
    for (std::int64_t i = lane; i < words; i += 32) dst[i] = W{};
  } else {
    for (std::int64_t i = lane; i < words; i += 32) dst[i] = src[i];
  }
}

// f(W{}) with W the widest of 16, 4, 2 and 1 bytes that divides the row and
// aligns every pointer.
template <typename F>
void with_word(std::size_t row_bytes, const void* one, const void* const* many, int count, F&& f) {
  auto fits = [&](std::size_t bytes) {
    bool ok = row_bytes % bytes == 0 && reinterpret_cast<std::uintptr_t>(one) % bytes == 0;
    for (int i = 0; i < count; ++i) ok = ok && reinterpret_cast<std::uintptr_t>(many[i]) % bytes == 0;
    return ok;
  };
  if (fits(16)) return f(uint4{});
  if (fits(4)) return f(std::uint32_t{});
  if (fits(2)) return f(std::uint16_t{});
  return f(std::uint8_t{});
}

}  // namespace stepgraph::kernels::ep
