// Reading packed variable-length sequences (cu_seqlens int32 [S + 1], see
// kernels/attention.h) on the device, without trusting the contents: a
// captured step takes whatever packing the host wrote last, so every value
// is clamped into [0, tokens] as it is read and nothing derived from it can
// index out of bounds. A malformed packing gives garbage positions, never a
// fault.
#pragma once

#include <cstdint>

namespace stepgraph::kernels {

__device__ __forceinline__ int clamped_cu_seqlen(const std::int32_t* cu_seqlens, int i, int tokens) {
  const int value = cu_seqlens[i];
  return value < 0 ? 0 : (value > tokens ? tokens : value);
}

// The first token of token t's sequence: a binary search for the last s in
// [0, S] with cu_seqlens[s] <= t. The result lies in [0, t].
__device__ __forceinline__ int sequence_start_of(const std::int32_t* cu_seqlens, int sequences, int tokens, int t) {
  int lo = 0, hi = sequences;  // invariant (for a valid packing): cu[lo] <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (clamped_cu_seqlen(cu_seqlens, mid, tokens) <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int start = clamped_cu_seqlen(cu_seqlens, lo, tokens);
  return start <= t ? start : t;
}

}  // namespace stepgraph::kernels
