// Fused softmax cross-entropy: three kernels on one stream, nothing read back.
//
//   1. count:  one block counts the tokens that count (label in [0, vocab),
//              not ignore_index) into the workspace and raises error_flag for
//              out-of-range labels (cross_entropy_parts.h).
//   2. rows:   one block per token. Pass 1 loads the row with 16-byte vectors
//              into registers, a tile of kRowTileVecs vectors per thread, and
//              folds each vector into a running (max, sum of exp) per thread
//              (online softmax), then one block max and one block sum.
//              Pass 2 walks the tiles backwards: the last tile is still in
//              registers (a 32768-wide bf16 row is one tile, so it is read
//              from memory once); earlier tiles are re-read (from L2). It
//              writes dlogits and the row's loss, logsumexp - logit[label].
//              Both passes are softmax_row.cuh's, shared with the
//              vocabulary-parallel cross-entropy.
//   3. mean:   one block sums the row losses in a fixed order and divides by
//              the count: the loss is bitwise reproducible.
//
// The workspace holds the count and the row losses: see Note [Cross-entropy
// workspace] in cross_entropy_parts.h.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/cross_entropy.h"
#include "kernels/cross_entropy_parts.h"
#include "kernels/softmax_row.cuh"

namespace stepgraph::kernels {
namespace {

// Kernel 2: a tile is kRowThreads * kRowTileVecs vectors = 64 KB for any
// dtype; two blocks per SM (the tile takes 32 registers a thread).
constexpr int kRowThreads = 512;
constexpr int kRowTileVecs = 8;

template <typename T, typename L>
__global__ void __launch_bounds__(kRowThreads, 2)
    cross_entropy_rows_kernel(const T* __restrict__ logits, const L* __restrict__ labels, T* __restrict__ dlogits,
                              const std::int64_t* __restrict__ count, float* __restrict__ row_loss, std::int64_t vocab,
                              std::int64_t ignore_index, float loss_scale) {
  __shared__ float scratch[32];

  const std::int64_t row = blockIdx.x;
  const std::int64_t label = static_cast<std::int64_t>(labels[row]);
  const T* x = logits + row * vocab;
  T* dx = dlogits + row * vocab;

  if (!label_counts(label, vocab, ignore_index)) {  // the same for the whole block
    zero_row<T, kRowThreads>(dx, vocab);
    if (threadIdx.x == 0) row_loss[row] = 0.0f;
    return;
  }
  const float label_logit = threadIdx.x == 0 ? to_float(x[label]) : 0.0f;

  RowTiles<T, kRowThreads, kRowTileVecs> tiles(x, vocab);  // vocab < 2^31 (checked)
  const SoftmaxStats stats = row_softmax_stats(tiles, scratch);
  if (threadIdx.x == 0) row_loss[row] = stats.max + logf(stats.sum) - label_logit;

  // dlogits = (softmax - onehot) * loss_scale / count; count >= 1 since this row counts.
  const float scale = loss_scale / static_cast<float>(*count);
  write_softmax_grad</*kLastTileLoaded=*/true>(tiles, dx, stats.max, scale / stats.sum, scale, label);
}

}  // namespace

void check_cross_entropy(const CrossEntropyDesc& desc) {
  check_cross_entropy_types_and_sizes("cross_entropy", desc.logits_type, desc.label_type, desc.tokens, desc.vocab);
  check_cross_entropy_row_width("cross_entropy", "vocab", desc.logits_type, desc.vocab);
  SG_CHECK(std::isfinite(desc.loss_scale), "cross_entropy: loss_scale must be finite, got ", desc.loss_scale);
}

std::size_t cross_entropy_workspace_bytes(const CrossEntropyDesc& desc) {
  check_cross_entropy(desc);
  return CrossEntropyWorkspace::bytes(desc.tokens);
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
  check_cross_entropy_alignment("cross_entropy", loss, alignof(float), "loss");
  check_cross_entropy_alignment("cross_entropy", error_flag, alignof(std::int32_t), "error_flag");

  const CrossEntropyWorkspace scratch =
      start_cross_entropy_rows("cross_entropy", desc.label_type, logits, labels, dlogits, workspace, desc.tokens,
                               desc.vocab, desc.ignore_index, error_flag, stream);
  with_row_types(desc.logits_type, desc.label_type, [&]<typename T, typename L>() {
    cross_entropy_rows_kernel<T, L><<<static_cast<unsigned>(desc.tokens), kRowThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<const L*>(labels), static_cast<T*>(dlogits), scratch.count,
        scratch.row_loss, desc.vocab, desc.ignore_index, desc.loss_scale);
    SG_CUDA_CHECK(cudaGetLastError());
  });
  launch_cross_entropy_mean(scratch.row_loss, scratch.count, desc.tokens, loss, stream);
}

}  // namespace stepgraph::kernels
