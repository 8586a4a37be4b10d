// Device helpers of the attention kernels (attention_*.cu): where a block's
// rows lie in a packed batch (read from the device cu_seqlens, made safe), the
// 16-bit element types' conversions and mma dispatch, and K-major tiles
// ([rows][D], D contiguous, as q, k, v, out and dout are stored) in swizzled
// shared memory with their ldmatrix fragment loads.
//
// Note [Safe cu_seqlens]: a kernel reads cu_seqlens as
//   c'[0] = 0,  c'[S] = T,  c'[s] = min(T, max(0, c[1], ..., c[s]))  (0 < s < S),
// which is cu_seqlens itself when it is a valid packing and otherwise some
// valid packing (every token in exactly one sequence), so nothing is read or
// written outside [0, T) and every output row is written. A block finds its
// (sequence, tile) by walking the sequences 32 at a time with warp scans: no
// shared array of S entries, no host copy, and a grid sized from T and S
// alone (sum over s of ceil(len_s / rows) <= min(T, ceil(T / rows) + S)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/tile/mma_pipeline.cuh"

namespace stepgraph::kernels::tile {

// Rows [first, first + rows_per_tile) of sequence [begin, end), clipped to end.
struct SequenceTile {
  int begin = 0;
  int end = 0;
  int first = 0;
};

// Upper bound on the number of tiles of `rows_per_tile` rows over any packing
// of `tokens` tokens into `sequences` sequences (the grid size).
inline std::int64_t attention_tile_bound(std::int64_t tokens, std::int64_t sequences, int rows_per_tile) {
  const std::int64_t bound = (tokens + rows_per_tile - 1) / rows_per_tile + sequences;
  return bound < tokens ? bound : tokens;
}

// The target-th tile (in sequence order) of a packing whose sequences are cut
// into tiles of rows_per_tile rows (See Note [Safe cu_seqlens]). Called by all
// 32 lanes of a warp; every lane gets the same answer. False when target is
// past the last tile.
__device__ __forceinline__ bool warp_locate_tile(const std::int32_t* cu_seqlens, int sequences, int tokens,
                                                 int rows_per_tile, int target, SequenceTile* out) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  int carry_bound = 0;  // c'[s0]
  int carry_tiles = 0;  // tiles of sequences before s0
  for (int s0 = 0; s0 < sequences; s0 += 32) {
    const int s = s0 + lane;
    int end = tokens;
    if (s + 1 < sequences) {
      const int raw = cu_seqlens[s + 1];
      end = raw < 0 ? 0 : (raw > tokens ? tokens : raw);
    }
    if (end < carry_bound) end = carry_bound;
    // Inclusive max scan: c'[s + 1].
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, end, offset);
      if (lane >= offset && other > end) end = other;
    }
    int begin = __shfl_up_sync(0xffffffffu, end, 1);
    if (lane == 0) begin = carry_bound;
    const int tiles = s < sequences ? (end - begin + rows_per_tile - 1) / rows_per_tile : 0;
    int inclusive = tiles;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const int exclusive = carry_tiles + inclusive - tiles;
    const bool mine = s < sequences && target >= exclusive && target < carry_tiles + inclusive;
    const unsigned found = __ballot_sync(0xffffffffu, mine);
    if (found != 0) {
      const int owner = __ffs(found) - 1;
      out->begin = __shfl_sync(0xffffffffu, begin, owner);
      out->end = __shfl_sync(0xffffffffu, end, owner);
      out->first = out->begin + (target - __shfl_sync(0xffffffffu, exclusive, owner)) * rows_per_tile;
      return true;
    }
    carry_bound = __shfl_sync(0xffffffffu, end, 31);
    carry_tiles += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  return false;
}

// The block's tile: warp 0 locates it, every thread gets it (ends with a
// barrier). False (for every thread) when the block has no tile.
__device__ __forceinline__ bool block_locate_tile(const std::int32_t* cu_seqlens, int sequences, int tokens,
                                                  int rows_per_tile, int target, SequenceTile* out) {
  __shared__ SequenceTile shared_tile;
  __shared__ int shared_found;
  if (threadIdx.x < 32) {
    SequenceTile t;
    const bool found = warp_locate_tile(cu_seqlens, sequences, tokens, rows_per_tile, target, &t);
    if (threadIdx.x == 0) {
      shared_tile = t;
      shared_found = found ? 1 : 0;
    }
  }
  __syncthreads();
  *out = shared_tile;
  return shared_found != 0;
}

// --- 16-bit element types ----------------------------------------------------

template <typename T>
struct Half16;

template <>
struct Half16<__nv_bfloat16> {
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
    mma_bf16(d, a, b0, b1);
  }
};

template <>
struct Half16<__half> {
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
    mma_fp16(d, a, b0, b1);
  }
};

// --- K-major tiles -----------------------------------------------------------

// A [kRows][kD] tile of 16-bit elements in shared memory, D contiguous. Chunk
// c (16 bytes) of row r is stored at chunk c ^ (r & 7): the 8 rows an
// ldmatrix reads, or 8 consecutive chunks of a column band, hit distinct banks
// (Note [Swizzled operand tiles] in mma_pipeline.cuh, for K-major rows).
template <int kRows, int kD, int kThreads>
struct RowTile {
  static_assert(kD % 64 == 0, "RowTile: the swizzle needs rows of at least 8 chunks");
  static constexpr int kChunksPerRow = kD / 8;
  static constexpr int kRowBytes = kD * 2;
  static constexpr int kBytes = kRows * kRowBytes;
  static constexpr int kChunks = kRows * kChunksPerRow;

  __device__ __forceinline__ static std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
  }

  // cp.async of rows [0, kRows) from base + row * ld (elements); rows at or
  // past `valid_rows` read nothing and are zero-filled.
  template <typename T>
  __device__ __forceinline__ static void load(std::uint32_t tile, const T* base, std::int64_t ld, int valid_rows) {
#pragma unroll
    for (int i = static_cast<int>(threadIdx.x); i < kChunks; i += kThreads) {
      const int row = i / kChunksPerRow;
      const int chunk = i % kChunksPerRow;
      const bool valid = row < valid_rows;
      const T* src = valid ? base + row * ld + chunk * 8 : base;
      cp_async16(tile + offset(row, chunk), src, valid);
    }
  }

  // A operand (m16 x k16) at rows m0.., columns k0..: a[0..3] = (m 0-7, k 0-7),
  // (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
  __device__ __forceinline__ static void load_a(std::uint32_t (&a)[4], std::uint32_t tile, int m0, int k0, int lane) {
    const int j = lane >> 3;
    ldmatrix_x4(a, tile + offset(m0 + (lane & 7) + (j & 1) * 8, k0 / 8 + (j >> 1)));
  }

  // B operands of two n8 tiles whose n runs along rows (n0.., n0 + 8..) and k
  // along columns (k0..k0 + 15): b[t] = {k 0-7, k 8-15} of n8 tile t.
  __device__ __forceinline__ static void load_b(std::uint32_t (&b)[2][2], std::uint32_t tile, int n0, int k0,
                                                int lane) {
    const int j = lane >> 3;
    std::uint32_t r[4];
    ldmatrix_x4(r, tile + offset(n0 + (lane & 7) + (j >> 1) * 8, k0 / 8 + (j & 1)));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
  }

  // B operands of two n8 tiles whose k runs along rows (k0..k0 + 15) and n
  // along columns (n0.., n0 + 8..): transposed on the way to registers.
  __device__ __forceinline__ static void load_b_trans(std::uint32_t (&b)[2][2], std::uint32_t tile, int k0, int n0,
                                                      int lane) {
    const int j = lane >> 3;
    std::uint32_t r[4];
    ldmatrix_x4_trans(r, tile + offset(k0 + (lane & 7) + (j & 1) * 8, n0 / 8 + (j >> 1)));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
  }
};

// 2^x by the SFU (ex2.approx.ftz: ~2^-22 relative, 2^-inf = 0), without the
// range fix-ups of exp2f; the softmax arguments are <= 0 or -inf.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Accumulator fragment pairs (n8 tiles 2t and 2t + 1 of an m16 row band) as
// the 16-bit A operand of a k16 step: the register layouts coincide.
template <typename T>
__device__ __forceinline__ void accumulators_to_a(std::uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = Half16<T>::pack(lo[0], lo[1]);
  a[1] = Half16<T>::pack(lo[2], lo[3]);
  a[2] = Half16<T>::pack(hi[0], hi[1]);
  a[3] = Half16<T>::pack(hi[2], hi[3]);
}

}  // namespace stepgraph::kernels::tile
