#include "layers/embedding.h"

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "ops/collective_ops.h"
#include "ops/embedding_ops.h"

namespace stepgraph {
namespace {

// Checked before the table is made, so a bad config creates no parameter.
const EmbeddingConfig& checked(const std::string& label, const EmbeddingConfig& config, Context& ctx,
                               Communicator* vocab_parallel) {
  SG_CHECK(config.vocab > 0 && config.dim > 0, label, ": vocab and dim must be > 0, got ", config.vocab, " and ",
           config.dim);
  if (vocab_parallel != nullptr) {
    vocab_parallel->check_device(ctx.device(), label);
    const int n = vocab_parallel->world_size();
    SG_CHECK(config.vocab % n == 0, label, ": a vocabulary-parallel table splits vocab ", config.vocab, " over the ",
             n, " ranks of ", vocab_parallel->describe(), "; pad the vocabulary to a multiple of ", n);
  }
  return config;
}

}  // namespace

Embedding::Embedding(Context& ctx, const std::string& name, const EmbeddingConfig& config, std::uint32_t seed,
                     Communicator* vocab_parallel)
    : label_(layer_label("Embedding", name)), config_(checked(label_, config, ctx, vocab_parallel)),
      vp_(vocab_parallel) {
  // Entries of size ~1, like the normalized activations the blocks produce;
  // a vocabulary-parallel rank draws its rows of the whole table's values.
  const ParameterInit init = ParameterInit::uniform(1.0f, seed).rows_from(config.vocab, config.dim, vocab_offset());
  table_ = make_parameter(ctx, name + ".table", Shape{local_vocab(), config.dim}, config.dtype, init);
}

std::int64_t Embedding::local_vocab() const { return config_.vocab / ranks(); }

std::int64_t Embedding::vocab_offset() const { return (vp_ != nullptr ? vp_->rank() : 0) * local_vocab(); }

Embedding::Forward Embedding::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "tokens", args.tokens, {"rows", "width"}, DType::kInt32,
              vp_ != nullptr ? "this rank's rows of the tokens" : "");
  check_input(label_, "forward", "error_flag", args.error_flag, {1}, DType::kInt32);
  Forward out;
  if (vp_ == nullptr) {
    out.y = ops::embedding(ctx, table_.value, args.tokens, args.error_flag);
    out.saved = Saved{args.tokens};
    return out;
  }
  // Note [Vocabulary-parallel embedding].
  const Tensor tokens = ops::all_gather(ctx, *vp_, args.tokens);
  const Tensor partial = ops::embedding(ctx, table_.value, tokens, args.error_flag,
                                        {.vocab_offset = vocab_offset(), .vocab = config_.vocab});
  out.y = ops::reduce_scatter(ctx, *vp_, partial, ReduceOp::kSum);
  out.saved = Saved{tokens};
  return out;
}

void Embedding::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.tokens", saved.tokens, {"rows", "width"}, DType::kInt32,
              vp_ != nullptr ? "the forward's gathered tokens" : "the forward's tokens");
  const Shape& tokens = saved.tokens.shape();
  check_input(label_, "backward", "dy", args.dy, {tokens.dim(0) / ranks(), tokens.dim(1) * config_.dim},
              config_.dtype, "the forward's output");
  const Tensor& grad = table_.gradient_for_write(ctx);
  if (vp_ == nullptr) {
    ops::embedding_backward_(ctx, grad, args.dy, saved.tokens);
    return;
  }
  const Tensor dy = ops::all_gather(ctx, *vp_, args.dy);
  ops::embedding_backward_(ctx, grad, dy, saved.tokens, {.vocab_offset = vocab_offset(), .vocab = config_.vocab});
}

}  // namespace stepgraph
