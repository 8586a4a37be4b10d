// Fused softmax cross-entropy: three kernels on one stream, nothing read back.
//
//   1. count:  one block counts the tokens that count (label in [0, vocab),
//              not ignore_index) into the workspace and raises error_flag for
//              out-of-range labels.
//   2. rows:   one block per token. Pass 1 loads the row with 16-byte vectors
//              into registers, a tile of kRowTileVecs vectors per thread, and
//              folds each vector into a running (max, sum of exp) per thread
//              (online softmax), then one block max and one block sum.
//              Pass 2 walks the tiles backwards: the last tile is still in
//              registers (a 32768-wide bf16 row is one tile, so it is read
//              from memory once); earlier tiles are re-read (from L2). It
//              writes dlogits and the row's loss, logsumexp - logit[label].
//   3. mean:   one block sums the row losses in a fixed order and divides by
//              the count: the loss is bitwise reproducible.
//
// Note [Cross-entropy workspace]
// Offset 0 holds the int64 count (written by kernel 1, read by 2 and 3);
// offset kRowLossOffset holds tokens fp32 row losses (written by 2 for every
// row, ignored rows included, read by 3). Every launch overwrites all of it,
// so it needs no zeroing and may be any scratch memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/cross_entropy.h"
#include "kernels/reduce.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr std::size_t kRowLossOffset = 16;

// Kernel 1: 1024 threads, each loading kCountBatch labels before counting.
constexpr int kCountThreads = 1024;
constexpr int kCountBatch = 8;
// Kernel 2: a tile is kRowThreads * kRowTileVecs vectors = 64 KB for any
// dtype; two blocks per SM (the tile takes 32 registers a thread).
constexpr int kRowThreads = 512;
constexpr int kRowTileVecs = 8;
// Kernel 3.
constexpr int kMeanThreads = 1024;

constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<T>{}) for the logits' element type.
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

__device__ __forceinline__ bool label_counts(std::int64_t label, std::int64_t vocab, std::int64_t ignore_index) {
  return label != ignore_index && label >= 0 && label < vocab;
}

template <typename L>
__global__ void __launch_bounds__(kCountThreads)
    cross_entropy_count_kernel(const L* __restrict__ labels, std::int64_t tokens, std::int64_t vocab,
                               std::int64_t ignore_index, std::int64_t* __restrict__ count,
                               std::int32_t* __restrict__ error_flag) {
  std::int64_t counted = 0;
  int out_of_range = 0;
  for (std::int64_t base = 0; base < tokens; base += kCountThreads * kCountBatch) {
    std::int64_t label[kCountBatch];
#pragma unroll
    for (int b = 0; b < kCountBatch; ++b) {
      const std::int64_t i = base + b * kCountThreads + threadIdx.x;
      label[b] = i < tokens ? static_cast<std::int64_t>(labels[i]) : ignore_index;  // past the end: ignored
    }
#pragma unroll
    for (int b = 0; b < kCountBatch; ++b) {
      const bool counts = label_counts(label[b], vocab, ignore_index);
      counted += __syncthreads_count(counts);  // exact, fixed: the whole block's count
      out_of_range |= !counts && label[b] != ignore_index;
    }
  }
  const bool any_out_of_range = __syncthreads_or(out_of_range) != 0;
  if (threadIdx.x == 0) {
    *count = counted;
    if (any_out_of_range) *error_flag = 1;  // sticky: never cleared here
  }
}

template <typename T, typename L>
__global__ void __launch_bounds__(kRowThreads, 2)
    cross_entropy_rows_kernel(const T* __restrict__ logits, const L* __restrict__ labels, T* __restrict__ dlogits,
                              const std::int64_t* __restrict__ count, float* __restrict__ row_loss, std::int64_t vocab,
                              std::int64_t ignore_index, float loss_scale) {
  using V = Vec16<T>;
  constexpr int kCount = V::kCount;
  constexpr int kTileVecs = kRowThreads * kRowTileVecs;
  __shared__ float scratch[32];

  const std::int64_t row = blockIdx.x;
  const std::int64_t label = static_cast<std::int64_t>(labels[row]);
  const T* x = logits + row * vocab;
  T* dx = dlogits + row * vocab;
  const int vecs = static_cast<int>(vocab / kCount);  // vocab < 2^31 (checked)
  const int tid = threadIdx.x;

  if (!label_counts(label, vocab, ignore_index)) {  // the same for the whole block
    float zeros[kCount] = {};
    const V zero = V::from_float(zeros);
    for (int v = tid; v < vecs; v += kRowThreads) store16(dx + v * kCount, zero);
    if (tid == 0) row_loss[row] = 0.0f;
    return;
  }
  const float label_logit = tid == 0 ? to_float(x[label]) : 0.0f;

  // Vector j of a tile is at tile * kTileVecs + j * kRowThreads + tid:
  // consecutive threads read consecutive 16-byte vectors. The tile is held
  // as 32-bit words and viewed as a Vec16 only where used: held as Vec16 of
  // bf16, the compiler splits it into 64 16-bit scalars of one register each
  // and the kernel spills (112 registers wanted, 64 allowed).
  uint4 tile_values[kRowTileVecs];
  const auto vector_index = [&](int tile, int j) { return tile * kTileVecs + j * kRowThreads + tid; };
  const auto load_tile = [&](int tile) {
#pragma unroll
    for (int j = 0; j < kRowTileVecs; ++j) {
      const int v = vector_index(tile, j);
      if (v < vecs) tile_values[j] = std::bit_cast<uint4>(load16(x + v * kCount));
    }
  };
  const int tiles = (vecs + kTileVecs - 1) / kTileVecs;

  // Pass 1: online softmax, folding in one vector at a time (its values are
  // converted once; a tile's worth of fp32 values would not fit in registers).
  float thread_max = -INFINITY;
  float thread_sum = 0.0f;
  for (int tile = 0; tile < tiles; ++tile) {
    load_tile(tile);
#pragma unroll
    for (int j = 0; j < kRowTileVecs; ++j) {
      if (vector_index(tile, j) >= vecs) continue;
      float values[kCount];
      std::bit_cast<V>(tile_values[j]).to_float(values);
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
  if (tid == 0) row_loss[row] = row_max + logf(row_sum) - label_logit;

  // Pass 2: dlogits = (softmax - onehot) * loss_scale / count; count >= 1
  // since this row counts.
  const float scale = loss_scale / static_cast<float>(*count);
  const float softmax_scale = scale / row_sum;
  for (int tile = tiles - 1; tile >= 0; --tile) {
    if (tile != tiles - 1) load_tile(tile);
#pragma unroll
    for (int j = 0; j < kRowTileVecs; ++j) {
      const int v = vector_index(tile, j);
      if (v >= vecs) continue;
      const std::int64_t label_offset = label - static_cast<std::int64_t>(v) * kCount;
      const int label_lane = label_offset >= 0 && label_offset < kCount ? static_cast<int>(label_offset) : -1;
      float grad[kCount];
      std::bit_cast<V>(tile_values[j]).to_float(grad);
#pragma unroll
      for (int k = 0; k < kCount; ++k) {
        grad[k] = exp2f((grad[k] - row_max) * kLog2e) * softmax_scale;
        if (k == label_lane) grad[k] -= scale;
      }
      store16(dx + v * kCount, V::from_float(grad));
    }
  }
}

__global__ void __launch_bounds__(kMeanThreads)
    cross_entropy_mean_kernel(const float* __restrict__ row_loss, const std::int64_t* __restrict__ count,
                              std::int64_t tokens, float* __restrict__ loss) {
  __shared__ float scratch[32];
  // Thread t sums rows t, t + 1024, ... in order; then block_sum's fixed tree.
  float partial = 0.0f;
#pragma unroll 8
  for (std::int64_t i = threadIdx.x; i < tokens; i += kMeanThreads) partial += row_loss[i];
  const float total = block_sum(partial, scratch);
  if (threadIdx.x == 0) {
    const std::int64_t counted = *count;
    *loss = counted > 0 ? total / static_cast<float>(counted) : 0.0f;
  }
}

void check_aligned(const void* pointer, std::size_t alignment, const char* what) {
  SG_CHECK(reinterpret_cast<std::uintptr_t>(pointer) % alignment == 0, "cross_entropy: ", what, " at ", pointer,
           " must be ", alignment, "-byte aligned; pass the start of a pool or cudaMalloc allocation");
}

}  // namespace

void check_cross_entropy(const CrossEntropyDesc& desc) {
  const DType logits = desc.logits_type;
  SG_CHECK(logits == DType::kBFloat16 || logits == DType::kFloat16 || logits == DType::kFloat32,
           "cross_entropy: logits must be bf16, fp16 or fp32, got ", dtype_name(logits),
           "; cast the logits before the loss");
  SG_CHECK(desc.label_type == DType::kInt32 || desc.label_type == DType::kInt64,
           "cross_entropy: labels must be int32 or int64, got ", dtype_name(desc.label_type));
  constexpr std::int64_t kMax = std::numeric_limits<std::int32_t>::max();
  SG_CHECK(desc.tokens > 0 && desc.tokens <= kMax, "cross_entropy: tokens must be in [1, 2^31), got ", desc.tokens);
  SG_CHECK(desc.vocab > 0 && desc.vocab <= kMax, "cross_entropy: vocab must be in [1, 2^31), got ", desc.vocab);
  const auto width = static_cast<std::int64_t>(16 / dtype_size(logits));
  SG_CHECK(desc.vocab % width == 0, "cross_entropy: vocab ", desc.vocab, " must be a multiple of ", width, " for ",
           dtype_name(logits), " logits (16-byte vectors); pad the vocabulary (padded logits of -inf add nothing)");
  SG_CHECK(std::isfinite(desc.loss_scale), "cross_entropy: loss_scale must be finite, got ", desc.loss_scale);
}

std::size_t cross_entropy_workspace_bytes(const CrossEntropyDesc& desc) {
  check_cross_entropy(desc);
  return kRowLossOffset + static_cast<std::size_t>(desc.tokens) * sizeof(float);
}

void launch_cross_entropy(const CrossEntropyDesc& desc, const void* logits, const void* labels, float* loss,
                          void* dlogits, void* workspace, std::int32_t* error_flag, cudaStream_t stream) {
  check_cross_entropy(desc);
  SG_CHECK(logits != nullptr && labels != nullptr && dlogits != nullptr,
           "cross_entropy: logits, labels and dlogits must not be null (", desc.tokens, " x ", desc.vocab, ")");
  SG_CHECK(loss != nullptr, "cross_entropy: loss must point to one fp32 on the device");
  SG_CHECK(workspace != nullptr, "cross_entropy: workspace is null; allocate cross_entropy_workspace_bytes(desc)");
  SG_CHECK(error_flag != nullptr,
           "cross_entropy: error_flag is null; pass a zeroed int32 on the device and read it after the step");
  check_aligned(logits, 16, "logits");
  check_aligned(dlogits, 16, "dlogits");
  check_aligned(workspace, 16, "workspace");
  check_aligned(labels, dtype_size(desc.label_type), "labels");
  check_aligned(loss, alignof(float), "loss");
  check_aligned(error_flag, alignof(std::int32_t), "error_flag");

  auto* count = static_cast<std::int64_t*>(workspace);
  auto* row_loss = reinterpret_cast<float*>(static_cast<std::byte*>(workspace) + kRowLossOffset);
  with_label_type(desc.label_type, [&](auto label_tag) {
    using L = typename decltype(label_tag)::type;
    const auto* typed_labels = static_cast<const L*>(labels);
    cross_entropy_count_kernel<L>
        <<<1, kCountThreads, 0, stream>>>(typed_labels, desc.tokens, desc.vocab, desc.ignore_index, count, error_flag);
    SG_CUDA_CHECK(cudaGetLastError());
    with_logit_type(desc.logits_type, [&](auto logit_tag) {
      using T = typename decltype(logit_tag)::type;
      cross_entropy_rows_kernel<T, L><<<static_cast<unsigned>(desc.tokens), kRowThreads, 0, stream>>>(
          static_cast<const T*>(logits), typed_labels, static_cast<T*>(dlogits), count, row_loss, desc.vocab,
          desc.ignore_index, desc.loss_scale);
      SG_CUDA_CHECK(cudaGetLastError());
    });
  });
  cross_entropy_mean_kernel<<<1, kMeanThreads, 0, stream>>>(row_loss, count, desc.tokens, loss);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
