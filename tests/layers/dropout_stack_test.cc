// Dropout in a ResidualStack (Note [Dropout in a captured step]): the
// backward is the gradient of the forward it follows (central differences,
// host, fp32, the generator's state restored before each evaluation), a
// captured step equals eager execution bit for bit while the masks change
// every step, and p = 0 adds no op.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/half_precision.h"
#include "graphs/captured_step.h"
#include "kernels/dropout.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "tests/layers/gradient_check.h"
#include "tests/layers/train_rig.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"

namespace stepgraph {
namespace {

TEST(DropoutStackTest, BackwardIsTheGradientOfTheDroppedForward) {
  Context ctx(Device::kHost);
  testing::GradientCheck check(ctx);
  constexpr std::int64_t kTokens = 8;
  const ResidualStackConfig config{.hidden = 8, .ffn = 16, .layers = 2, .vocab = 8, .dtype = DType::kFloat32,
                                   .seed = 3, .dropout = 0.3f};
  ResidualStack stack(ctx, config);
  const Tensor x = check.random_tensor("x", Shape{kTokens, config.hidden});
  const std::vector<std::int64_t> state = ctx.to_vector<std::int64_t>(stack.rng_state());
  auto run_forward = [&] {  // the same masks at every evaluation
    ctx.copy_from_host(stack.rng_state(), state.data(), state.size() * sizeof(std::int64_t));
    return stack.forward(ctx, x);
  };
  auto forward = [&] { return run_forward().logits; };
  const std::vector<float> r = check.random_values(kTokens * config.vocab);
  Tensor dlogits = ctx.persistent("dlogits", {Shape{kTokens, config.vocab}, DType::kFloat32});
  ctx.copy_from_host(dlogits, r.data(), r.size() * sizeof(float));
  const ResidualStack::Forward f = run_forward();
  const Tensor dx = stack.backward(ctx, f.saved, dlogits);
  EXPECT_EQ(ctx.to_vector<std::int64_t>(stack.rng_state())[1],
            state[1] + 5 * kernels::dropout_draws(kTokens * config.hidden));  // 5 sites, then the counter moves on
  check.expect_matches("dx", x, ctx.to_vector<float>(dx), forward, r);
  Parameter* w = stack.parameters().front();
  check.expect_matches(w->name, w->master, ctx.to_vector<float>(w->grad), forward, r);
}

constexpr std::int64_t kTokens = 64;

void load_batch(Context& ctx, const TrainStep& step, std::int64_t hidden, std::int64_t vocab) {
  std::mt19937 rng(9);  // the same batch every step: only the masks change
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(kTokens * hidden));
  for (auto& v : x) v = float_to_bf16(uniform(rng));
  std::vector<std::int32_t> labels(kTokens);
  for (auto& v : labels) v = static_cast<std::int32_t>(rng() % vocab);
  ctx.copy_from_host(step.inputs(), x.data(), x.size() * sizeof(std::uint16_t));
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
}

void expect_eager_equals_graph_with_dropout(Device device, std::int64_t heads) {
  Context ctx(device);
  const ResidualStackConfig config{.hidden = 64, .ffn = 256, .layers = 2, .vocab = 128, .dtype = DType::kBFloat16,
                                   .seed = 5, .heads = heads, .dropout = 0.1f};
  testing::TrainRig<ResidualStack> eager(ctx, config, kTokens), graphed(ctx, config, kTokens);
  auto captured = CapturedStep::capture(ctx, [&] { return graphed.step(ctx); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
  std::vector<float> losses;
  for (int s = 0; s < 6; ++s) {
    load_batch(ctx, eager.step, config.hidden, config.vocab);
    load_batch(ctx, graphed.step, config.hidden, config.vocab);
    losses.push_back(testing::expect_same_step<ResidualStack>(ctx, eager, graphed, *captured, s));
  }
  EXPECT_EQ(ctx.to_vector<std::int64_t>(eager.model.rng_state()),
            ctx.to_vector<std::int64_t>(graphed.model.rng_state()));
  // One batch, six steps: new masks each time (and training), never a repeated loss.
  for (std::size_t i = 1; i < losses.size(); ++i) EXPECT_NE(losses[i], losses[i - 1]) << "step " << i;
}

TEST(DropoutStackTest, EagerEqualsGraphBitForBitWhileTheMasksChangeOnTheHost) {
  expect_eager_equals_graph_with_dropout(Device::kHost, 0);
  expect_eager_equals_graph_with_dropout(Device::kHost, 2);
}

TEST(DropoutStackTest, EagerEqualsGraphBitForBitWhileTheMasksChangeOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph_with_dropout(Device::kCuda, 0);
  expect_eager_equals_graph_with_dropout(Device::kCuda, 2);
}

TEST(DropoutStackTest, NoDropoutAddsNoOpAndBadProbabilitiesAreErrors) {
  Context ctx(Device::kHost);
  ResidualStackConfig config{.hidden = 64, .ffn = 256, .layers = 2, .vocab = 128, .dtype = DType::kBFloat16};
  testing::TrainRig<ResidualStack> rig(ctx, config, kTokens);
  EXPECT_FALSE(rig.model.rng_state().defined());
  auto captured = CapturedStep::capture(ctx, [&] { return rig.step(ctx); });
  for (const Instruction& instruction : captured->program().instructions()) {
    EXPECT_NE(instruction.op->name, "dropout");
  }
  config.dropout = 1.0f;
  EXPECT_ERROR_CONTAINS(ResidualStack(ctx, config), "dropout must be in [0, 1)");
}

}  // namespace
}  // namespace stepgraph
