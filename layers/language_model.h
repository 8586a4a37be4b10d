// LanguageModel: next-token prediction, in one of two forms.
//
// The sequence model (config.model.heads > 0, a GPT): sequences of
// `context` tokens each, packed end to end, predict every next token:
//
//   tokens [T, 1] --Embedding (width hidden)--> [T, hidden]
//                 --ResidualStack of TransformerLayers (causal attention over
//                   cu_seqlens' sequences, rotary positions)--> logits [T, vocab]
//
// Tensor-parallel over N ranks, rank r holds its rows [r T/N, (r+1) T/N)
// of the tokens and of the residual stream, and 1/N of every weight:
//
//   tokens [T/N, 1] --vocabulary-parallel Embedding (Note
//                     [Vocabulary-parallel embedding])--> [T/N, hidden]
//                   --ResidualStack (Note [Tensor-parallel ResidualStack])-->
//                     logits [T, vocab / N]
//
// and the window model alike, on its rows [batch / N, context] of examples.
//
// The window model (heads = 0): one prediction per example from a fixed
// window of previous tokens, by MLP blocks over a concatenated embedding:
//
//   tokens [batch, context] --Embedding--> [batch, context * (hidden / context)] = [batch, hidden]
//                           --ResidualStack--> logits [batch, vocab]
//
// Note [Window embedding by concatenation]
// Each example's `context` tokens are embedded (one shared table of width
// hidden / context) and concatenated into one hidden-wide row, which the
// residual blocks of the ResidualStack (residual_stack.h) treat as one
// token's activations. The position of a token in the window is its slice of
// the row, so no position embedding is needed and the first block's fc1 sees
// every (position, token) pair through its own weights: an MLP over the
// window, the exact form a Markov source of order <= context needs. Summing
// position-embedded tokens instead would blur positions together in one
// width. hidden must be a multiple of context.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "layers/embedding.h"
#include "layers/residual_stack.h"

namespace stepgraph {

struct LanguageModelConfig {
  ResidualStackConfig model;  // hidden, ffn, layers, vocab, dtype, seed, experts, heads...
  // Window model: tokens per example. Sequence model: tokens per sequence
  // (the length TrainStep packs its sequences at; any packing runs).
  std::int64_t context = 8;

  bool sequence_model() const { return model.heads > 0; }
  std::int64_t embedding_dim() const { return sequence_model() ? model.hidden : model.hidden / context; }
};

class LanguageModel {
 public:
  struct Saved {
    Embedding::Saved embedding;
    ResidualStack::Saved stack;
  };
  struct Forward {
    Tensor logits;  // [rows, vocab]: rows = batch or T ([all ranks' rows, vocab / N] tensor-parallel)
    Saved saved;
  };

  // `tensor_parallel`: the stack's (Note [Tensor-parallel ResidualStack]);
  // each rank holds its 1/N of the rows, and the embedding is
  // vocabulary-parallel over it (Note [Vocabulary-parallel embedding]; vocab
  // must divide by N), in either form.
  // `context_parallel`: the stack's (Note [Context-parallel ResidualStack]),
  // a sequence model's only; each rank holds its zig-zag tokens and the
  // embedding runs on them as it is.
  // The embedding's seed, for code that builds it alone (the GPT's pipeline
  // stages): the same table as this model's.
  static std::uint32_t embedding_seed(const LanguageModelConfig& config) { return config.model.seed + 104729; }

  // `expert_parallel`: the stack's (Note [Expert-parallel ResidualStack]:
  // this rank's EP group, also under expert x data parallelism); the
  // embedding is replicated, like every non-expert parameter.
  LanguageModel(Context& ctx, const LanguageModelConfig& config, Communicator* tensor_parallel = nullptr,
                Communicator* context_parallel = nullptr, Communicator* expert_parallel = nullptr);

  // Window model: tokens int32 [batch, context]. Sequence model: tokens
  // int32 [T, 1] and cu_seqlens int32 [sequences + 1], the packing
  // (kernels/attention.h); tensor-parallel, tokens are this rank's rows
  // [r T/N, (r+1) T/N) and cu_seqlens the packing of all T. error_flag int32
  // [1], set for a token outside [0, vocab) (on every tensor-parallel rank,
  // whichever rank's rows hold it).
  Forward forward(Context& ctx, const Tensor& tokens, const Tensor& error_flag, const Tensor& cu_seqlens = {}) const;
  // Writes every parameter gradient.
  // `ready` as in ResidualStack::backward, over parameter_group_sizes()' groups.
  void backward(Context& ctx, const Saved& saved, const Tensor& dlogits,
                const ResidualStack::GradientsReady& ready = {}) const;

  // Errors the blocks raise on the device (MoE routing and split sizes): an
  // Error after the step, like ResidualStack::check_errors.
  void check_errors(Context& ctx) const { stack_.check_errors(ctx); }

  const LanguageModelConfig& config() const { return config_; }
  const ResidualStack& stack() const { return stack_; }
  // The embedding table first, then ResidualStack's parameters in its order.
  std::vector<Parameter*> parameters();
  // The stack's expert-parallel expert parameters (empty without EP).
  std::vector<Parameter*> expert_parameters() { return stack_.expert_parameters(); }
  std::vector<StateTensor> state() const { return stack_.state(); }  // FP8 scaling state, for checkpoints
  std::int64_t non_finite_amaxes(Context& ctx) const { return stack_.non_finite_amaxes(ctx); }
  void set_fp8_amax_group(Communicator* group) { stack_.set_fp8_amax_group(group); }
  void set_moe_balance(const MoEBalanceSetup& setup) { stack_.set_moe_balance(setup); }  // the stack's
  // parameters() in consecutive groups: the embedding, then the
  // ResidualStack's groups.
  std::vector<std::size_t> parameter_group_sizes();

 private:
  // Tokens per row of the input: 1 (sequence model) or context (window model).
  std::int64_t token_width() const { return config_.sequence_model() ? 1 : config_.context; }
  const char* rows_name() const { return config_.sequence_model() ? "tokens" : "batch"; }
  int ranks() const { return tp_ != nullptr ? tp_->world_size() : 1; }

  LanguageModelConfig config_;
  Communicator* tp_ = nullptr;
  Embedding embedding_;
  ResidualStack stack_;
};

}  // namespace stepgraph
