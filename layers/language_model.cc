#include "layers/language_model.h"

#include "engine/error.h"
#include "layers/layer_checks.h"

namespace stepgraph {
namespace {

// Checked before any member is built, so a bad config creates no parameter.
const LanguageModelConfig& checked(const LanguageModelConfig& config, const Communicator* context_parallel) {
  SG_CHECK(config.context > 0, "LanguageModel: context must be > 0, got ", config.context);
  SG_CHECK_CODE(context_parallel == nullptr || config.sequence_model(), ErrorCode::kUnsupported,
                "LanguageModel: context parallelism splits a sequence model's sequences, but this is a window "
                "model (heads = 0); give heads > 0, or leave context parallelism out");
  if (config.sequence_model()) return config;  // the embedding is hidden wide; the blocks check the rest
  SG_CHECK(config.model.hidden > 0 && config.model.hidden % config.context == 0, "LanguageModel: hidden (",
           config.model.hidden, ") must be a positive multiple of context (", config.context,
           "): each of the context tokens gets hidden / context embedding columns");
  return config;
}

}  // namespace

LanguageModel::LanguageModel(Context& ctx, const LanguageModelConfig& config, Communicator* tensor_parallel,
                             Communicator* context_parallel, Communicator* expert_parallel)
    : config_(checked(config, context_parallel)),
      tp_(tensor_parallel),
      embedding_(
          ctx, "embedding",
          EmbeddingConfig{.vocab = config.model.vocab, .dim = config.embedding_dim(), .dtype = config.model.dtype},
          embedding_seed(config), tensor_parallel),
      stack_(ctx, config.model, tensor_parallel, context_parallel, expert_parallel) {}

std::vector<Parameter*> LanguageModel::parameters() {
  std::vector<Parameter*> out = embedding_.parameters();
  for (Parameter* p : stack_.parameters()) out.push_back(p);
  return out;
}

LanguageModel::Forward LanguageModel::forward(Context& ctx, const Tensor& tokens, const Tensor& error_flag,
                                             const Tensor& cu_seqlens) const {
  check_input("LanguageModel", "forward", "tokens", tokens, {rows_name(), token_width()}, DType::kInt32,
              config_.sequence_model() ? "one token per row" : "a window of context tokens per row");
  check_input("LanguageModel", "forward", "error_flag", error_flag, {1}, DType::kInt32);
  Forward out;
  const Embedding::Forward embedded = embedding_.forward(ctx, {tokens, error_flag});
  ResidualStack::Forward stack = stack_.forward(ctx, embedded.y, cu_seqlens);
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
  check_input("LanguageModel", "backward", "saved.embedding.tokens", saved.embedding.tokens, {rows_name(), token_width()},
              DType::kInt32, "the forward's tokens");
  // The logits are every rank's rows, as are the vocabulary-parallel embedding's saved tokens.
  check_input("LanguageModel", "backward", "dlogits", dlogits,
              {saved.embedding.tokens.shape().dim(0), config_.model.vocab / ranks()}, config_.model.dtype,
              "the forward's logits");
  ResidualStack::GradientsReady shifted;
  if (ready) shifted = [&](std::size_t group) { ready(group + 1); };
  const Tensor dx = stack_.backward(ctx, saved.stack, dlogits, shifted);
  embedding_.backward(ctx, saved.embedding, {dx});
  if (ready) ready(0);
}

}  // namespace stepgraph
