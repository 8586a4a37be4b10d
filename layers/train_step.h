// TrainStep: one whole training step of a Model (forward, softmax
// cross-entropy, backward, AdamW), written once: called directly it runs
// eagerly; passed to CapturedStep::capture it becomes one graph.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "layers/adamw.h"
#include "layers/model.h"

namespace stepgraph {

class TrainStep {
 public:
  // Creates the step inputs (persistent): activations x [tokens, hidden] in
  // the model dtype, labels [tokens] int32, and the label error flag.
  TrainStep(Context& ctx, Model& model, AdamW& optimizer, std::int64_t tokens);

  // One training step; returns {loss}. The same call runs eager or is traced.
  std::vector<Tensor> operator()(Context& ctx) const;

  const Tensor& inputs() const { return x_; }
  const Tensor& labels() const { return labels_; }
  // Error if any label so far was outside [0, vocab), or an MoE block's
  // routing or split sizes were bad (reads the device flags once: call it
  // after a step, never inside one).
  void check_labels(Context& ctx) const;

 private:
  Model& model_;
  AdamW& optimizer_;
  Tensor x_;
  Tensor labels_;
  Tensor error_flag_;
};

}  // namespace stepgraph
