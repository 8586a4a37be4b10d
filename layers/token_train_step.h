// TokenTrainStep: one whole training step of a LanguageModel (embedding,
// blocks, head, softmax cross-entropy, backward, AdamW), written once like
// TrainStep (train_step.h): called directly it runs eagerly; passed to
// CapturedStep::capture it becomes one graph, replayed with new tokens bound
// into its persistent inputs.
//
//   TokenTrainStep step(ctx, model, optimizer, batch);
//   auto graph = CapturedStep::capture(ctx, [&] { return step(ctx); });
//   graph->replay({{step.tokens(), tokens}, {step.labels(), labels}});
//   step.check_inputs(ctx);
#pragma once

#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "layers/adamw.h"
#include "layers/language_model.h"

namespace stepgraph {

class TokenTrainStep {
 public:
  // Creates the step inputs (persistent): tokens int32 [batch, context],
  // labels int32 [batch], and the token and label error flags.
  TokenTrainStep(Context& ctx, LanguageModel& model, AdamW& optimizer, std::int64_t batch);

  // One training step; returns {loss} (fp32 scalar, the mean over the batch).
  std::vector<Tensor> operator()(Context& ctx) const;

  const Tensor& tokens() const { return tokens_; }
  const Tensor& labels() const { return labels_; }
  std::int64_t batch() const { return tokens_.shape().dim(0); }
  // Error if any token or label so far was outside [0, vocab), or a block
  // raised an error word (reads device flags: call it after a step, never
  // inside one).
  void check_inputs(Context& ctx) const;

 private:
  LanguageModel& model_;
  AdamW& optimizer_;
  Tensor tokens_;
  Tensor labels_;
  Tensor token_error_;
  Tensor label_error_;
};

}  // namespace stepgraph
