// One row of logits in one thread block: the row walked in tiles of 16-byte
// vectors held in registers, its softmax statistics (max and sum of exp) by
// online softmax, and the softmax gradient written from them. Device code
// shared by the fused cross-entropy (cross_entropy.cu) and the vocabulary-
// parallel one (parallel_cross_entropy.cu): the same instructions in both, so
// a parallel cross-entropy over one rank computes the fused one's bits.
//
//   RowTiles<T, kThreads, kTileVecs> tiles(logits + row * vocab, vocab);
//   const SoftmaxStats s = row_softmax_stats(tiles, scratch);      // pass 1
//   write_softmax_grad</*kLastTileLoaded=*/true>(tiles, dx, s.max, scale / s.sum, scale, label);  // pass 2
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <bit>
#include <cmath>
#include <cstdint>

#include "engine/dtype.h"
#include "engine/error.h"
#include "kernels/reduce.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {

// Host side: f(TypeTag<T>{}) for the element type of a row kernel's logits
// (bf16, fp16, fp32) or labels (int32, int64); the caller checked the dtype.
template <typename T>
struct TypeTag {
  using type = T;
};

template <typename F>
void with_logit_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: return f(TypeTag<__nv_bfloat16>{});
    case DType::kFloat16: return f(TypeTag<__half>{});
    case DType::kFloat32: return f(TypeTag<float>{});
    default: SG_THROW(ErrorCode::kInternal, "cross_entropy: logits dtype ", dtype_name(dtype), " passed the checks");
  }
}

template <typename F>
void with_label_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kInt32: return f(TypeTag<std::int32_t>{});
    case DType::kInt64: return f(TypeTag<std::int64_t>{});
    default: SG_THROW(ErrorCode::kInternal, "cross_entropy: label dtype ", dtype_name(dtype), " passed the checks");
  }
}

// f.template operator()<T, L>() with the element types of the logits (T) and
// of the labels (L) of a row kernel.
template <typename F>
void with_row_types(DType logits, DType labels, F&& f) {
  with_label_type(labels, [&](auto label_tag) {
    with_logit_type(logits, [&](auto logit_tag) {
      f.template operator()<typename decltype(logit_tag)::type, typename decltype(label_tag)::type>();
    });
  });
}

inline constexpr float kLog2e = 1.4426950408889634f;

// A row of `vocab` T values (vocab a multiple of Vec16<T>::kCount, below
// 2^31) as tiles of kThreads * kTileVecs vectors; this thread holds vectors
// tile * kVecsPerTile + j * kThreads + threadIdx.x (consecutive threads read
// consecutive 16-byte vectors). A tile is held as 32-bit words and viewed as
// a Vec16 only where used: held as Vec16 of bf16, the compiler splits it into
// 16-bit scalars of one register each and the kernel spills.
template <typename T, int kThreads, int kTileVecs>
class RowTiles {
 public:
  using V = Vec16<T>;
  static constexpr int kCount = V::kCount;
  static constexpr int kVecsPerTile = kThreads * kTileVecs;

  __device__ __forceinline__ RowTiles(const T* row, std::int64_t vocab)
      : row_(row), vecs_(static_cast<int>(vocab / kCount)), tid_(static_cast<int>(threadIdx.x)) {}

  __device__ __forceinline__ int vecs() const { return vecs_; }
  __device__ __forceinline__ int tiles() const { return (vecs_ + kVecsPerTile - 1) / kVecsPerTile; }
  __device__ __forceinline__ int vector_index(int tile, int j) const {
    return tile * kVecsPerTile + j * kThreads + tid_;
  }
  // Loads this thread's vectors of `tile` into registers.
  __device__ __forceinline__ void load(int tile) {
#pragma unroll
    for (int j = 0; j < kTileVecs; ++j) {
      const int v = vector_index(tile, j);
      if (v < vecs_) values_[j] = std::bit_cast<uint4>(load16(row_ + v * kCount));
    }
  }
  // Vector j of the loaded tile, widened to fp32.
  __device__ __forceinline__ void to_float(int j, float (&out)[kCount]) const {
    std::bit_cast<V>(values_[j]).to_float(out);
  }

 private:
  const T* row_;
  int vecs_;
  int tid_;
  uint4 values_[kTileVecs];
};

struct SoftmaxStats {
  float max;  // of the row (-inf for a row of -inf)
  float sum;  // of exp(x - max) over the row
};

// Pass 1, called by every thread of the block: online softmax, folding in one
// vector at a time (its values converted once; a tile's worth of fp32 values
// would not fit in registers), then one block max and one block sum in fixed
// orders. Leaves the last tile in registers. `scratch`: 32 floats of shared
// memory (reduce.cuh).
template <typename T, int kThreads, int kTileVecs>
__device__ __forceinline__ SoftmaxStats row_softmax_stats(RowTiles<T, kThreads, kTileVecs>& row, float* scratch) {
  constexpr int kCount = RowTiles<T, kThreads, kTileVecs>::kCount;
  float thread_max = -INFINITY;
  float thread_sum = 0.0f;
  const int tiles = row.tiles();
  for (int tile = 0; tile < tiles; ++tile) {
    row.load(tile);
#pragma unroll
    for (int j = 0; j < kTileVecs; ++j) {
      if (row.vector_index(tile, j) >= row.vecs()) continue;
      float values[kCount];
      row.to_float(j, values);
      float vector_max = values[0];
#pragma unroll
      for (int k = 1; k < kCount; ++k) vector_max = fmaxf(vector_max, values[k]);
      const float new_max = fmaxf(thread_max, vector_max);
      if (new_max == -INFINITY) continue;  // nothing but -inf so far
      float vector_sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kCount; ++k) vector_sum += exp2f((values[k] - new_max) * kLog2e);
      thread_sum = thread_sum * exp2f((thread_max - new_max) * kLog2e) + vector_sum;
      thread_max = new_max;
    }
  }
  const float row_max = block_max(thread_max, scratch);
  // A thread without values has sum 0 (and max -inf: exp2 gives 0, not NaN).
  const float row_sum = block_sum(thread_sum * exp2f((thread_max - row_max) * kLog2e), scratch);
  return {row_max, row_sum};
}

// Pass 2, called by every thread of the block: dx = exp(x - row_max) *
// softmax_scale, minus `scale` at column `label` of this row (none when
// `label` is outside [0, vocab)). Walks the tiles backwards; with
// kLastTileLoaded the last tile is the one row_softmax_stats left in
// registers (a 32768-wide bf16 row is one tile, read from memory once),
// otherwise every tile is loaded here.
template <bool kLastTileLoaded, typename T, int kThreads, int kTileVecs>
__device__ __forceinline__ void write_softmax_grad(RowTiles<T, kThreads, kTileVecs>& row, T* dx, float row_max,
                                                   float softmax_scale, float scale, std::int64_t label) {
  using V = Vec16<T>;
  constexpr int kCount = V::kCount;
  const int tiles = row.tiles();
  for (int tile = tiles - 1; tile >= 0; --tile) {
    if (!kLastTileLoaded || tile != tiles - 1) row.load(tile);
#pragma unroll
    for (int j = 0; j < kTileVecs; ++j) {
      const int v = row.vector_index(tile, j);
      if (v >= row.vecs()) continue;
      const std::int64_t label_offset = label - static_cast<std::int64_t>(v) * kCount;
      const int label_lane = label_offset >= 0 && label_offset < kCount ? static_cast<int>(label_offset) : -1;
      float grad[kCount];
      row.to_float(j, grad);
#pragma unroll
      for (int k = 0; k < kCount; ++k) {
        grad[k] = exp2f((grad[k] - row_max) * kLog2e) * softmax_scale;
        if (k == label_lane) grad[k] -= scale;
      }
      store16(dx + v * kCount, V::from_float(grad));
    }
  }
}

// Zeroes a row of `vocab` T values (the gradient of a token that does not count).
template <typename T, int kThreads>
__device__ __forceinline__ void zero_row(T* dx, std::int64_t vocab) {
  using V = Vec16<T>;
  constexpr int kCount = V::kCount;
  float zeros[kCount] = {};
  const V zero = V::from_float(zeros);
  const int vecs = static_cast<int>(vocab / kCount);
  for (int v = threadIdx.x; v < vecs; v += kThreads) store16(dx + v * kCount, zero);
}

}  // namespace stepgraph::kernels
