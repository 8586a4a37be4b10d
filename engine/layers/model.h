// A language-model-shaped stack for training steps: N residual blocks
// h = h + LayerNormMLP(h), a final norm and an LM head (Linear without bias).
// TrainStep (train_step.h) adds the loss and the optimizer.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/context.h"
#include "engine/layers/layernorm_mlp.h"
#include "engine/layers/linear.h"
#include "engine/layers/norm.h"

namespace stepgraph {

struct ModelConfig {
  std::int64_t hidden = 256;
  std::int64_t ffn = 1024;
  std::int64_t layers = 4;
  std::int64_t vocab = 512;
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
  std::uint32_t seed = 1;
  // Mixture of experts: with experts > 0, every moe_every-th block (blocks
  // moe_every-1, 2*moe_every-1, ...) is an MoE MLP routing each token to its
  // top-k experts; the others stay dense LayerNormMLP blocks.
  std::int64_t experts = 0;
  std::int64_t topk = 2;
  std::int64_t moe_every = 2;
};

class Model {
 public:
  struct Saved {
    std::vector<LayerNormMLP::Saved> blocks;
    Norm::Saved final_norm;
    Linear::Saved head;
  };
  struct Forward {
    Tensor logits;  // [tokens, vocab]
    Saved saved;
  };

  Model(Context& ctx, const ModelConfig& config);

  Forward forward(Context& ctx, const Tensor& x) const;  // x: [tokens, hidden]
  // Writes every parameter gradient; returns d loss / d x.
  Tensor backward(Context& ctx, const Saved& saved, const Tensor& dlogits) const;

  const ModelConfig& config() const { return config_; }
  std::vector<Parameter*> parameters();

 private:
  ModelConfig config_;
  std::vector<std::unique_ptr<LayerNormMLP>> blocks_;
  std::unique_ptr<Norm> final_norm_;
  std::unique_ptr<Linear> head_;
};

}  // namespace stepgraph
