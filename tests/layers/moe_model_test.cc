// A ResidualStack with MoE blocks: which blocks are MoE, build-time errors for bad
// expert configurations, and its whole training step (forward, cross-entropy,
// backward, AdamW) captured once and replayed with a new batch every step (so
// the routing and the splits change every replay), equal to the same step run
// eagerly from the same state, bit for bit. Host: 8 steps; GPU: 100.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "graphs/captured_step.h"
#include "optim/adamw.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "tests/layers/train_rig.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::TrainRig;
using testing::bits;

constexpr std::int64_t kTokens = 64;

ResidualStackConfig moe_model(DType dtype) {
  return {.hidden = 64,
          .ffn = 64,
          .layers = 4,
          .vocab = 128,
          .dtype = dtype,
          .seed = 5,
          .experts = 8,
          .topk = 2,
          .moe_every = 2};
}

struct Trainer : TrainRig<ResidualStack> {
  Trainer(Context& ctx, const ResidualStackConfig& config) : TrainRig(ctx, config, kTokens) {}
};

void load_batch(Context& ctx, const TrainStep& step, std::uint32_t seed, const ResidualStackConfig& config) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<std::uint8_t> x(static_cast<std::size_t>(step.inputs().bytes()));
  for (std::int64_t i = 0; i < step.inputs().numel(); ++i) store_from_float(config.dtype, x.data(), i, uniform(rng));
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(config.vocab - 1));
  std::vector<std::int32_t> labels(kTokens);
  for (auto& v : labels) v = label(rng);
  ctx.copy_from_host(step.inputs(), x.data(), x.size());
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
}

void expect_eager_equals_graph(Device device, DType dtype, int steps) {
  Context ctx(device);
  const ResidualStackConfig config = moe_model(dtype);
  Trainer eager(ctx, config);
  Trainer graphed(ctx, config);
  auto captured =
      CapturedStep::capture(ctx, [&] { return graphed.step(ctx); }, {.pool_report_policy = PoolReportPolicy::kError});
  const testing::TestSeed first_seed;  // failures print it
  for (int s = 0; s < steps; ++s) {
    const std::uint32_t seed = first_seed.value() + static_cast<std::uint32_t>(s);  // a new batch every step
    load_batch(ctx, eager.step, seed, config);
    load_batch(ctx, graphed.step, seed, config);
    const std::vector<Tensor> eager_out = eager.step(ctx);
    captured->replay();
    const float eager_loss = ctx.to_vector<float>(eager_out[0]).at(0);
    const float graph_loss = ctx.to_vector<float>(captured->outputs()[0]).at(0);
    ASSERT_EQ(bits(eager_loss), bits(graph_loss))
        << "step " << s << ": eager " << eager_loss << ", graph " << graph_loss;
    ASSERT_TRUE(std::isfinite(graph_loss)) << "step " << s;
    eager.step.check_errors(ctx);
    graphed.step.check_errors(ctx);
  }
  EXPECT_EQ(graphed.optimizer.steps_taken(ctx), steps);
}

TEST(MoEModelHostTest, EveryMoeEveryThBlockIsMoE) {
  Context ctx(Device::kHost);
  ResidualStackConfig config = moe_model(DType::kFloat32);
  config.moe_every = 2;
  ResidualStack model(ctx, config);
  EXPECT_FALSE(model.is_moe_block(0));
  EXPECT_TRUE(model.is_moe_block(1));
  EXPECT_FALSE(model.is_moe_block(2));
  EXPECT_TRUE(model.is_moe_block(3));
  int routers = 0;
  for (Parameter* p : model.parameters()) routers += p->name.find(".router.") != std::string::npos;
  EXPECT_EQ(routers, 2);
  config.moe_every = 1;
  config.experts = 0;
  ResidualStack dense(ctx, config);
  EXPECT_FALSE(dense.is_moe_block(0));
}

TEST(MoEModelHostTest, BadExpertConfigsAreErrorsAtBuildTime) {
  Context ctx(Device::kHost);
  auto expect_error = [&](ResidualStackConfig config, const std::string& needle) {
    try {
      ResidualStack model(ctx, config);
      ADD_FAILURE() << "no Error; expected one mentioning '" << needle << "'";
    } catch (const Error& error) {
      EXPECT_NE(error.message().find(needle), std::string::npos) << error.what();
    }
  };
  ResidualStackConfig c = moe_model(DType::kFloat32);
  c.topk = 3;
  expect_error(c, "topk must be in [1, 2]");
  c = moe_model(DType::kFloat32);
  c.experts = 1;
  c.topk = 2;
  expect_error(c, "must not exceed experts");
  c = moe_model(DType::kFloat32);
  c.moe_every = 0;
  expect_error(c, "moe_every");
  c.moe_every = 5;  // more than layers: no MoE block at all
  expect_error(c, "moe_every");
  c = moe_model(DType::kFloat32);
  c.experts = -2;
  expect_error(c, "experts must be >= 0");
  c = moe_model(DType::kFloat16);  // the grouped GEMM takes bf16 or fp32
  expect_error(c, "not supported");
}

TEST(MoEModelHostTest, TrainStepGraphEqualsEagerWhileRoutingChanges) {
  expect_eager_equals_graph(Device::kHost, DType::kBFloat16, 8);
}

TEST(MoEModelCudaTest, TrainStepGraphEqualsEagerForHundredReplaysWhileRoutingChanges) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph(Device::kCuda, DType::kBFloat16, 100);
}

}  // namespace
}  // namespace stepgraph
