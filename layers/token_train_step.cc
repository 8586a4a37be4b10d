#include "layers/token_train_step.h"

#include "engine/error.h"
#include "ops/loss_ops.h"

namespace stepgraph {

TokenTrainStep::TokenTrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, std::int64_t batch)
    : model_(model), optimizer_(optimizer) {
  SG_CHECK(batch > 0, "TokenTrainStep: batch must be > 0, got ", batch);
  tokens_ = ctx.persistent("step.tokens", {Shape{batch, model.config().context}, DType::kInt32});
  labels_ = ctx.persistent("step.labels", {Shape{batch}, DType::kInt32});
  token_error_ = ctx.persistent("step.token_error", {Shape{1}, DType::kInt32});
  label_error_ = ctx.persistent("step.label_error", {Shape{1}, DType::kInt32});
  optimizer.group_for_overlap(ctx, model.parameter_group_sizes());
}

std::vector<Tensor> TokenTrainStep::operator()(Context& ctx) const {
  LanguageModel::Forward forward = model_.forward(ctx, tokens_, token_error_);
  ops::CrossEntropyResult loss = ops::cross_entropy(ctx, forward.logits, labels_, label_error_);
  loss.loss.set_name("loss");
  backward_and_update(ctx, optimizer_,
                      [&](const GradientsReady& ready) { model_.backward(ctx, forward.saved, loss.dlogits, ready); });
  return {loss.loss};
}

void TokenTrainStep::check_inputs(Context& ctx) const {
  const std::int64_t vocab = model_.config().model.vocab;
  SG_CHECK(ctx.to_vector<std::int32_t>(token_error_).at(0) == 0, "an input token was outside [0, ", vocab,
           "): its embedding does not exist; check the data and --data's vocabulary against the model");
  SG_CHECK(ctx.to_vector<std::int32_t>(label_error_).at(0) == 0, "a training label was outside [0, ", vocab,
           "): the cross-entropy of those tokens is undefined; check the data");
  model_.check_errors(ctx);  // MoE blocks: routing and split-size error words
}

}  // namespace stepgraph
