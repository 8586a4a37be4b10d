#include "layers/language_model.h"

#include "engine/error.h"

namespace stepgraph {
namespace {

// Checked before any member is built, so a bad config creates no parameter.
const LanguageModelConfig& checked(const LanguageModelConfig& config) {
  SG_CHECK(config.context > 0, "LanguageModel: context must be > 0, got ", config.context);
  SG_CHECK(config.model.hidden > 0 && config.model.hidden % config.context == 0, "LanguageModel: hidden (",
           config.model.hidden, ") must be a positive multiple of context (", config.context,
           "): each of the context tokens gets hidden / context embedding columns");
  return config;
}

}  // namespace

LanguageModel::LanguageModel(Context& ctx, const LanguageModelConfig& config)
    : config_(checked(config)),
      embedding_(ctx, "embedding", EmbeddingConfig{config.model.vocab, config.embedding_dim(), config.model.dtype},
                 config.model.seed + 104729),
      stack_(ctx, config.model) {}

std::vector<Parameter*> LanguageModel::parameters() {
  std::vector<Parameter*> out = embedding_.parameters();
  for (Parameter* p : stack_.parameters()) out.push_back(p);
  return out;
}

LanguageModel::Forward LanguageModel::forward(Context& ctx, const Tensor& tokens, const Tensor& error_flag) const {
  SG_CHECK(tokens.shape().rank() == 2 && tokens.shape().dim(1) == config_.context, "LanguageModel: tokens must be [",
           "batch, ", config_.context, "], got ", tokens.shape());
  Forward out;
  const Embedding::Forward embedded = embedding_.forward(ctx, {tokens, error_flag});
  ResidualStack::Forward stack = stack_.forward(ctx, embedded.y);
  out.logits = stack.logits;
  out.saved = Saved{embedded.saved, std::move(stack.saved)};
  return out;
}

std::vector<std::size_t> LanguageModel::parameter_group_sizes() {
  std::vector<std::size_t> sizes{embedding_.parameters().size()};
  for (const std::size_t size : stack_.parameter_group_sizes()) sizes.push_back(size);
  return sizes;
}

void LanguageModel::backward(Context& ctx, const Saved& saved, const Tensor& dlogits,
                             const ResidualStack::GradientsReady& ready) const {
  ResidualStack::GradientsReady shifted;
  if (ready) shifted = [&](std::size_t group) { ready(group + 1); };
  const Tensor dx = stack_.backward(ctx, saved.stack, dlogits, shifted);
  embedding_.backward(ctx, saved.embedding, {dx});
  if (ready) ready(0);
}

}  // namespace stepgraph
