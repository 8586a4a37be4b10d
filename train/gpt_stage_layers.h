// The GPT's pieces (layers/language_model.h) as AnyLayers, so a pipeline of
// layers (LayerPipeline, StagePipeline) can run them as any other:
//
//   TokenEmbeddingLayer   tokens int32 [rows, width] -> [rows, hidden]; no input gradient
//   ResidualBlockLayer    [rows, hidden] -> [rows, hidden]: block i of a ResidualStack
//   NormHeadLayer         [rows, hidden] -> logits [rows, vocab]: the final norm and the head
//   LayerChain            layers run one after another as one layer
//
// Each is built with the names and seeds LanguageModel and ResidualStack give
// the same piece (layers/residual_stack.cc), so a model assembled from them
// holds LanguageModel's parameters, and runs the same ops in the same order:
// language_model_stages.h splits the GPT into pipeline stages this way.
// Each takes the model's tensor-parallel communicator (null: none) as
// LanguageModel does (Note [Tensor-parallel ResidualStack]): x and y are
// then this rank's rows, the embedding and the head vocabulary-parallel.
// Not the rest: no context parallelism, FP8, dropout or MoE blocks
// (ResidualBlockLayer refuses them).
#pragma once

#include <any>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/any_layer.h"
#include "layers/embedding.h"
#include "layers/language_model.h"
#include "layers/layernorm_mlp.h"
#include "layers/multihead_attention.h"
#include "layers/norm.h"
#include "layers/parameter.h"
#include "layers/residual_stack.h"
#include "layers/vocab_parallel_head.h"
#include "ops/loss_ops.h"

namespace stepgraph {

// LanguageModel's embedding ("embedding"): x is the tokens, int32 [rows, 1]
// (sequence model) or [rows, context] (window model); y [rows, hidden].
// Tokens have no gradient: backward returns an undefined tensor, so it must
// be the first layer of a pipeline.
class TokenEmbeddingLayer final : public AnyLayer {
 public:
  // `error_flag`: int32 [1], set for a token outside [0, vocab) (persistent, the caller checks it).
  TokenEmbeddingLayer(Context& ctx, const LanguageModelConfig& config, Tensor error_flag,
                      Communicator* tensor_parallel = nullptr);

  std::string_view kind() const override { return "embedding"; }
  std::pair<Tensor, std::any> forward(Context& ctx, const Tensor& tokens) override;
  Tensor backward(Context& ctx, const std::any& saved, const Tensor& dy) override;
  std::vector<Parameter*> parameters() override { return embedding_.parameters(); }

 private:
  Embedding embedding_;
  Tensor error_flag_;
};

// Block `index` of a ResidualStack of `config` (names "block<index>...",
// ResidualStack's seeds): h + attention(h) with heads > 0, then h + MLP(h);
// its backward adds the residual stream's gradient in each norm's pass, as
// ResidualStack::backward does.
class ResidualBlockLayer final : public AnyLayer {
 public:
  struct Saved {
    std::optional<MultiheadAttention::Saved> attention;
    LayerNormMLP::Saved mlp;
  };
  // `cu_seqlens`: with attention, the packing of every forward's tokens (a
  // persistent int32 [sequences + 1] the caller fills; tensor-parallel, of
  // every rank's rows); undefined without.
  ResidualBlockLayer(Context& ctx, const ResidualStackConfig& config, std::int64_t index, Tensor cu_seqlens,
                     Communicator* tensor_parallel = nullptr);

  std::string_view kind() const override { return "residual_block"; }
  std::pair<Tensor, std::any> forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const std::any& saved, const Tensor& dy) override;
  std::vector<Parameter*> parameters() override;

 private:
  std::unique_ptr<MultiheadAttention> attention_;  // heads > 0
  LayerNormMLP mlp_;
  Tensor cu_seqlens_;
};

// ResidualStack's final norm ("final_norm") and head ("head"): x [rows,
// hidden] -> logits [rows, vocab]; loss() is the stack's loss of the logits.
// Tensor-parallel, the logits are every rank's rows over this rank's
// vocabulary slice, the labels loss() takes every rank's (an all-gather of
// each rank's), and the norm's gradients are all-reduced in the backward.
class NormHeadLayer final : public AnyLayer {
 public:
  struct Saved {
    Norm::Saved norm;
    VocabParallelHead::Saved head;
  };
  NormHeadLayer(Context& ctx, const ResidualStackConfig& config, Communicator* tensor_parallel = nullptr);

  std::string_view kind() const override { return "norm_head"; }
  std::pair<Tensor, std::any> forward(Context& ctx, const Tensor& x) override;
  Tensor backward(Context& ctx, const std::any& saved, const Tensor& dlogits) override;
  std::vector<Parameter*> parameters() override;

  // ResidualStack::loss: the mean cross-entropy of the logits over their rows, and its gradient.
  ops::CrossEntropyResult loss(Context& ctx, const Tensor& logits, const Tensor& labels, const Tensor& error_flag,
                               const ops::CrossEntropyParams& params) const {
    return head_.loss(ctx, logits, labels, error_flag, params);
  }

 private:
  Norm norm_;
  VocabParallelHead head_;
  Communicator* tp_ = nullptr;
};

// Layers run one after another as one layer (the embedding with the first
// stage's first block, say): its saved state is each layer's, its kind the
// layers' kinds joined by '+'.
class LayerChain final : public AnyLayer {
 public:
  explicit LayerChain(std::vector<std::unique_ptr<AnyLayer>> layers);

  std::string_view kind() const override { return kind_; }
  std::pair<Tensor, std::any> forward(Context& ctx, const Tensor& x) override;
  // Only the chain's first layer may return no input gradient.
  Tensor backward(Context& ctx, const std::any& saved, const Tensor& dy) override;
  std::vector<Parameter*> parameters() override;

  const std::vector<std::unique_ptr<AnyLayer>>& layers() const { return layers_; }

 private:
  std::vector<std::unique_ptr<AnyLayer>> layers_;
  std::string kind_;
};

}  // namespace stepgraph
