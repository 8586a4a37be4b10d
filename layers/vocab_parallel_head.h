// VocabParallelHead: the LM head logits = x W^T (no bias) of a
// tensor-parallel model, with its weight [vocab, hidden] sharded along the
// vocabulary and the tokens outside it sharded along the sequence (Megatron's
// vocabulary-parallel output layer with sequence parallelism):
//
//   forward   x [T/N, hidden]  (this rank's token shard of the final norm's
//             output) -> all-gather -> [T, hidden] -> logits_local [T, V/N]:
//             every token's logits over this rank's vocabulary slice
//             [vocab_offset(), vocab_offset() + V/N).
//   loss      ops::vocab_parallel_cross_entropy over the same communicator
//             (loss() calls it): the logits are never gathered.
//   backward  dlogits_local [T, V/N] -> the weight gradient of the slice
//             (fp32 main grad, on the weight-gradient stream) and
//             d_normed = dlogits_local W_local, a partial sum over the
//             vocabulary, reduce-scattered to this rank's [T/N, hidden].
//
// Rank r holds rows [r V/N, (r+1) V/N) of the weight one rank draws from the
// same seed (Linear's init: uniform in +-1/sqrt(hidden)), so N ranks compute
// what one rank's Linear(hidden -> vocab, no bias) and ops::cross_entropy
// compute, up to the fp32 order of the sums the ranks split (the sum of
// exponentials and d_normed's sum over the vocabulary). It is a
// column-parallel, sequence-parallel Linear (Note [Column- and row-parallel
// Linear]) with the checks and the vocabulary bookkeeping of a head. Without
// a communicator it is the plain bias-free head (a Linear, op for op) and
// loss() is ops::cross_entropy.
//
//   VocabParallelHead head(ctx, "head", {.hidden = 512, .vocab = 32768}, seed, &tp);
//   const VocabParallelHead::Forward f = head.forward(ctx, {normed_shard});
//   const ops::CrossEntropyResult ce = head.loss(ctx, f.logits, labels, error_flag);
//   const Tensor d_normed_shard = head.backward(ctx, f.saved, {ce.dlogits});
//
// Labels are [T] global token ids of every rank's tokens in rank order (rank
// r's shard is rows [r T/N, (r+1) T/N)), the same tensor on every rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/linear.h"
#include "layers/parameter.h"
#include "ops/loss_ops.h"

namespace stepgraph {

struct VocabParallelHeadConfig {
  std::int64_t hidden = 0;
  std::int64_t vocab = 0;  // the whole vocabulary; a multiple of the ranks
  DType dtype = DType::kBFloat16;
};

class VocabParallelHead {
 public:
  struct FwdArgs {
    Tensor x;  // [tokens / N, hidden]: this rank's token shard ([tokens, hidden] without a communicator)
  };
  struct Saved {
    Linear::Saved linear;  // its x: the all-gathered [tokens, hidden] (without a communicator, the caller's x)
  };
  struct Forward {
    Tensor logits;  // [tokens, vocab / N]: every token, this rank's vocabulary slice
    Saved saved;
  };
  struct BwdArgs {
    Tensor dlogits;  // [tokens, vocab / N], like the logits
  };

  // `tensor_parallel`: the group the vocabulary is split across; null is the
  // plain head. vocab must divide by its size, and each rank's slice must be
  // a multiple of the cross-entropy's 16-byte vector (8 bf16/fp16, 4 fp32).
  VocabParallelHead(Context& ctx, const std::string& name, const VocabParallelHeadConfig& config, std::uint32_t seed,
                    Communicator* tensor_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // d x: [tokens / N, hidden] ([tokens, hidden] without a communicator);
  // writes the weight's gradient.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  // The mean softmax cross-entropy of the forward's logits and its gradient
  // (dlogits like the logits): ops::vocab_parallel_cross_entropy over the
  // communicator, ops::cross_entropy without one.
  ops::CrossEntropyResult loss(Context& ctx, const Tensor& logits, const Tensor& labels, const Tensor& error_flag,
                               const ops::CrossEntropyParams& params = {}) const;

  const VocabParallelHeadConfig& config() const { return config_; }
  Communicator* tensor_parallel() const { return tp_; }
  std::int64_t local_vocab() const;   // vocab / N
  std::int64_t vocab_offset() const;  // the global id of this rank's first vocabulary row: rank * vocab / N
  std::vector<Parameter*> parameters() { return linear_.parameters(); }
  const Parameter& weight() const { return linear_.weight(); }  // [vocab / N, hidden]

 private:
  static LinearConfig linear_config(const std::string& label, const VocabParallelHeadConfig& config,
                                    Communicator* tensor_parallel);

  std::string label_;  // "VocabParallelHead 'name'", for argument errors
  VocabParallelHeadConfig config_;
  Communicator* tp_ = nullptr;
  Linear linear_;
};

}  // namespace stepgraph
