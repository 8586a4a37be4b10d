#include "layers/embedding.h"

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "ops/embedding_ops.h"

namespace stepgraph {

Embedding::Embedding(Context& ctx, const std::string& name, const EmbeddingConfig& config, std::uint32_t seed)
    : label_(layer_label("Embedding", name)), config_(config) {
  SG_CHECK(config.vocab > 0 && config.dim > 0, "Embedding '", name, "': vocab and dim must be > 0, got ", config.vocab,
           " and ", config.dim);
  // Entries of size ~1, like the normalized activations the blocks produce.
  const Shape shape{config.vocab, config.dim};
  table_ = make_parameter(ctx, name + ".table", shape, config.dtype, ParameterInit::uniform(1.0f, seed));
}

Embedding::Forward Embedding::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "tokens", args.tokens, {"rows", "width"}, DType::kInt32);
  check_input(label_, "forward", "error_flag", args.error_flag, {1}, DType::kInt32);
  Forward out;
  out.y = ops::embedding(ctx, table_.value, args.tokens, args.error_flag);
  out.saved = Saved{args.tokens};
  return out;
}

void Embedding::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.tokens", saved.tokens, {"rows", "width"}, DType::kInt32,
              "the forward's tokens");
  const Shape& tokens = saved.tokens.shape();
  check_input(label_, "backward", "dy", args.dy, {tokens.dim(0), tokens.dim(1) * config_.dim}, config_.dtype,
              "the forward's output");
  ops::embedding_backward_(ctx, table_.gradient_for_write(ctx), args.dy, saved.tokens);
}

}  // namespace stepgraph
