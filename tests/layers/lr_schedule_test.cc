// Learning-rate schedules on the device (Note [Learning-rate schedule] in
// kernels/lr_schedule.h): the formula at its corners, bad
// schedules as errors naming the field, and AdamW whose rate changes every
// step in one captured graph: a cosine schedule, or set_lr between replays,
// replayed from one capture equals an eager twin bit for bit, and each
// update's rate is the schedule's (host: lr_at exactly; GPU: within a float
// ulp of the host formula, the cosine's last bit being libm's or CUDA's).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "kernels/lr_schedule.h"
#include "optim/adamw.h"
#include "layers/parameter.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using kernels::lr_at;
using kernels::LrSchedule;
using kernels::LrScheduleKind;

TEST(LrScheduleTest, WarmupThenCosineOrLinearToTheFloor) {
  const LrSchedule cosine{.kind = LrScheduleKind::kCosine, .base = 1.0f, .min_lr = 0.1f, .warmup = 10, .total = 110};
  EXPECT_FLOAT_EQ(lr_at(cosine, 1), 0.1f);    // warmup: t / warmup
  EXPECT_FLOAT_EQ(lr_at(cosine, 5), 0.5f);
  EXPECT_FLOAT_EQ(lr_at(cosine, 10), 1.0f);   // the peak at the end of the warmup
  EXPECT_FLOAT_EQ(lr_at(cosine, 60), 0.55f);  // halfway: the mean of base and floor
  EXPECT_FLOAT_EQ(lr_at(cosine, 110), 0.1f);  // the floor at the last step
  EXPECT_FLOAT_EQ(lr_at(cosine, 500), 0.1f);  // and after it
  for (std::int64_t t = 11; t < 110; ++t) EXPECT_LE(lr_at(cosine, t + 1), lr_at(cosine, t)) << t;

  LrSchedule linear = cosine;
  linear.kind = LrScheduleKind::kLinear;
  EXPECT_FLOAT_EQ(lr_at(linear, 35), 0.775f);  // a quarter of the way down
  EXPECT_FLOAT_EQ(lr_at(linear, 110), 0.1f);

  const LrSchedule constant{.base = 0.5f, .warmup = 4};
  EXPECT_FLOAT_EQ(lr_at(constant, 2), 0.25f);
  EXPECT_FLOAT_EQ(lr_at(constant, 4), 0.5f);
  EXPECT_FLOAT_EQ(lr_at(constant, 1000), 0.5f);
  EXPECT_FLOAT_EQ(lr_at({.base = 0.5f}, 1), 0.5f);  // no warmup
}

TEST(LrScheduleTest, BadSchedulesAreErrorsNamingTheField) {
  using kernels::check_lr_schedule;
  EXPECT_ERROR_CONTAINS(check_lr_schedule({.base = -1.0f}), "base rate", ">= 0");
  EXPECT_ERROR_CONTAINS(check_lr_schedule({.base = NAN}), "base rate", "finite");
  EXPECT_ERROR_CONTAINS(check_lr_schedule({.base = 1.0f, .min_lr = 2.0f}), "min_lr", "<= the base rate");
  EXPECT_ERROR_CONTAINS(check_lr_schedule({.base = 1.0f, .warmup = -1}), "warmup", ">= 0");
  EXPECT_ERROR_CONTAINS(
      check_lr_schedule({.kind = LrScheduleKind::kCosine, .base = 1.0f, .warmup = 10, .total = 10}),
      "cosine", "total steps must be larger", "10");
  EXPECT_ERROR_CONTAINS(kernels::parse_lr_schedule_kind("step"), "unknown learning-rate schedule 'step'",
                        "constant, cosine or linear");
  EXPECT_EQ(kernels::parse_lr_schedule_kind("cosine"), LrScheduleKind::kCosine);
}

// Two optimizers over equal parameters (same values, same gradients), one
// stepped eagerly and one through a captured step replayed `steps` times;
// `between(step)` runs on both before each step (set_lr, say). Their
// weights, moments and rates stay equal bit for bit; `rate(t)` is the rate
// update t must have used.
template <typename Between, typename Rate>
void expect_replays_equal_eager(Device device, const std::optional<LrSchedule>& schedule, int steps,
                                Between&& between, Rate&& rate, float tolerance_ulps) {
  Context ctx(device);
  const testing::TestSeed seed;
  const std::vector<float> grads = uniform_init(4096 + 7, 0.1f, seed.value() + 1);
  auto make = [&](const std::string& name) {
    Parameter p =
        make_parameter(ctx, name, Shape{4096 + 7}, DType::kBFloat16, ParameterInit::uniform(1.0f, seed.value()));
    ctx.copy_from_host(p.grad, grads.data(), grads.size() * sizeof(float));
    return p;
  };
  Parameter eager_p = make("eager"), graph_p = make("graph");
  std::vector<Parameter*> eager_params{&eager_p}, graph_params{&graph_p};
  const kernels::AdamWHyper hyper{.lr = 1e-2f, .weight_decay = 0.01f};
  AdamW eager(ctx, eager_params, hyper, schedule);
  AdamW graphed(ctx, graph_params, hyper, schedule);
  auto captured = CapturedStep::capture(ctx, [&] {
    graphed.step(ctx);
    return std::vector<Tensor>{};
  });
  for (int t = 1; t <= steps; ++t) {
    between(ctx, eager, t);
    between(ctx, graphed, t);
    eager.step(ctx);
    captured->replay();
    ASSERT_EQ(ctx.to_vector<float>(eager_p.master), ctx.to_vector<float>(graph_p.master)) << "step " << t;
    ASSERT_EQ(ctx.to_vector<std::uint16_t>(eager_p.value), ctx.to_vector<std::uint16_t>(graph_p.value)) << t;
    const float used = graphed.lr(ctx);
    ASSERT_EQ(used, eager.lr(ctx)) << "step " << t;
    const float want = rate(t);
    ASSERT_LE(std::abs(used - want), tolerance_ulps * std::abs(std::nextafter(want, INFINITY) - want))
        << "step " << t << ": the update used " << used << ", the schedule says " << want;
  }
  EXPECT_EQ(graphed.steps_taken(ctx), steps);
}

void expect_scheduled_replays(Device device, float tolerance_ulps) {
  const LrSchedule schedule{.kind = LrScheduleKind::kCosine, .base = 1e-2f, .min_lr = 1e-3f, .warmup = 3, .total = 12};
  expect_replays_equal_eager(
      device, schedule, 15, [](Context&, AdamW&, int) {}, [&](int t) { return lr_at(schedule, t); },
      tolerance_ulps);
  // A rate set from the host between replays: the same capture takes it.
  expect_replays_equal_eager(
      device, std::nullopt, 6, [](Context& ctx, AdamW& optimizer, int t) { optimizer.set_lr(ctx, 1e-3f * t); },
      [](int t) { return 1e-3f * t; }, 0.0f);
}

TEST(LrScheduleTest, OneCaptureReplaysEveryRateAndEqualsEagerOnTheHost) { expect_scheduled_replays(Device::kHost, 0); }

TEST(LrScheduleTest, OneCaptureReplaysEveryRateAndEqualsEagerOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_scheduled_replays(Device::kCuda, 1.0f);
}

TEST(LrScheduleTest, SetLrWithAScheduleIsAnError) {
  Context ctx(Device::kHost);
  Parameter p = make_parameter(ctx, "w", Shape{4}, DType::kFloat32, constant_init(4, 1.0f));
  AdamW optimizer(ctx, {&p}, {}, LrSchedule{.base = 1e-3f, .warmup = 2});
  EXPECT_ERROR_CONTAINS(optimizer.set_lr(ctx, 1e-4f), "set_lr", "schedule", "writes the rate");
  AdamW plain(ctx, {&p}, {});
  EXPECT_ERROR_CONTAINS(plain.set_lr(ctx, -1.0f), "finite and >= 0");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, {&p}, {}, LrSchedule{.kind = LrScheduleKind::kLinear, .base = 1e-3f}),
                        "linear", "total steps must be larger");
}

}  // namespace
}  // namespace stepgraph
