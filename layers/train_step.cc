#include "layers/train_step.h"

#include "engine/error.h"
#include "ops/loss_ops.h"

namespace stepgraph {

TrainStep::TrainStep(Context& ctx, Model& model, AdamW& optimizer, std::int64_t tokens)
    : model_(model), optimizer_(optimizer) {
  SG_CHECK(tokens > 0, "TrainStep: tokens must be > 0, got ", tokens);
  x_ = ctx.persistent("step.x", {Shape{tokens, model.config().hidden}, model.config().dtype});
  labels_ = ctx.persistent("step.labels", {Shape{tokens}, DType::kInt32});
  error_flag_ = ctx.persistent("step.label_error", {Shape{1}, DType::kInt32});
  optimizer.group_for_overlap(ctx, model.parameter_group_sizes());
}

std::vector<Tensor> TrainStep::operator()(Context& ctx) const {
  Model::Forward forward = model_.forward(ctx, x_);
  ops::CrossEntropyResult loss = ops::cross_entropy(ctx, forward.logits, labels_, error_flag_);
  loss.loss.set_name("loss");
  backward_and_update(ctx, optimizer_,
                      [&](const GradientsReady& ready) { model_.backward(ctx, forward.saved, loss.dlogits, ready); });
  return {loss.loss};
}

void TrainStep::check_labels(Context& ctx) const {
  const std::int32_t flag = ctx.to_vector<std::int32_t>(error_flag_).at(0);
  SG_CHECK(flag == 0, "a training label was outside [0, ", model_.config().vocab,
           "): the cross-entropy of those tokens is undefined; check the data");
  model_.check_errors(ctx);  // MoE blocks: routing and split-size error words
}

}  // namespace stepgraph
