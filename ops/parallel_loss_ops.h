// Vocabulary-parallel softmax cross-entropy for tensor parallelism (Megatron
// style): each rank of the TP communicator holds the logits of its slice of
// the vocabulary, and the loss and the gradient of the local logits come out
// of two all-reduces of per-token statistics ([tokens] max, [tokens, 2] sum
// and target logit), never of the whole logits. See Note
// [Vocabulary-parallel cross-entropy] (kernels/parallel_cross_entropy.cu).
//
//   // logits_local [tokens, vocab / N] of columns [offset, offset + vocab / N)
//   CrossEntropyResult r = ops::vocab_parallel_cross_entropy(ctx, tp, logits_local, labels, flag, offset);
//   // r.loss: the mean loss over all tokens that count, the same on every rank
//   // r.dlogits: [tokens, vocab / N], d loss / d logits_local times loss_scale
//
// Labels [tokens] are the global ids (int32 or int64), the same on every
// rank; ignore_index rows count nowhere and get zero gradients; a label
// outside [0, vocab) that is not ignore_index sets `error_flag` (a persistent
// int32 [1] the caller zeroes and reads after the step) on every rank, on
// cuda and on host alike. Nothing is read back: the call is capturable.
// With a world of one rank the result equals ops::cross_entropy's: bit for
// bit on cuda; on host the sum of exponentials crosses the all-reduce as fp32
// where the fused host reference keeps a double, so the loss and gradients
// differ by fp32 rounding (about 1e-7 relative).
#pragma once

#include <cstdint>
#include <string>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/op.h"
#include "ops/loss_ops.h"

namespace stepgraph::ops {

// `tp`: the communicator whose ranks hold the vocabulary slices, rank r the
// columns [r vocab/N, (r + 1) vocab/N) with vocab = N * logits_local's width;
// `vocab_offset` must be this rank's first column, r * logits_local's width
// (VocabParallelHead::vocab_offset() gives it).
CrossEntropyResult vocab_parallel_cross_entropy(Context& ctx, Communicator& tp, const Tensor& logits_local,
                                                const Tensor& labels, const Tensor& error_flag,
                                                std::int64_t vocab_offset, const CrossEntropyParams& params = {});

// The three steps' ops (kernels/parallel_cross_entropy.h), with these params.
struct VocabParallelCrossEntropyParams {
  std::int64_t vocab = 0;  // global
  std::int64_t vocab_offset = 0;
  std::int64_t ignore_index = -100;
  float loss_scale = 1.0f;  // used by the finish only

  bool operator==(const VocabParallelCrossEntropyParams&) const = default;
  std::string to_string() const;
};

// logits_local, labels -> local_max fp32 [tokens], partial fp32 [tokens, 2]
const OpDef& vocab_parallel_cross_entropy_stats_op();
// local_max, global_max, partial -> scaled fp32 [tokens, 2]
const OpDef& vocab_parallel_cross_entropy_rescale_op();
// logits_local, labels, global_max, totals, error_flag (written) -> loss fp32
// scalar, dlogits like logits_local, workspace
const OpDef& vocab_parallel_cross_entropy_finish_op();

}  // namespace stepgraph::ops
