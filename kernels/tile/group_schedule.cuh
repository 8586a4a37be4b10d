// Device-side view of a grouped problem's split, shared by the grouped GEMM
// and grouped reduction kernels: the group offsets read from device memory
// (never the host), made safe, and a tile schedule over (group, m, n) tiles
// computed from them inside the kernel, so a launch's configuration needs
// only static bounds.
#pragma once

#include <cstdint>

namespace stepgraph::kernels::tile {

// This thread's index in its block and the block's size, over all three
// dimensions (the bias-gradient kernel's blocks are 32 x 8: threadIdx.x alone
// would make eight "thread 0"s race on the shared schedule).
__device__ __forceinline__ int block_thread() {
  return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
}
__device__ __forceinline__ int block_threads() { return static_cast<int>(blockDim.x * blockDim.y * blockDim.z); }

// Shared-memory ints group_offsets needs for `experts` groups.
constexpr int group_offsets_ints(int experts) { return experts + 1; }

// offsets[0..E] clamped into [0, tokens] and made nondecreasing (a prefix
// max), into shared `out`. Whatever the routing wrote, every group then lies
// inside [0, tokens), so no kernel reads or writes out of bounds. Every thread
// of the block calls it; ends with a barrier.
__device__ __forceinline__ void load_group_offsets(const std::int32_t* offsets, int experts, int tokens, int* out) {
  for (int e = block_thread(); e <= experts; e += block_threads()) {
    const int value = offsets[e];
    out[e] = value < 0 ? 0 : (value > tokens ? tokens : value);
  }
  __syncthreads();
  if (block_thread() == 0) {
    for (int e = 1; e <= experts; ++e) out[e] = out[e] < out[e - 1] ? out[e - 1] : out[e];
  }
  __syncthreads();
}

// tile_start[e] = the first tile of group e in a schedule where group e has
// tiles_of(e) tiles; tile_start[E] is the total. Thread 0 computes it; ends
// with a barrier.
template <typename TilesOf>
__device__ __forceinline__ void build_tile_starts(int experts, int* tile_start, TilesOf&& tiles_of) {
  if (block_thread() == 0) {
    int total = 0;
    for (int e = 0; e < experts; ++e) {
      tile_start[e] = total;
      total += tiles_of(e);
    }
    tile_start[experts] = total;
  }
  __syncthreads();
}

// The group that owns `tile` (< tile_start[E]): the last e with
// tile_start[e] <= tile, which skips groups without tiles.
__device__ __forceinline__ int group_of_tile(const int* tile_start, int experts, int tile) {
  int lo = 0;
  int hi = experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tile_start[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The local-th tile of a group of m_tiles x n_tiles output tiles, ordered in
// bands of `band` m-tiles with the n-tiles outer inside a band: the blocks
// running at once then cover a band x (blocks / band) patch, so they share
// both the operand rows of the band and the weight columns through L2 (a plain
// row-major order would stream a weight matrix larger than L2 once per m-tile).
struct TileMN {
  int m;
  int n;
};
__device__ __forceinline__ TileMN band_raster(int local, int m_tiles, int n_tiles, int band) {
  const int first = local / (band * n_tiles) * band;
  const int in_band = local - first * n_tiles;
  const int rows = m_tiles - first < band ? m_tiles - first : band;
  return {first + in_band % rows, in_band / rows};
}

}  // namespace stepgraph::kernels::tile
