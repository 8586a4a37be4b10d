// Skipping non-finite steps on the device (Note [Non-finite steps] in
// optim/adamw.h): a step whose loss or one gradient is NaN or
// infinite leaves the parameters, their copies, the moments, the step
// counter, the scheduled rate and the weights' after-update hooks exactly
// as they were, and the next good step goes on as if the bad one never ran.
// Checked against a twin that is simply never given the bad steps, over one
// capture replayed with bad steps planted at random replays (host 120, GPU
// 1,000 replays, read back only every 100), and through a whole TrainStep.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "kernels/lr_schedule.h"
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

const std::vector<std::int64_t> kSizes = {4096 + 7, 300, 1000};

// Parameters with bf16 copies, a cosine-scheduled AdamW in two groups, and
// an after-update hook per parameter that counts its calls on the device.
struct Rig {
  Rig(Context& ctx, const std::string& prefix, std::uint32_t seed, bool skip) {
    for (std::size_t i = 0; i < kSizes.size(); ++i) {
      params.push_back(make_parameter(ctx, prefix + std::to_string(i), Shape{kSizes[i]}, DType::kBFloat16,
                                      ParameterInit::uniform(1.0f, seed + static_cast<std::uint32_t>(i))));
    }
    refreshes = ctx.persistent(prefix + "refreshes", {Shape{1}, DType::kFloat32});
    one = ctx.persistent(prefix + "one", {Shape{1}, DType::kFloat32});
    const float value = 1.0f;
    ctx.copy_from_host(one, &value, sizeof(value));
    for (Parameter& p : params) {
      p.after_update.push_back([refreshes = refreshes, one = one](Context& c) { ops::axpy_(c, refreshes, one, 1.0f); });
    }
    for (Parameter& p : params) pointers.push_back(&p);
    optimizer = std::make_unique<AdamW>(
        ctx, pointers, kernels::AdamWHyper{.lr = 1e-2f, .weight_decay = 0.01f},
        kernels::LrSchedule{.kind = kernels::LrScheduleKind::kCosine, .base = 1e-2f, .min_lr = 1e-3f, .warmup = 5,
                            .total = 2000});
    const std::size_t groups[] = {2, 1};
    optimizer->set_groups(ctx, groups);
    if (skip) optimizer->set_skip_nonfinite(ctx, true);
    for (std::size_t i = 0; i < kSizes.size(); ++i) {
      planted.push_back(ctx.persistent(prefix + "planted" + std::to_string(i), {Shape{kSizes[i]}, DType::kFloat32}));
    }
    loss = ctx.persistent(prefix + "loss", {Shape{1}, DType::kFloat32});
  }

  // The step: the loss checked, each group's gradients "computed" (copied
  // from the planted inputs) and reported, the update.
  void step(Context& ctx) const {
    if (optimizer->skips_nonfinite()) optimizer->flag_nonfinite(ctx, loss);
    backward_and_update(ctx, *optimizer, [&](const GradientsReady& ready) {
      std::size_t next = 0;
      for (std::size_t g = 0; g < optimizer->group_count(); ++g) {
        const std::size_t count = g == 0 ? 2 : 1;
        for (std::size_t i = 0; i < count; ++i, ++next) ops::copy_(ctx, params[next].grad, planted[next]);
        ready(g);
      }
    });
  }

  std::vector<Parameter> params;
  std::vector<Parameter*> pointers;
  Tensor refreshes, one, loss;
  std::unique_ptr<AdamW> optimizer;
  std::vector<Tensor> planted;
};

// Everything an update changes, bit for bit.
void expect_same_state(Context& ctx, const Rig& a, const Rig& b, const std::string& when) {
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    ASSERT_EQ(ctx.to_vector<float>(a.params[i].master), ctx.to_vector<float>(b.params[i].master)) << when << " " << i;
    ASSERT_EQ(ctx.to_vector<std::uint16_t>(a.params[i].value), ctx.to_vector<std::uint16_t>(b.params[i].value))
        << when;
    const auto ma = a.optimizer->moments(), mb = b.optimizer->moments();
    ASSERT_EQ(ctx.to_vector<float>(ma[i].m), ctx.to_vector<float>(mb[i].m)) << when << " " << i;
    ASSERT_EQ(ctx.to_vector<float>(ma[i].v), ctx.to_vector<float>(mb[i].v)) << when << " " << i;
  }
  ASSERT_EQ(a.optimizer->steps_taken(ctx), b.optimizer->steps_taken(ctx)) << when;
  ASSERT_EQ(a.optimizer->lr(ctx), b.optimizer->lr(ctx)) << when;
  ASSERT_EQ(ctx.to_vector<float>(a.refreshes), ctx.to_vector<float>(b.refreshes)) << when;
}

Tensor source(Context& ctx, const std::string& name, const std::vector<float>& values) {
  Tensor t = ctx.persistent(name, {Shape{static_cast<std::int64_t>(values.size())}, DType::kFloat32});
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

void expect_bad_replays_change_nothing(Device device, int replays, int check_every) {
  testing::SeededRng rng;
  Context ctx(device, /*side_streams=*/1);
  Rig twin(ctx, "twin.", 11, /*skip=*/false);  // eager, only ever given the good steps
  Rig graphed(ctx, "graph.", 11, /*skip=*/true);
  auto captured = CapturedStep::capture(ctx, [&] {
    graphed.step(ctx);
    return std::vector<Tensor>{};
  });
  const std::int64_t recordings = CapturedStep::total_recordings();

  // Sources: 4 good gradient sets, and bad ones each with one NaN or +-inf
  // in one element of one parameter's gradient; a finite and two bad losses.
  constexpr int kGood = 4;
  std::vector<std::vector<Tensor>> grads;
  for (int v = 0; v < kGood; ++v) {
    grads.emplace_back();
    for (std::size_t i = 0; i < kSizes.size(); ++i) {
      grads.back().push_back(source(ctx, "good" + std::to_string(v) + "." + std::to_string(i),
                                    uniform_init(kSizes[i], 0.1f, rng() % 100000)));
    }
  }
  const float bad_values[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::vector<Tensor>> bad_grads;
  for (int b = 0; b < 6; ++b) {
    const std::size_t param = static_cast<std::size_t>(b) % kSizes.size();
    std::vector<float> values = uniform_init(kSizes[param], 0.1f, 7 + b);
    values[rng() % values.size()] = bad_values[b % 3];
    std::vector<Tensor> set = grads[b % kGood];
    set[param] = source(ctx, "bad" + std::to_string(b), values);
    bad_grads.push_back(set);
  }
  const Tensor finite_loss = source(ctx, "loss.finite", {2.5f});
  const Tensor bad_losses[] = {source(ctx, "loss.inf", {std::numeric_limits<float>::infinity()}),
                               source(ctx, "loss.nan", {std::numeric_limits<float>::quiet_NaN()})};

  std::int64_t bad = 0;
  for (int r = 1; r <= replays; ++r) {
    const int kind = static_cast<int>(rng() % 10);  // 0-1: a bad loss, 2-3: a bad gradient, else good
    const std::vector<Tensor>& set = kind >= 2 && kind <= 3 ? bad_grads[rng() % bad_grads.size()]
                                                             : grads[rng() % kGood];
    const Tensor& loss = kind <= 1 ? bad_losses[kind] : finite_loss;
    std::vector<InputBinding> bindings{{graphed.loss, loss}};
    for (std::size_t i = 0; i < kSizes.size(); ++i) bindings.push_back({graphed.planted[i], set[i]});
    captured->replay(bindings);  // nothing read back between checks
    if (kind <= 3) {
      ++bad;
    } else {
      ops::copy_(ctx, twin.loss, loss);
      for (std::size_t i = 0; i < kSizes.size(); ++i) ops::copy_(ctx, twin.planted[i], set[i]);
      twin.step(ctx);
    }
    if (r % check_every == 0 || r == replays) {
      expect_same_state(ctx, twin, graphed, "after replay " + std::to_string(r));
      ASSERT_EQ(graphed.optimizer->skipped_steps(ctx), bad) << "after replay " << r;
      ASSERT_EQ(twin.optimizer->steps_taken(ctx), r - bad);
    }
  }
  EXPECT_EQ(CapturedStep::total_recordings(), recordings);
  EXPECT_GT(bad, 0);
}

TEST(NonFiniteSkipTest, BadReplaysChangeNothingAndGoodOnesGoOnOnTheHost) {
  expect_bad_replays_change_nothing(Device::kHost, 120, 10);
}

TEST(NonFiniteSkipTest, BadReplaysChangeNothingOverThousandReplaysOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_bad_replays_change_nothing(Device::kCuda, 1000, 100);
}

// A whole TrainStep: an infinite activation in a batch makes the loss and
// the gradients non-finite; the step is skipped, eager and graphed alike.
void expect_train_step_skips(Device device) {
  Context ctx(device);
  const ResidualStackConfig config{.hidden = 64, .ffn = 256, .layers = 2, .vocab = 128, .dtype = DType::kBFloat16,
                                   .seed = 5};
  constexpr std::int64_t kTokens = 64;
  testing::TrainRig<ResidualStack> eager(ctx, config, kTokens), graphed(ctx, config, kTokens),
      twin(ctx, config, kTokens);
  eager.optimizer.set_skip_nonfinite(ctx, true);
  graphed.optimizer.set_skip_nonfinite(ctx, true);
  auto captured = CapturedStep::capture(ctx, [&] { return graphed.step(ctx); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
  auto load = [&](const TrainStep& step, int s) {
    std::mt19937 rng(300 + s % 3);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<std::uint16_t> x(static_cast<std::size_t>(kTokens * config.hidden));
    for (auto& v : x) v = float_to_bf16(uniform(rng));
    if (s % 4 == 1) x[static_cast<std::size_t>(s) % x.size()] = float_to_bf16(std::numeric_limits<float>::infinity());
    std::vector<std::int32_t> labels(kTokens);
    for (auto& v : labels) v = static_cast<std::int32_t>(rng() % config.vocab);
    ctx.copy_from_host(step.inputs(), x.data(), x.size() * sizeof(std::uint16_t));
    ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
  };
  int bad = 0;
  for (int s = 0; s < 10; ++s) {
    load(eager.step, s);
    load(graphed.step, s);
    const float loss = testing::expect_same_step<ResidualStack>(ctx, eager, graphed, *captured, s);
    if (s % 4 == 1) {
      EXPECT_FALSE(std::isfinite(loss)) << "step " << s;
      ++bad;
      continue;
    }
    load(twin.step, s);
    EXPECT_EQ(testing::bits(ctx.to_vector<float>(twin.step(ctx)[0]).at(0)), testing::bits(loss)) << "step " << s;
  }
  EXPECT_EQ(graphed.optimizer.skipped_steps(ctx), bad);
  EXPECT_EQ(eager.optimizer.skipped_steps(ctx), bad);
  EXPECT_EQ(graphed.optimizer.steps_taken(ctx), 10 - bad);
  const std::vector<Parameter*> a = twin.model.parameters(), b = graphed.model.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(ctx.to_vector<float>(a[i]->master), ctx.to_vector<float>(b[i]->master)) << a[i]->name;
  }
}

TEST(NonFiniteSkipTest, TrainStepSkipsAnInfiniteBatchEagerAndGraphedOnTheHost) {
  expect_train_step_skips(Device::kHost);
}

TEST(NonFiniteSkipTest, TrainStepSkipsAnInfiniteBatchEagerAndGraphedOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_train_step_skips(Device::kCuda);
}

TEST(NonFiniteSkipTest, ZeroOneAndMissingSetupAreErrors) {
  Context ctx(Device::kHost, 1);
  Rig plain(ctx, "plain.", 3, /*skip=*/false);
  EXPECT_ERROR_CONTAINS(plain.optimizer->flag_nonfinite(ctx, plain.loss), "set_skip_nonfinite");
  HostWorld::run(2, [](Communicator& comm) {
    Context rank_ctx(Device::kHost, 1);
    Rig rig(rank_ctx, "r.", 3, /*skip=*/true);
    EXPECT_ERROR_CONTAINS(rig.optimizer->shard(rank_ctx, comm), "skips non-finite steps", "NCCL #1986");
    Rig other(rank_ctx, "o.", 3, /*skip=*/false);
    other.optimizer->shard(rank_ctx, comm);
    EXPECT_ERROR_CONTAINS(other.optimizer->set_skip_nonfinite(rank_ctx, true), "ZeRO-1", "NCCL #1986");
  });
}

}  // namespace
}  // namespace stepgraph
