// Vocabulary-parallel softmax cross-entropy on the device (contract in
// parallel_cross_entropy.h). Per row one block walks the local logits with
// softmax_row.cuh, the same device code as the fused cross_entropy.cu.
//
// Note [Vocabulary-parallel cross-entropy]
// Rank r holds the logits x_r of vocabulary columns [o_r, o_r + V/N). The
// loss of a token with label y is log(sum_j exp(x_j)) - x_y over all V
// columns, computed stably with the global max M = max_r m_r:
//
//   m_r = max of x_r                      (stats; all-reduce max -> M)
//   s_r = sum exp(x_r - m_r)              (stats, online softmax: one pass)
//   S   = sum_r s_r exp(m_r - M)          (rescale; all-reduce sum)
//   t   = sum_r [y in slice r] x_y        (stats; the same all-reduce sum)
//   loss_row = M + log(S) - t,   dx_r = exp(x_r - M) / S - onehot_y
//
// and the mean over the tokens that count, times loss_scale / count for the
// gradient. Every rank gets the same all-reduced M, S and t (a collective
// hands every rank the same bits), so every rank computes the same row losses
// and the same mean: the loss is identical on every rank.
//
// Why s_r is taken against the local max and rescaled, not summed against M
// in a second pass over the logits: one pass over the logits before the
// first collective instead of two, and with one rank (M = m_0, so the rescale
// is skipped: m == M leaves s as it is) the steps are exactly the fused
// kernel's: the same row_softmax_stats gives m and s, t is x_y plus nothing,
// the loss is M + logf(S) - t and the gradient exp2f((x - M) log2e) *
// (scale / S) - scale at y, in the same fp32 operations; the count and the
// mean are the same kernels (cross_entropy_parts). So a world of one rank
// equals ops::cross_entropy bit for bit on cuda. With N ranks S is a sum of N
// partial sums in another order than one rank's: about 1e-7 relative.
//
// A slice whose logits are all -inf (padding) has m_r = -inf: its s_r is 0
// (not the NaN that exp(-inf - -inf) would give) and adds nothing.
// Tokens that do not count (ignore_index, or a label outside [0, V)) get
// (0, 0, 0) from every rank, so the collectives carry no NaN for them; the
// finish zeroes their gradient rows and the count kernel raises the error
// flag for the out-of-range ones.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/cross_entropy_parts.h"
#include "kernels/launch_config.cuh"
#include "kernels/parallel_cross_entropy.h"
#include "kernels/softmax_row.cuh"

namespace stepgraph::kernels {
namespace {

// As cross_entropy.cu: a tile is 64 KB for any dtype, two blocks per SM.
constexpr int kRowThreads = 512;
constexpr int kRowTileVecs = 8;

template <typename T>
using Tiles = RowTiles<T, kRowThreads, kRowTileVecs>;

// True when column `label` is in [offset, offset + vocab_local).
__device__ __forceinline__ bool in_slice(std::int64_t label, std::int64_t offset, std::int64_t vocab_local) {
  return label >= offset && label < offset + vocab_local;
}

template <typename T, typename L>
__global__ void __launch_bounds__(kRowThreads, 2)
    parallel_cross_entropy_stats_kernel(const T* __restrict__ logits, const L* __restrict__ labels,
                                        float* __restrict__ local_max, float* __restrict__ partial,
                                        ParallelCrossEntropyDesc desc) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const std::int64_t label = static_cast<std::int64_t>(labels[row]);
  if (!label_counts(label, desc.vocab, desc.ignore_index)) {  // the same on every rank
    if (threadIdx.x == 0) {
      local_max[row] = 0.0f;
      partial[2 * row] = 0.0f;
      partial[2 * row + 1] = 0.0f;
    }
    return;
  }
  const T* x = logits + row * desc.vocab_local;
  const float target = threadIdx.x == 0 && in_slice(label, desc.vocab_offset, desc.vocab_local)
                           ? to_float(x[label - desc.vocab_offset])
                           : 0.0f;
  Tiles<T> tiles(x, desc.vocab_local);
  const SoftmaxStats stats = row_softmax_stats(tiles, scratch);
  if (threadIdx.x == 0) {
    local_max[row] = stats.max;
    partial[2 * row] = stats.max == -INFINITY ? 0.0f : stats.sum;  // an all -inf slice adds nothing
    partial[2 * row + 1] = target;
  }
}

__global__ void parallel_cross_entropy_rescale_kernel(const float* __restrict__ local_max,
                                                      const float* __restrict__ global_max,
                                                      const float* partial, float* scaled, std::int64_t tokens) {
  grid_stride(tokens, [&](std::int64_t row) {
    const float m = local_max[row];
    const float g = global_max[row];
    const float s = partial[2 * row];
    const float target = partial[2 * row + 1];
    scaled[2 * row] = m == g ? s : s * exp2f((m - g) * kLog2e);
    scaled[2 * row + 1] = target;
  });
}

template <typename T, typename L>
__global__ void __launch_bounds__(kRowThreads, 2)
    parallel_cross_entropy_rows_kernel(const T* __restrict__ logits, const L* __restrict__ labels,
                                       const float* __restrict__ global_max, const float* __restrict__ totals,
                                       T* __restrict__ dlogits, const std::int64_t* __restrict__ count,
                                       float* __restrict__ row_loss, ParallelCrossEntropyDesc desc) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t label = static_cast<std::int64_t>(labels[row]);
  T* dx = dlogits + row * desc.vocab_local;
  if (!label_counts(label, desc.vocab, desc.ignore_index)) {
    zero_row<T, kRowThreads>(dx, desc.vocab_local);
    if (threadIdx.x == 0) row_loss[row] = 0.0f;
    return;
  }
  const float max = global_max[row];
  const float sum = totals[2 * row];
  if (threadIdx.x == 0) row_loss[row] = max + logf(sum) - totals[2 * row + 1];
  // count >= 1 since this row counts.
  const float scale = desc.loss_scale / static_cast<float>(*count);
  Tiles<T> tiles(logits + row * desc.vocab_local, desc.vocab_local);
  write_softmax_grad</*kLastTileLoaded=*/false>(tiles, dx, max, scale / sum, scale, label - desc.vocab_offset);
}

void check_aligned(const void* pointer, std::size_t alignment, const char* what) {
  check_cross_entropy_alignment("parallel_cross_entropy", pointer, alignment, what);
}

}  // namespace

void check_parallel_cross_entropy(const ParallelCrossEntropyDesc& desc) {
  constexpr const char* kOp = "parallel_cross_entropy";
  check_cross_entropy_types_and_sizes(kOp, desc.logits_type, desc.label_type, desc.tokens, desc.vocab);
  SG_CHECK(desc.vocab_local > 0 && desc.vocab_offset >= 0 && desc.vocab_offset <= desc.vocab - desc.vocab_local,
           "parallel_cross_entropy: the local columns [", desc.vocab_offset, ", ",
           desc.vocab_offset + desc.vocab_local, ") must be a non-empty part of the vocabulary [0, ", desc.vocab,
           "); pass this rank's vocab_offset and its logits' width");
  check_cross_entropy_row_width(kOp, "the local vocabulary", desc.logits_type, desc.vocab_local);
  SG_CHECK(std::isfinite(desc.loss_scale), "parallel_cross_entropy: loss_scale must be finite, got ",
           desc.loss_scale);
}

std::size_t parallel_cross_entropy_workspace_bytes(const ParallelCrossEntropyDesc& desc) {
  check_parallel_cross_entropy(desc);
  return CrossEntropyWorkspace::bytes(desc.tokens);
}

void launch_parallel_cross_entropy_stats(const ParallelCrossEntropyDesc& desc, const void* logits, const void* labels,
                                         float* local_max, float* partial, cudaStream_t stream) {
  check_parallel_cross_entropy(desc);
  SG_CHECK(logits != nullptr && labels != nullptr && local_max != nullptr && partial != nullptr,
           "parallel_cross_entropy stats: logits, labels, local_max and partial must not be null");
  check_aligned(logits, 16, "logits");
  check_aligned(labels, dtype_size(desc.label_type), "labels");
  with_row_types(desc.logits_type, desc.label_type, [&]<typename T, typename L>() {
    parallel_cross_entropy_stats_kernel<T, L><<<static_cast<unsigned>(desc.tokens), kRowThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<const L*>(labels), local_max, partial, desc);
    SG_CUDA_CHECK(cudaGetLastError());
  });
}

void launch_parallel_cross_entropy_rescale(std::int64_t tokens, const float* local_max,
                                           const float* global_max, const float* partial, float* scaled,
                                           cudaStream_t stream) {
  SG_CHECK(tokens > 0, "parallel_cross_entropy rescale: tokens must be > 0, got ", tokens);
  SG_CHECK(local_max != nullptr && global_max != nullptr && partial != nullptr && scaled != nullptr,
           "parallel_cross_entropy rescale: local_max, global_max, partial and scaled must not be null");
  parallel_cross_entropy_rescale_kernel<<<blocks_for(tokens), kThreadsPerBlock, 0, stream>>>(
      local_max, global_max, partial, scaled, tokens);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_parallel_cross_entropy_finish(const ParallelCrossEntropyDesc& desc, const void* logits,
                                          const void* labels, const float* global_max, const float* totals,
                                          float* loss, void* dlogits, void* workspace, std::int32_t* error_flag,
                                          cudaStream_t stream) {
  check_parallel_cross_entropy(desc);
  SG_CHECK(logits != nullptr && labels != nullptr && dlogits != nullptr && global_max != nullptr &&
               totals != nullptr,
           "parallel_cross_entropy finish: logits, labels, global_max, totals and dlogits must not be null");
  SG_CHECK(loss != nullptr, "parallel_cross_entropy finish: loss must point to one fp32 on the device");
  SG_CHECK(workspace != nullptr,
           "parallel_cross_entropy finish: workspace is null; allocate parallel_cross_entropy_workspace_bytes(desc)");
  SG_CHECK(error_flag != nullptr,
           "parallel_cross_entropy finish: error_flag is null; pass a zeroed int32 on the device and read it after "
           "the step");
  const CrossEntropyWorkspace scratch =
      start_cross_entropy_rows("parallel_cross_entropy", desc.label_type, logits, labels, dlogits, workspace,
                               desc.tokens, desc.vocab, desc.ignore_index, error_flag, stream);
  with_row_types(desc.logits_type, desc.label_type, [&]<typename T, typename L>() {
    parallel_cross_entropy_rows_kernel<T, L><<<static_cast<unsigned>(desc.tokens), kRowThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<const L*>(labels), global_max, totals, static_cast<T*>(dlogits),
        scratch.count, scratch.row_loss, desc);
    SG_CUDA_CHECK(cudaGetLastError());
  });
  launch_cross_entropy_mean(scratch.row_loss, scratch.count, desc.tokens, loss, stream);
}

}  // namespace stepgraph::kernels
