// LanguageModel: next-token prediction from a fixed window of previous tokens.
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
  ResidualStackConfig model;  // hidden, ffn, layers, vocab, dtype, seed, experts...
  std::int64_t context = 8;   // tokens per example

  std::int64_t embedding_dim() const { return model.hidden / context; }
};

class LanguageModel {
 public:
  struct Saved {
    Embedding::Saved embedding;
    ResidualStack::Saved stack;
  };
  struct Forward {
    Tensor logits;  // [batch, vocab] ([all ranks' batch, vocab / N] tensor-parallel)
    Saved saved;
  };

  // `tensor_parallel`: the stack's (Note [Tensor-parallel ResidualStack]):
  // each rank embeds its own rows of the batch, and the table's gradient is
  // all-reduced across the ranks.
  LanguageModel(Context& ctx, const LanguageModelConfig& config, Communicator* tensor_parallel = nullptr);

  // tokens int32 [batch, context]; error_flag int32 [1], set for a token
  // outside [0, vocab).
  Forward forward(Context& ctx, const Tensor& tokens, const Tensor& error_flag) const;
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
  // parameters() in consecutive groups: the embedding, then the
  // ResidualStack's groups.
  std::vector<std::size_t> parameter_group_sizes();

 private:
  LanguageModelConfig config_;
  Communicator* tp_ = nullptr;
  Embedding embedding_;
  ResidualStack stack_;
};

}  // namespace stepgraph
