// Device helpers of the attention kernels (attention_*.cu): where a block's
// rows lie in a packed batch (read from the device cu_seqlens, made safe), the
// 16-bit element types' conversions, and softmax probabilities handed from
// wgmma accumulators to wgmma's register A operand.
//
// Note [Safe cu_seqlens]
// A kernel reads cu_seqlens as
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

#include "engine/dtype.h"
#include "engine/error.h"
#include "kernels/safe_offsets.cuh"

namespace stepgraph::kernels::tile {

// Rows [first, first + rows_per_tile) of sequence `index`, [begin, end), clipped to end.
struct SequenceTile {
  int begin = 0;
  int end = 0;
  int first = 0;
  int index = 0;
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
      out->index = s0 + owner;
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

// The keys a block's queries read (Note [Segment attention] in
// kernels/attention.h): [begin, end), and the shift of the causal diagonal,
// bottom-right aligned: query row r (a token index) sees keys k <= r + shift.
// Self-attention (kv_ranges null): the sequence's own tokens, shift 0.
// Segment attention: the segment's range in kv_ranges [G, 2], clamped into
// [0, kv_tokens) as the plain kernels clamp it; shift = end - the segment's
// query end, so its last query sees the whole range.
struct KeyRange {
  int begin = 0;
  int end = 0;
  int shift = 0;
};

// Segment `segment` (queries ending at q_end) of a non-null kv_ranges.
__device__ __forceinline__ KeyRange segment_keys(const std::int32_t* kv_ranges, int kv_tokens, int segment, int q_end) {
  const int begin = clamp_to(kv_ranges[2 * static_cast<std::int64_t>(segment)], 0, kv_tokens);
  const int end = clamp_to(kv_ranges[2 * static_cast<std::int64_t>(segment) + 1], begin, kv_tokens);
  return {begin, end, end - q_end};
}

// The keys of the queries of `seq` (kv_ranges null: the sequence itself).
__device__ __forceinline__ KeyRange sequence_keys(const std::int32_t* kv_ranges, int kv_tokens,
                                                  const SequenceTile& seq) {
  if (kv_ranges == nullptr) return {seq.begin, seq.end, 0};
  return segment_keys(kv_ranges, kv_tokens, seq.index, seq.end);
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
};

template <>
struct Half16<__half> {
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
};

// Host side: calls run.template operator()<T, D>() with the element type and
// head dim of a tensor-core attention shape (bf16 or fp16, head_dim 64 or
// 128); an Error naming `kernel` for any other shape.
template <typename Run>
void dispatch_tensor_core_shape(DType dtype, std::int64_t head_dim, const char* kernel, Run&& run) {
  const bool bf16 = dtype == DType::kBFloat16;
  SG_CHECK(bf16 || dtype == DType::kFloat16, "attention: the tensor-core ", kernel, " takes bf16 or fp16");
  SG_CHECK(head_dim == 64 || head_dim == 128, "attention: the tensor-core ", kernel, " takes head_dim 64 or 128");
  if (head_dim == 64) {
    bf16 ? run.template operator()<__nv_bfloat16, 64>() : run.template operator()<__half, 64>();
  } else {
    bf16 ? run.template operator()<__nv_bfloat16, 128>() : run.template operator()<__half, 128>();
  }
}

// 2^x by the SFU (ex2.approx.ftz: ~2^-22 relative, 2^-inf = 0), without the
// range fix-ups of exp2f; the softmax arguments are <= 0 or -inf.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Accumulators (wgmma's layout, kernels/tile/wgmma_ops.cuh) as the 16-bit
// register A operand of k16 step `k16` along their columns: the layouts
// coincide, so each pair of neighbours packs into one register.
template <typename T, int kCount>
__device__ __forceinline__ void accumulators_to_a(std::uint32_t (&a)[4], const float (&acc)[kCount], int k16) {
  const float* c = acc + 8 * k16;
  a[0] = Half16<T>::pack(c[0], c[1]);
  a[1] = Half16<T>::pack(c[2], c[3]);
  a[2] = Half16<T>::pack(c[4], c[5]);
  a[3] = Half16<T>::pack(c[6], c[7]);
}

// Keeps registers that an asynchronous wgmma reads (its register A operand)
// alive and unmoved until this point, the wait that ends the read.
template <int kRows, int kCols>
__device__ __forceinline__ void fence_registers(std::uint32_t (&r)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

}  // namespace stepgraph::kernels::tile
