#include "engine/layers/model.h"

#include <string>

#include "engine/error.h"
#include "engine/ops/activation_ops.h"

namespace stepgraph {

Model::Model(Context& ctx, const ModelConfig& config) : config_(config) {
  SG_CHECK(config.layers >= 0 && config.vocab > 0, "Model: layers must be >= 0 and vocab > 0, got ", config.layers,
           " and ", config.vocab);
  SG_CHECK_CODE(config.experts == 0, ErrorCode::kUnsupported, "Model: MoE blocks (experts = ", config.experts,
                ") are not built yet");
  for (std::int64_t i = 0; i < config.layers; ++i) {
    blocks_.push_back(std::make_unique<LayerNormMLP>(
        ctx, "block" + std::to_string(i),
        LayerNormMLPConfig{config.hidden, config.ffn, config.norm, config.eps, config.dtype},
        config.seed + 16 * static_cast<std::uint32_t>(i)));
  }
  final_norm_ =
      std::make_unique<Norm>(ctx, "final_norm", NormConfig{config.norm, config.hidden, config.eps, config.dtype});
  head_ = std::make_unique<Linear>(
      ctx, "head",
      LinearConfig{.in_features = config.hidden, .out_features = config.vocab, .bias = false, .dtype = config.dtype},
      config.seed + 7919);
}

std::vector<Parameter*> Model::parameters() {
  std::vector<Parameter*> out;
  for (auto& block : blocks_) {
    for (Parameter* p : block->parameters()) out.push_back(p);
  }
  for (Parameter* p : final_norm_->parameters()) out.push_back(p);
  for (Parameter* p : head_->parameters()) out.push_back(p);
  return out;
}

Model::Forward Model::forward(Context& ctx, const Tensor& x) const {
  Forward out;
  Tensor h = x;
  for (const auto& block : blocks_) {
    LayerNormMLP::Forward f = block->forward(ctx, {h});
    h = ops::residual_add(ctx, h, f.y);
    out.saved.blocks.push_back(std::move(f.saved));
  }
  const Norm::Forward normed = final_norm_->forward(ctx, {h});
  const Linear::Forward logits = head_->forward(ctx, {normed.y});
  out.logits = logits.y;
  out.saved.final_norm = normed.saved;
  out.saved.head = logits.saved;
  return out;
}

Tensor Model::backward(Context& ctx, const Saved& saved, const Tensor& dlogits) const {
  const Tensor d_normed = head_->backward(ctx, saved.head, {dlogits});
  Tensor dh = final_norm_->backward(ctx, saved.final_norm, {d_normed});
  for (std::size_t i = blocks_.size(); i-- > 0;) {
    dh = ops::residual_add(ctx, dh, blocks_[i]->backward(ctx, saved.blocks[i], {dh}));
  }
  return dh;
}

}  // namespace stepgraph
