#include "train/gpt_stage_layers.h"

#include "engine/error.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"

namespace stepgraph {

namespace {

// The names below are ResidualStack's and LanguageModel's; the seeds and
// configs come from them (ResidualStack::block_seed, attention_config, ...),
// so a model assembled from these layers holds the same parameters. The
// pipeline test of the GPT stages compares every gradient with
// LanguageModel's by name, bit for bit.

template <typename S>
const S& saved_as(const std::any& saved, std::string_view kind) {
  const auto* state = std::any_cast<S>(&saved);
  SG_CHECK(state != nullptr, "backward of a ", kind, " layer: the saved state comes from another kind of layer");
  return *state;
}

}  // namespace

TokenEmbeddingLayer::TokenEmbeddingLayer(Context& ctx, const LanguageModelConfig& config, Tensor error_flag,
                                         Communicator* tensor_parallel)
    : embedding_(
          ctx, "embedding",
          EmbeddingConfig{.vocab = config.model.vocab, .dim = config.embedding_dim(), .dtype = config.model.dtype},
          LanguageModel::embedding_seed(config), tensor_parallel),
      error_flag_(std::move(error_flag)) {}

std::pair<Tensor, std::any> TokenEmbeddingLayer::forward(Context& ctx, const Tensor& tokens) {
  Embedding::Forward f = embedding_.forward(ctx, {tokens, error_flag_});
  return {f.y, std::any(std::move(f.saved))};
}

Tensor TokenEmbeddingLayer::backward(Context& ctx, const std::any& saved, const Tensor& dy) {
  embedding_.backward(ctx, saved_as<Embedding::Saved>(saved, kind()), {dy});
  return Tensor{};  // tokens have no gradient
}

ResidualBlockLayer::ResidualBlockLayer(Context& ctx, const ResidualStackConfig& config, std::int64_t index,
                                       Tensor cu_seqlens, Communicator* tensor_parallel)
    : mlp_(ctx, "block" + std::to_string(index), ResidualStack::dense_mlp_config(config),
           ResidualStack::block_seed(config, index), tensor_parallel),
      cu_seqlens_(std::move(cu_seqlens)) {
  // What ResidualStack's block would do differently: refused, not ignored.
  SG_CHECK_CODE(config.experts == 0 && !config.fp8 && config.dropout == 0.0f, ErrorCode::kUnsupported,
                "ResidualBlockLayer: experts (", config.experts, "), fp8 (", config.fp8 ? "on" : "off",
                ") and dropout (", config.dropout,
                ") are not supported in a block on its own yet; set experts = 0, no fp8 and dropout = 0");
  SG_CHECK(cu_seqlens_.defined() == (config.heads > 0), "ResidualBlockLayer: block ", index,
           config.heads > 0 ? " has attention and needs cu_seqlens, the packing of its tokens"
                            : " has no attention (heads = 0); pass no cu_seqlens");
  if (config.heads > 0) {
    // Built after the MLP here, before it in ResidualStack: each draws from its own seed, so the order changes nothing.
    attention_ = std::make_unique<MultiheadAttention>(ctx, "block" + std::to_string(index) + ".attention",
                                                      ResidualStack::attention_config(config),
                                                      ResidualStack::block_seed(config, index) + 8, tensor_parallel);
  }
}

std::pair<Tensor, std::any> ResidualBlockLayer::forward(Context& ctx, const Tensor& x) {
  Saved saved;
  Tensor h = x;
  if (attention_) {
    MultiheadAttention::Forward a = attention_->forward(ctx, {h, cu_seqlens_, std::nullopt});
    h = ops::residual_add(ctx, h, a.y);
    saved.attention = std::move(a.saved);
  }
  LayerNormMLP::Forward f = mlp_.forward(ctx, {h});
  saved.mlp = std::move(f.saved);
  return {ops::residual_add(ctx, h, f.y), std::any(std::move(saved))};
}

Tensor ResidualBlockLayer::backward(Context& ctx, const std::any& saved, const Tensor& dy) {
  const Saved& state = saved_as<Saved>(saved, kind());
  // Each backward returns its dx with the residual stream's gradient added in its norm's pass.
  Tensor dh = mlp_.backward(ctx, state.mlp, {dy, dy});
  if (attention_) {
    SG_CHECK(state.attention.has_value(),
             "backward of a residual_block layer: the block has attention but its "
             "saved state has none");
    dh = attention_->backward(ctx, *state.attention, {dh, dh});
  }
  return dh;
}

std::vector<Parameter*> ResidualBlockLayer::parameters() {
  std::vector<Parameter*> out;
  if (attention_) out = attention_->parameters();
  for (Parameter* p : mlp_.parameters()) out.push_back(p);
  return out;
}

NormHeadLayer::NormHeadLayer(Context& ctx, const ResidualStackConfig& config, Communicator* tensor_parallel)
    : norm_(ctx, "final_norm", ResidualStack::final_norm_config(config)),
      head_(ctx, "head", VocabParallelHeadConfig{.hidden = config.hidden, .vocab = config.vocab, .dtype = config.dtype},
            ResidualStack::head_seed(config), tensor_parallel),
      tp_(tensor_parallel) {}

std::pair<Tensor, std::any> NormHeadLayer::forward(Context& ctx, const Tensor& x) {
  Norm::Forward normed = norm_.forward(ctx, {x});
  VocabParallelHead::Forward logits = head_.forward(ctx, {normed.y});
  return {logits.logits, std::any(Saved{std::move(normed.saved), std::move(logits.saved)})};
}

Tensor NormHeadLayer::backward(Context& ctx, const std::any& saved, const Tensor& dlogits) {
  const Saved& state = saved_as<Saved>(saved, kind());
  const Tensor d_normed = head_.backward(ctx, state.head, {dlogits});
  const Tensor dx = norm_.backward(ctx, state.norm, {d_normed});
  // Its gamma and beta saw only this rank's rows (as in ResidualStack::backward).
  if (tp_ != nullptr) ops::all_reduce_many_(ctx, *tp_, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

std::vector<Parameter*> NormHeadLayer::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Parameter* p : head_.parameters()) out.push_back(p);
  return out;
}

LayerChain::LayerChain(std::vector<std::unique_ptr<AnyLayer>> layers) : layers_(std::move(layers)) {
  SG_CHECK(!layers_.empty(), "LayerChain: the list of layers is empty");
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    SG_CHECK(layers_[i] != nullptr, "LayerChain: layer ", i, " is null");
    if (i > 0) kind_ += "+";
    kind_ += layers_[i]->kind();
  }
}

std::pair<Tensor, std::any> LayerChain::forward(Context& ctx, const Tensor& x) {
  std::vector<std::any> saved;
  Tensor h = x;
  for (const std::unique_ptr<AnyLayer>& layer : layers_) {
    auto [y, state] = layer->forward(ctx, h);
    saved.push_back(std::move(state));
    h = std::move(y);
  }
  return {h, std::any(std::move(saved))};
}

Tensor LayerChain::backward(Context& ctx, const std::any& saved, const Tensor& dy) {
  const auto& states = saved_as<std::vector<std::any>>(saved, kind());
  SG_CHECK(states.size() == layers_.size(), "backward of a ", kind(), " chain: the saved state holds ", states.size(),
           " layer(s), the chain ", layers_.size());
  Tensor grad = dy;
  for (std::size_t i = layers_.size(); i-- > 0;) {
    grad = layers_[i]->backward(ctx, states[i], grad);
    SG_CHECK(grad.defined() || i == 0, "backward of a ", kind(), " chain: layer ", i, " (", layers_[i]->kind(),
             ") returned no input gradient, but layer ", i - 1, " needs one; only the first layer may skip dgrad");
  }
  return grad;
}

std::vector<Parameter*> LayerChain::parameters() {
  std::vector<Parameter*> out;
  for (const std::unique_ptr<AnyLayer>& layer : layers_) {
    for (Parameter* p : layer->parameters()) out.push_back(p);
  }
  return out;
}

}  // namespace stepgraph
