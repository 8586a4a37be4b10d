// Launch helpers shared by the elementwise-style kernels: one bounded grid
// size rule and one grid-stride loop, so no kernel writes its own.
#pragma once

#include <algorithm>
#include <cstdint>

namespace stepgraph::kernels {

inline constexpr int kThreadsPerBlock = 256;

// Grid-stride loops let a bounded grid cover any n: up to 8 blocks of 256
// threads per SM of an H100 (132 SMs) in flight, never millions of blocks.
inline constexpr std::int64_t kMaxBlocks = 8 * 132;

inline int blocks_for(std::int64_t n) {
  return static_cast<int>(std::clamp<std::int64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, 1, kMaxBlocks));
}

// for (i : this thread's indices in [0, n)) body(i)
template <typename Body>
__device__ __forceinline__ void grid_stride(std::int64_t n, Body&& body) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    body(i);
  }
}

}  // namespace stepgraph::kernels
