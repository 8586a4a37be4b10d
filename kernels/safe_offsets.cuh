// Reading an offsets table (cu_seqlens, a segment table's q_offsets) on the
// device 32 entries at a time, made safe as Note [Safe cu_seqlens] says:
// c'[0] = 0, c'[n] = total, c'[s] = min(total, max(0, c[1], ..., c[s])).
// Shared by the segment attention kernels and the context-parallel plan.
#pragma once

#include <cstdint>

namespace stepgraph::kernels {

__device__ __forceinline__ int clamp_to(int value, int low, int high) {
  return value < low ? low : (value > high ? high : value);
}

// Entries s0 .. s0 + 31 (s0 + lane in each lane) of a table of `count`
// ranges [c'[s], c'[s + 1]) over `total` tokens: the lane's range in
// *begin, *end (both total past the last range). `carry` is c'[s0] in and
// c'[s0 + 32] out. Called by all 32 lanes of a warp.
__device__ __forceinline__ void warp_safe_ranges(const std::int32_t* offsets, int count, int total, int s0,
                                                 int* carry, int* begin, int* end) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int s = s0 + lane;
  int e = total;
  if (s + 1 < count) {
    e = clamp_to(offsets[s + 1], 0, total);
  }
  if (e < *carry) e = *carry;
  // Inclusive max scan: c'[s + 1].
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, e, offset);
    if (lane >= offset && other > e) e = other;
  }
  int b = __shfl_up_sync(0xffffffffu, e, 1);
  if (lane == 0) b = *carry;
  *carry = __shfl_sync(0xffffffffu, e, 31);
  *begin = b;
  *end = e;
}

}  // namespace stepgraph::kernels
