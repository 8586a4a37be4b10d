#include "layers/vocab_parallel_head.h"

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "ops/parallel_loss_ops.h"

namespace stepgraph {

LinearConfig VocabParallelHead::linear_config(const std::string& label, const VocabParallelHeadConfig& config,
                                              Communicator* tensor_parallel) {
  SG_CHECK(config.hidden > 0 && config.vocab > 0, label, ": hidden and vocab must be > 0, got ", config.hidden,
           " and ", config.vocab);
  const DType dtype = config.dtype;
  SG_CHECK(dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32, label,
           ": dtype must be bf16, fp16 or fp32 (the cross-entropy's logits), got ", dtype_name(dtype));
  const std::int64_t ranks = tensor_parallel != nullptr ? tensor_parallel->world_size() : 1;
  SG_CHECK(config.vocab % ranks == 0, label, ": vocab ", config.vocab, " must divide by the ", ranks,
           " ranks of ", tensor_parallel != nullptr ? tensor_parallel->describe() : std::string(),
           "; pad the vocabulary to a multiple of ", ranks);
  const auto width = static_cast<std::int64_t>(16 / dtype_size(dtype));
  SG_CHECK((config.vocab / ranks) % width == 0, label, ": each rank's vocabulary slice (", config.vocab, " / ",
           ranks, " = ", config.vocab / ranks, ") must be a multiple of ", width, " for ", dtype_name(dtype),
           " logits (the cross-entropy reads 16-byte vectors); pad the vocabulary to a multiple of ", ranks * width);
  return LinearConfig{.in_features = config.hidden,
                      .out_features = config.vocab,
                      .bias = false,
                      .dtype = dtype,
                      .tensor_parallel = tensor_parallel != nullptr ? TensorParallelMode::kColumn
                                                                    : TensorParallelMode::kNone,
                      .sequence_parallel = tensor_parallel != nullptr};
}

VocabParallelHead::VocabParallelHead(Context& ctx, const std::string& name, const VocabParallelHeadConfig& config,
                                     std::uint32_t seed, Communicator* tensor_parallel)
    : label_(layer_label("VocabParallelHead", name)),
      config_(config),
      tp_(tensor_parallel),
      // Column-parallel rows of the weight one rank draws from `seed`.
      linear_(ctx, name, linear_config(label_, config, tensor_parallel), seed, tensor_parallel) {}

std::int64_t VocabParallelHead::local_vocab() const {
  return config_.vocab / (tp_ != nullptr ? tp_->world_size() : 1);
}

std::int64_t VocabParallelHead::vocab_offset() const { return (tp_ != nullptr ? tp_->rank() : 0) * local_vocab(); }

VocabParallelHead::Forward VocabParallelHead::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "x", args.x, {"tokens", config_.hidden}, config_.dtype,
              tp_ != nullptr ? "this rank's token shard of the normed hidden states" : "the normed hidden states");
  const Linear::Forward f = linear_.forward(ctx, {args.x});
  return Forward{f.y, Saved{f.saved}};
}

Tensor VocabParallelHead::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.linear.x", saved.linear.x, {"tokens", config_.hidden}, config_.dtype,
              "the forward's gathered input");
  check_input(label_, "backward", "dlogits", args.dlogits, {saved.linear.x.shape().dim(0), local_vocab()},
              config_.dtype, "the forward's logits");
  return linear_.backward(ctx, saved.linear, {args.dlogits});
}

ops::CrossEntropyResult VocabParallelHead::loss(Context& ctx, const Tensor& logits, const Tensor& labels,
                                                const Tensor& error_flag, const ops::CrossEntropyParams& params) const {
  check_input(label_, "loss", "logits", logits, {"tokens", local_vocab()}, config_.dtype, "the forward's logits");
  check_input(label_, "loss", "error_flag", error_flag, {1}, DType::kInt32);
  if (tp_ == nullptr) return ops::cross_entropy(ctx, logits, labels, error_flag, params);
  return ops::vocab_parallel_cross_entropy(ctx, *tp_, logits, labels, error_flag, vocab_offset(), params);
}

}  // namespace stepgraph
