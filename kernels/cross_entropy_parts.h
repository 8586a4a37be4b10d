// The parts of a softmax cross-entropy that the fused op (cross_entropy.h)
// and the vocabulary-parallel one (parallel_cross_entropy.h) share: which
// labels count, the token count (raising the error flag), the fixed-order
// mean of the row losses, and the workspace that holds them.
//
// Note [Cross-entropy workspace]
// Offset 0 holds the int64 count of the tokens that count (written by the
// count kernel, read by the rows and mean kernels); offset kRowLossOffset
// holds `tokens` fp32 row losses (written by the rows kernel for every row,
// ignored rows included, read by the mean kernel). Every launch overwrites all
// of it, so it needs no zeroing and may be any scratch memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

// A token counts when its label is in [0, vocab) and is not ignore_index. A
// label that is neither counts nowhere and raises the error flag.
__host__ __device__ inline bool label_counts(std::int64_t label, std::int64_t vocab, std::int64_t ignore_index) {
  return label != ignore_index && label >= 0 && label < vocab;
}

// See Note [Cross-entropy workspace].
struct CrossEntropyWorkspace {
  static constexpr std::size_t kRowLossOffset = 16;
  static std::size_t bytes(std::int64_t tokens) {
    return kRowLossOffset + static_cast<std::size_t>(tokens) * sizeof(float);
  }
  explicit CrossEntropyWorkspace(void* base)
      : count(static_cast<std::int64_t*>(base)),
        row_loss(reinterpret_cast<float*>(static_cast<std::byte*>(base) + kRowLossOffset)) {}

  std::int64_t* count;
  float* row_loss;
};

// One block on `stream`: *count = the tokens whose label counts among labels
// [tokens] (int32 or int64); sets *error_flag to 1 when a label is out of
// range and not ignore_index, and never clears it (sticky).
void launch_cross_entropy_count(DType label_type, const void* labels, std::int64_t tokens, std::int64_t vocab,
                                std::int64_t ignore_index, std::int64_t* count, std::int32_t* error_flag,
                                cudaStream_t stream);

// One block on `stream`: *loss = the sum of row_loss [tokens] in a fixed
// order (bitwise reproducible) divided by *count, or 0 when *count is 0.
void launch_cross_entropy_mean(const float* row_loss, const std::int64_t* count, std::int64_t tokens, float* loss,
                               cudaStream_t stream);

// The checks both cross-entropies share, each Error naming `op`: logits
// bf16, fp16 or fp32, labels int32 or int64, tokens and vocab in [1, 2^31).
void check_cross_entropy_types_and_sizes(const char* op, DType logits, DType labels, std::int64_t tokens,
                                         std::int64_t vocab);
// An Error naming `op` unless a logits row of `columns` (`what`: "vocab",
// "the local vocabulary") is a whole number of 16-byte vectors.
void check_cross_entropy_row_width(const char* op, const char* what, DType logits, std::int64_t columns);

// An Error naming `op` and `what` unless `pointer` is `alignment`-byte aligned.
void check_cross_entropy_alignment(const char* op, const void* pointer, std::size_t alignment, const char* what);

// The start of both cross-entropies' row pass: an Error naming `op` unless
// logits, dlogits and workspace are 16-byte aligned and labels aligned to
// their size; then launch_cross_entropy_count into the workspace, whose
// layout it returns.
CrossEntropyWorkspace start_cross_entropy_rows(const char* op, DType label_type, const void* logits, const void* labels,
                                               const void* dlogits, void* workspace, std::int64_t tokens,
                                               std::int64_t vocab, std::int64_t ignore_index, std::int32_t* error_flag,
                                               cudaStream_t stream);

namespace host {
// Label i of an int32 or int64 array.
std::int64_t load_label(DType dtype, const void* labels, std::int64_t i);
}  // namespace host

}  // namespace stepgraph::kernels
