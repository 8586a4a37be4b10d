// fp16's dynamic loss scaling (Note [Loss scaling] in kernels/step_guard.h):
// the rule that backs the scale off on an overflow and grows it
// after a run of good steps; AdamW's unscaling, which is exact (an update
// from S-scaled gradients equals the update from the unscaled ones, bit for
// bit); an overflowed step that changes nothing but the scale; and a whole
// fp16 TrainStep, eager equal to graphed, with the scale moving on the
// device and the loss going down.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/half_precision.h"
#include "graphs/captured_step.h"
#include "kernels/step_guard.h"
#include "optim/adamw.h"
#include "layers/parameter.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "ops/elementwise_ops.h"
#include "tests/layers/train_rig.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using kernels::LossScaling;

TEST(LossScalingTest, BacksOffOnOverflowGrowsAfterARunOfGoodStepsAndStaysInBounds) {
  const LossScaling scaling{.initial_scale = 8.0f, .growth_interval = 3, .min_scale = 1.0f, .max_scale = 32.0f};
  float state[kernels::kLossScaleStateSize];
  kernels::initial_loss_scale_state(scaling, state);
  // (overflowed?, scale after, good steps after)
  const struct {
    int flag;
    float scale;
    float good;
  } steps[] = {{0, 8, 1},  {0, 8, 2},  {0, 16, 0}, {0, 16, 1}, {1, 8, 0},  {1, 4, 0},  {1, 2, 0},
               {1, 1, 0},  {1, 1, 0},  {0, 1, 1},  {0, 1, 2},  {0, 2, 0},  {0, 2, 1},  {0, 2, 2},
               {0, 4, 0},  {0, 4, 1},  {0, 4, 2},  {0, 8, 0},  {0, 8, 1},  {0, 8, 2},  {0, 16, 0},
               {0, 16, 1}, {0, 16, 2}, {0, 32, 0}, {0, 32, 1}, {0, 32, 2}, {0, 32, 0}, {1, 16, 0}};
  for (std::size_t i = 0; i < std::size(steps); ++i) {
    const std::int32_t flag = steps[i].flag;
    kernels::host::loss_scale_update(scaling, state, &flag);
    ASSERT_EQ(state[0], steps[i].scale) << "after update " << i;
    ASSERT_EQ(state[1], 1.0f / steps[i].scale) << "after update " << i;
    ASSERT_EQ(state[2], steps[i].good) << "after update " << i;
  }
}

TEST(LossScalingTest, ScalesThatAreNotPowersOfTwoAndBadIntervalsAreErrors) {
  EXPECT_ERROR_CONTAINS(kernels::check_loss_scaling({.initial_scale = 1000.0f}), "initial_scale",
                        "power of two");
  EXPECT_ERROR_CONTAINS(kernels::check_loss_scaling({.growth_factor = 3.0f}), "growth_factor", "power of two");
  EXPECT_ERROR_CONTAINS(kernels::check_loss_scaling({.backoff_factor = 2.0f}), "backoff_factor < 1");
  EXPECT_ERROR_CONTAINS(kernels::check_loss_scaling({.growth_interval = 0}), "growth_interval");
  EXPECT_ERROR_CONTAINS(kernels::check_loss_scaling({.initial_scale = 64.0f, .max_scale = 32.0f}),
                        "initial_scale <= max_scale");
  Context ctx(Device::kHost);
  Parameter p = make_parameter(ctx, "w", Shape{8}, DType::kFloat16, ParameterInit::uniform(1.0f, 1));
  AdamW optimizer(ctx, {&p}, {.lr = 1e-2f});
  EXPECT_ERROR_CONTAINS(optimizer.set_loss_scaling(ctx, LossScaling{}), "set_skip_nonfinite");
  optimizer.set_skip_nonfinite(ctx, true);
  optimizer.set_loss_scaling(ctx, LossScaling{});
  EXPECT_EQ(optimizer.loss_scale(ctx), 65536.0f);
  EXPECT_ERROR_CONTAINS(optimizer.set_skip_nonfinite(ctx, false), "set_loss_scaling(ctx, std::nullopt)");
}

// fp16 parameters updated by two AdamWs: `scaled` reads gradients S times
// larger and unscales them, `plain` reads them as they are. Every step's
// state must agree bit for bit (1/S is a power of two), and a step whose
// scaled gradients overflow changes nothing but `scaled`'s scale.
struct Pair {
  static constexpr std::int64_t kSizes[] = {1031, 64};

  Pair(Context& ctx, float initial_scale) {
    for (const char* side : {"scaled.", "plain."}) {
      auto& params = std::string(side) == "scaled." ? scaled_params : plain_params;
      for (std::size_t i = 0; i < std::size(kSizes); ++i) {
        params.push_back(make_parameter(ctx, side + std::to_string(i), Shape{kSizes[i]}, DType::kFloat16,
                                        ParameterInit::uniform(1.0f, 40 + static_cast<std::uint32_t>(i))));
      }
    }
    std::vector<Parameter*> a, b;
    for (Parameter& p : scaled_params) a.push_back(&p);
    for (Parameter& p : plain_params) b.push_back(&p);
    scaled = std::make_unique<AdamW>(ctx, a, kernels::AdamWHyper{.lr = 1e-2f, .weight_decay = 0.01f});
    plain = std::make_unique<AdamW>(ctx, b, kernels::AdamWHyper{.lr = 1e-2f, .weight_decay = 0.01f});
    scaled->set_skip_nonfinite(ctx, true);
    plain->set_skip_nonfinite(ctx, true);
    scaled->set_loss_scaling(ctx, LossScaling{.initial_scale = initial_scale});
  }

  static void step(Context& ctx, AdamW& optimizer, std::vector<Parameter>& params,
                   const std::vector<std::vector<float>>& grads) {
    backward_and_update(ctx, optimizer, [&](const GradientsReady&) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        ctx.copy_from_host(params[i].grad, grads[i].data(), grads[i].size() * sizeof(float));
      }
    });
  }

  void expect_same(Context& ctx, const std::string& when) const {
    const auto ma = scaled->moments(), mb = plain->moments();
    for (std::size_t i = 0; i < std::size(kSizes); ++i) {
      ASSERT_EQ(ctx.to_vector<float>(scaled_params[i].master), ctx.to_vector<float>(plain_params[i].master)) << when;
      ASSERT_EQ(ctx.to_vector<std::uint16_t>(scaled_params[i].value),
                ctx.to_vector<std::uint16_t>(plain_params[i].value))
          << when;
      ASSERT_EQ(ctx.to_vector<float>(ma[i].m), ctx.to_vector<float>(mb[i].m)) << when;
      ASSERT_EQ(ctx.to_vector<float>(ma[i].v), ctx.to_vector<float>(mb[i].v)) << when;
    }
    ASSERT_EQ(scaled->steps_taken(ctx), plain->steps_taken(ctx)) << when;
  }

  std::vector<Parameter> scaled_params, plain_params;
  std::unique_ptr<AdamW> scaled, plain;
};

void expect_unscaled_updates_match(Device device) {
  testing::SeededRng rng;
  Context ctx(device);
  Pair pair(ctx, 1024.0f);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  float scale = 1024.0f;
  for (int s = 0; s < 6; ++s) {
    std::vector<std::vector<float>> grads, scaled;
    for (std::int64_t size : Pair::kSizes) {
      grads.emplace_back(static_cast<std::size_t>(size));
      for (float& g : grads.back()) g = normal(rng);
      scaled.push_back(grads.back());
      for (float& g : scaled.back()) g *= scale;
    }
    const bool overflow = s == 3;
    if (overflow) scaled[1][5] = std::numeric_limits<float>::infinity();  // an fp16 backward's overflow
    Pair::step(ctx, *pair.scaled, pair.scaled_params, scaled);
    if (!overflow) Pair::step(ctx, *pair.plain, pair.plain_params, grads);
    pair.expect_same(ctx, "after step " + std::to_string(s));
    if (overflow) scale /= 2;
    ASSERT_EQ(pair.scaled->loss_scale(ctx), scale) << "after step " << s;
  }
  EXPECT_EQ(pair.scaled->skipped_steps(ctx), 1);
}

TEST(LossScalingTest, UnscaledUpdatesEqualUnscaledGradientsAndAnOverflowOnlyBacksOffOnTheHost) {
  expect_unscaled_updates_match(Device::kHost);
}

TEST(LossScalingTest, UnscaledUpdatesEqualUnscaledGradientsAndAnOverflowOnlyBacksOffOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_unscaled_updates_match(Device::kCuda);
}

// A whole fp16 TrainStep with loss scaling, eager against graphed: the same
// losses and scales bit for bit, the scale growing on the device every
// `interval` good steps with nothing captured again, and the loss falling.
void expect_fp16_train_step(Device device) {
  Context ctx(device, 1);
  const ResidualStackConfig config{.hidden = 64, .ffn = 256, .layers = 2, .vocab = 128, .dtype = DType::kFloat16,
                                   .seed = 9};
  constexpr std::int64_t kTokens = 64;
  constexpr int kInterval = 3;
  testing::TrainRig<ResidualStack> eager(ctx, config, kTokens), graphed(ctx, config, kTokens);
  for (AdamW* optimizer : {&eager.optimizer, &graphed.optimizer}) {
    optimizer->set_skip_nonfinite(ctx, true);
    optimizer->set_loss_scaling(ctx, LossScaling{.initial_scale = 1024.0f, .growth_interval = kInterval});
  }
  auto captured = CapturedStep::capture(ctx, [&] { return graphed.step(ctx); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
  const std::int64_t recordings = CapturedStep::total_recordings();
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(kTokens * config.hidden));
  for (auto& v : x) v = float_to_fp16(uniform(rng));
  std::vector<std::int32_t> labels(kTokens);
  for (auto& v : labels) v = static_cast<std::int32_t>(rng() % config.vocab);
  for (const TrainStep* step : {&eager.step, &graphed.step}) {
    ctx.copy_from_host(step->inputs(), x.data(), x.size() * sizeof(std::uint16_t));
    ctx.copy_from_host(step->labels(), labels.data(), labels.size() * sizeof(std::int32_t));
  }
  std::vector<float> losses;
  constexpr int kSteps = 9;
  for (int s = 0; s < kSteps; ++s) {
    losses.push_back(testing::expect_same_step<ResidualStack>(ctx, eager, graphed, *captured, s));
    ASSERT_EQ(ctx.to_vector<float>(eager.optimizer.loss_scale_state()),
              ctx.to_vector<float>(graphed.optimizer.loss_scale_state()))
        << "after step " << s;
    ASSERT_EQ(graphed.optimizer.loss_scale(ctx), 1024.0f * static_cast<float>(1 << ((s + 1) / kInterval)))
        << "after step " << s;
  }
  EXPECT_EQ(graphed.optimizer.skipped_steps(ctx), 0);
  EXPECT_EQ(CapturedStep::total_recordings(), recordings);
  testing::expect_trained_alike<ResidualStack>(ctx, eager, graphed, losses, kSteps);
}

TEST(LossScalingTest, Fp16TrainStepEagerEqualsGraphedWhileTheScaleGrowsOnTheHost) {
  expect_fp16_train_step(Device::kHost);
}

TEST(LossScalingTest, Fp16TrainStepEagerEqualsGraphedWhileTheScaleGrowsOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_fp16_train_step(Device::kCuda);
}

}  // namespace
}  // namespace stepgraph
