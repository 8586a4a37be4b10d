#include "layers/embedding.h"

#include "engine/error.h"
#include "ops/embedding_ops.h"

namespace stepgraph {

Embedding::Embedding(Context& ctx, const std::string& name, const EmbeddingConfig& config, std::uint32_t seed)
    : config_(config) {
  SG_CHECK(config.vocab > 0 && config.dim > 0, "Embedding '", name, "': vocab and dim must be > 0, got ", config.vocab,
           " and ", config.dim);
  // Entries of size ~1, like the normalized activations the blocks produce.
  const Shape shape{config.vocab, config.dim};
  table_ = make_parameter(ctx, name + ".table", shape, config.dtype, uniform_init(shape.numel(), 1.0f, seed));
}

Embedding::Forward Embedding::forward(Context& ctx, const FwdArgs& args) const {
  Forward out;
  out.y = ops::embedding(ctx, table_.value, args.tokens, args.error_flag);
  out.saved = Saved{args.tokens};
  return out;
}

void Embedding::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  ops::embedding_backward_(ctx, table_.grad, args.dy, saved.tokens);
}

}  // namespace stepgraph
