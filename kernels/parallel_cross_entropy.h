// Vocabulary-parallel softmax cross-entropy (Megatron style): each of N ranks
// holds the logits of its slice of the vocabulary, local logits [tokens,
// vocab_local] of columns [vocab_offset, vocab_offset + vocab_local) of the
// global [tokens, vocab]; labels [tokens] (global ids, the same on every rank)
// are int32 or int64. Three steps, with two all-reduces between them that the
// caller makes (ops/parallel_loss_ops.h does):
//
//   1. stats:   per row, the local max and the local sum of exp(x - local max)
//               (online softmax), and the target logit when the label falls
//               in this slice (else 0).               -> local_max [tokens],
//                                                        partial [tokens, 2]
//      all-reduce max of local_max                    -> global_max
//   2. rescale: the local sum times exp(local max - global max), beside the
//               target logit.                         -> scaled [tokens, 2]
//      all-reduce sum of scaled                       -> totals (sum, target)
//   3. finish:  count the tokens that count (raising error_flag for labels
//               outside [0, vocab) that are not ignore_index), then per row
//               loss = log(sum) + max - target and
//               dlogits_local = (softmax - onehot) * loss_scale / count
//               (rows of tokens that do not count are zero), and the mean
//               loss over the tokens that count.
//
// Nothing is read back to the host: all three steps are capturable. See Note
// [Vocabulary-parallel cross-entropy] in parallel_cross_entropy.cu for the
// math and for why one rank computes the fused cross_entropy's bits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

struct ParallelCrossEntropyDesc {
  DType logits_type = DType::kBFloat16;
  DType label_type = DType::kInt32;
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;         // global
  std::int64_t vocab_local = 0;   // this rank's columns
  std::int64_t vocab_offset = 0;  // the global id of this rank's first column
  std::int64_t ignore_index = -100;
  float loss_scale = 1.0f;
};

// Logits bf16/fp16/fp32, labels int32/int64, tokens and vocab_local > 0,
// tokens and vocab below 2^31, vocab_local a multiple of the 16-byte vector
// width (8 for 16-bit logits, 4 for fp32), [vocab_offset, vocab_offset +
// vocab_local) inside [0, vocab), a finite loss_scale. Throws Error otherwise.
void check_parallel_cross_entropy(const ParallelCrossEntropyDesc& desc);

// Step 3's scratch (Note [Cross-entropy workspace] in cross_entropy_parts.h).
std::size_t parallel_cross_entropy_workspace_bytes(const ParallelCrossEntropyDesc& desc);

// Step 1, one kernel on `stream`. Rows of tokens that do not count get
// (max, sum, target) = (0, 0, 0) on every rank. logits 16-byte aligned.
void launch_parallel_cross_entropy_stats(const ParallelCrossEntropyDesc& desc, const void* logits, const void* labels,
                                         float* local_max, float* partial, cudaStream_t stream);

// Step 2, one kernel on `stream`: scaled may be partial (in place).
void launch_parallel_cross_entropy_rescale(std::int64_t tokens, const float* local_max,
                                           const float* global_max, const float* partial, float* scaled,
                                           cudaStream_t stream);

// Step 3, three kernels on `stream` (count, rows, fixed-order mean). logits,
// dlogits and workspace 16-byte aligned. `error_flag` (int32, device) is
// sticky: set to 1 for a label out of range, never cleared here.
void launch_parallel_cross_entropy_finish(const ParallelCrossEntropyDesc& desc, const void* logits,
                                          const void* labels, const float* global_max, const float* totals,
                                          float* loss, void* dlogits, void* workspace, std::int32_t* error_flag,
                                          cudaStream_t stream);

// Host references: double accumulations inside a step, fp32 between the
// steps (as the all-reduced tensors are), gradients rounded to the logits'
// dtype through fp32. Unlike host::cross_entropy, a bad label does not throw:
// it sets *error_flag as the device does, so a host world reports it after
// the step as cuda ranks do (and tests of the flag run without a GPU).
namespace host {
void parallel_cross_entropy_stats(const ParallelCrossEntropyDesc& desc, const void* logits, const void* labels,
                                  float* local_max, float* partial);
void parallel_cross_entropy_rescale(std::int64_t tokens, const float* local_max,
                                    const float* global_max, const float* partial, float* scaled);
void parallel_cross_entropy_finish(const ParallelCrossEntropyDesc& desc, const void* logits, const void* labels,
                                   const float* global_max, const float* totals, float* loss, void* dlogits,
                                   std::int32_t* error_flag);
}  // namespace host

}  // namespace stepgraph::kernels
