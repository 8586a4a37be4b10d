// The count and mean kernels of the cross-entropies (cross_entropy_parts.h).
#include <cstdint>
#include <limits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/cross_entropy_parts.h"
#include "kernels/reduce.cuh"
#include "kernels/softmax_row.cuh"

namespace stepgraph::kernels {
namespace {

// 1024 threads, each loading kCountBatch labels before counting.
constexpr int kCountThreads = 1024;
constexpr int kCountBatch = 8;
constexpr int kMeanThreads = 1024;

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

}  // namespace

void launch_cross_entropy_count(DType label_type, const void* labels, std::int64_t tokens, std::int64_t vocab,
                                std::int64_t ignore_index, std::int64_t* count, std::int32_t* error_flag,
                                cudaStream_t stream) {
  with_label_type(label_type, [&](auto label_tag) {
    using L = typename decltype(label_tag)::type;
    cross_entropy_count_kernel<L><<<1, kCountThreads, 0, stream>>>(static_cast<const L*>(labels), tokens, vocab,
                                                                    ignore_index, count, error_flag);
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

CrossEntropyWorkspace start_cross_entropy_rows(const char* op, DType label_type, const void* logits, const void* labels,
                                               const void* dlogits, void* workspace, std::int64_t tokens,
                                               std::int64_t vocab, std::int64_t ignore_index, std::int32_t* error_flag,
                                               cudaStream_t stream) {
  check_cross_entropy_alignment(op, logits, 16, "logits");
  check_cross_entropy_alignment(op, dlogits, 16, "dlogits");
  check_cross_entropy_alignment(op, workspace, 16, "workspace");
  check_cross_entropy_alignment(op, labels, dtype_size(label_type), "labels");
  const CrossEntropyWorkspace scratch(workspace);
  launch_cross_entropy_count(label_type, labels, tokens, vocab, ignore_index, scratch.count, error_flag, stream);
  return scratch;
}

void launch_cross_entropy_mean(const float* row_loss, const std::int64_t* count, std::int64_t tokens, float* loss,
                               cudaStream_t stream) {
  cross_entropy_mean_kernel<<<1, kMeanThreads, 0, stream>>>(row_loss, count, tokens, loss);
  SG_CUDA_CHECK(cudaGetLastError());
}

void check_cross_entropy_types_and_sizes(const char* op, DType logits, DType labels, std::int64_t tokens,
                                         std::int64_t vocab) {
  SG_CHECK(logits == DType::kBFloat16 || logits == DType::kFloat16 || logits == DType::kFloat32, op,
           ": logits must be bf16, fp16 or fp32, got ", dtype_name(logits), "; cast the logits before the loss");
  SG_CHECK(labels == DType::kInt32 || labels == DType::kInt64, op, ": labels must be int32 or int64, got ",
           dtype_name(labels));
  constexpr std::int64_t kMax = std::numeric_limits<std::int32_t>::max();
  SG_CHECK(tokens > 0 && tokens <= kMax, op, ": tokens must be in [1, 2^31), got ", tokens);
  SG_CHECK(vocab > 0 && vocab <= kMax, op, ": vocab must be in [1, 2^31), got ", vocab);
}

void check_cross_entropy_row_width(const char* op, const char* what, DType logits, std::int64_t columns) {
  const auto width = static_cast<std::int64_t>(16 / dtype_size(logits));
  SG_CHECK(columns % width == 0, op, ": ", what, " ", columns, " must be a multiple of ", width, " for ",
           dtype_name(logits), " logits (16-byte vectors); pad the vocabulary (padded logits of -inf add nothing)");
}

void check_cross_entropy_alignment(const char* op, const void* pointer, std::size_t alignment, const char* what) {
  SG_CHECK(reinterpret_cast<std::uintptr_t>(pointer) % alignment == 0, op, ": ", what, " at ", pointer, " must be ",
           alignment, "-byte aligned; pass the start of a pool or cudaMalloc allocation");
}

}  // namespace stepgraph::kernels
