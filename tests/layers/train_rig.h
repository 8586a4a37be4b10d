// What the tests that train one model eagerly and one graphed, side by side,
// share: a model with its optimizer and step (all persistent in one
// context), and the bit-for-bit comparison of one step's losses.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "optim/adamw.h"
#include "train/train_step.h"

namespace stepgraph::testing {

inline std::uint32_t bits(float value) {
  std::uint32_t out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

// A model M (ResidualStack or LanguageModel) with AdamW (lr 1e-2) and its
// TrainStep over `rows` (tokens or batch).
template <typename M>
struct TrainRig {
  template <typename Config>
  TrainRig(Context& ctx, const Config& config, std::int64_t rows)
      : model(ctx, config), optimizer(ctx, model.parameters(), {.lr = 1e-2f}), step(ctx, model, optimizer, rows) {}
  M model;
  AdamW optimizer;
  TrainStep step;
};

// Runs one eager step of `eager` against one replay of `graph` (captured
// from the other rig, whose inputs the caller loaded), checks their inputs'
// error flags, and returns the graph's loss; the two losses must be
// bit-identical (a failure names `step`).
template <typename M>
float expect_same_step(Context& ctx, TrainRig<M>& eager, TrainRig<M>& graphed, CapturedStep& graph, int step,
                       std::span<const InputBinding> bindings = {}) {
  const std::vector<Tensor> eager_out = eager.step(ctx);
  graph.replay(bindings);
  const float eager_loss = ctx.to_vector<float>(eager_out[0]).at(0);
  const float graph_loss = ctx.to_vector<float>(graph.outputs()[0]).at(0);
  EXPECT_EQ(bits(eager_loss), bits(graph_loss))
      << "step " << step << ": eager " << eager_loss << ", graph " << graph_loss;
  eager.step.check_errors(ctx);
  graphed.step.check_errors(ctx);
  return graph_loss;
}

// After `steps` such steps: both optimizers stepped that often, and training
// on the batches reduced the loss.
template <typename M>
void expect_trained_alike(Context& ctx, TrainRig<M>& eager, TrainRig<M>& graphed, const std::vector<float>& losses,
                          int steps) {
  EXPECT_EQ(eager.optimizer.steps_taken(ctx), steps);
  EXPECT_EQ(graphed.optimizer.steps_taken(ctx), steps);
  ASSERT_FALSE(losses.empty());
  EXPECT_LT(losses.back(), losses.front()) << "training on the test's batches did not reduce the loss";
}

}  // namespace stepgraph::testing
