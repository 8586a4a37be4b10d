// TrainStep over a 4-block LayerNormMLP ResidualStack (forward,
// cross-entropy, backward, AdamW), run eager and captured as one graph from
// identical states: the losses must be identical, bit for bit, step after
// step. On the host everywhere; on CUDA where there is a GPU. (TrainStep over
// a LanguageModel: language_model_test.)
#include "train/train_step.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "graphs/captured_step.h"
#include "layers/residual_stack.h"
#include "tests/layers/train_rig.h"
#include "tests/support/gpu.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using testing::TrainRig;
using testing::bits;
using testing::expect_same_step;
using testing::expect_trained_alike;

constexpr std::int64_t kTokens = 64;

ResidualStackConfig small_model() {
  return {.hidden = 64, .ffn = 256, .layers = 4, .vocab = 128, .dtype = DType::kBFloat16, .seed = 5};
}

// One model with its optimizer and step, all persistent in `ctx`.
struct Trainer : TrainRig<ResidualStack> {
  Trainer(Context& ctx, const ResidualStackConfig& config) : TrainRig(ctx, config, kTokens) {}
};

void load_batch(Context& ctx, const TrainStep& step, std::uint32_t seed, std::int64_t hidden, std::int64_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(kTokens * hidden));
  for (auto& v : x) v = float_to_bf16(uniform(rng));
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> labels(kTokens);
  for (auto& v : labels) v = label(rng);
  ctx.copy_from_host(step.inputs(), x.data(), x.size() * sizeof(std::uint16_t));
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
}

void expect_eager_equals_graph(Device device, int steps) {
  Context ctx(device);
  const ResidualStackConfig config = small_model();
  Trainer eager(ctx, config);
  Trainer graphed(ctx, config);
  auto captured =
      CapturedStep::capture(ctx, [&] { return graphed.step(ctx); }, {.pool_report_policy = PoolReportPolicy::kError});
  EXPECT_LE(captured->plan().ratio_to_lower_bound(), 1.10);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const std::uint32_t seed = 100 + static_cast<std::uint32_t>(s % 2);  // two batches, alternating
    load_batch(ctx, eager.step, seed, config.hidden, config.vocab);
    load_batch(ctx, graphed.step, seed, config.hidden, config.vocab);
    losses.push_back(expect_same_step<ResidualStack>(ctx, eager, graphed, *captured, s));
  }
  expect_trained_alike<ResidualStack>(ctx, eager, graphed, losses, steps);
}

// With a side stream the optimizer updates each block as soon as its
// gradients are final, overlapping the backward (weight gradients and AdamW
// groups on stream 1); without one, one update follows the backward. Same
// arithmetic: the losses and the final weights must be identical, and the
// overlapped version must stay so when captured.
void expect_overlapped_update_equals_single_update(Device device, int steps) {
  const ResidualStackConfig config = small_model();
  Context serial_ctx(device, /*side_streams=*/0);
  Context overlap_ctx(device, /*side_streams=*/1);
  Trainer serial(serial_ctx, config);
  Trainer overlapped(overlap_ctx, config);
  EXPECT_EQ(serial.optimizer.group_count(), 0u);
  EXPECT_EQ(overlapped.optimizer.group_count(), static_cast<std::size_t>(config.layers + 2));
  auto captured = CapturedStep::capture(overlap_ctx, [&] { return overlapped.step(overlap_ctx); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
  for (int s = 0; s < steps; ++s) {
    const auto seed = 200 + static_cast<std::uint32_t>(s);
    load_batch(serial_ctx, serial.step, seed, config.hidden, config.vocab);
    load_batch(overlap_ctx, overlapped.step, seed, config.hidden, config.vocab);
    const float serial_loss = serial_ctx.to_vector<float>(serial.step(serial_ctx)[0]).at(0);
    captured->replay();
    const float overlap_loss = overlap_ctx.to_vector<float>(captured->outputs()[0]).at(0);
    EXPECT_EQ(bits(serial_loss), bits(overlap_loss)) << "step " << s;
  }
  EXPECT_EQ(overlapped.optimizer.steps_taken(overlap_ctx), steps);
  const std::vector<Parameter*> a = serial.model.parameters();
  const std::vector<Parameter*> b = overlapped.model.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(serial_ctx.to_vector<float>(a[i]->master), overlap_ctx.to_vector<float>(b[i]->master)) << a[i]->name;
  }
}

TEST(TrainStepHostTest, FourBlockModelEagerEqualsGraphForTenSteps) { expect_eager_equals_graph(Device::kHost, 10); }

TEST(TrainStepHostTest, AnOptimizerOverAnotherModelIsAnErrorNamingTheParameter) {
  Context ctx(Device::kHost);
  ResidualStack a(ctx, small_model());
  ResidualStack b(ctx, small_model());
  AdamW over_a(ctx, a.parameters(), {.lr = 1e-2f});
  EXPECT_ERROR_CONTAINS(TrainStep(ctx, b, over_a, kTokens), "TrainStep: the optimizer updates parameter",
                        "which is not a parameter of the step's model");
  std::vector<Parameter*> some = a.parameters();
  some.pop_back();
  AdamW partial(ctx, some, {.lr = 1e-2f});
  EXPECT_ERROR_CONTAINS(TrainStep(ctx, a, partial, kTokens), "is not updated by the optimizer");
  AdamW all(ctx, a.parameters(), {.lr = 1e-2f});
  EXPECT_NO_THROW(TrainStep(ctx, a, all, kTokens));
}

TEST(TrainStepHostTest, OverlappedUpdateEqualsSingleUpdate) {
  expect_overlapped_update_equals_single_update(Device::kHost, 4);
}

TEST(TrainStepCudaTest, OverlappedUpdateEqualsSingleUpdate) {
  SG_SKIP_WITHOUT_GPU();
  expect_overlapped_update_equals_single_update(Device::kCuda, 6);
}

TEST(TrainStepCudaTest, FourBlockModelEagerEqualsGraphForTenSteps) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph(Device::kCuda, 10);
}

// Note [Recomputed activation]: a model whose dense blocks compute GeLU again
// in the backward trains as the one that saves it, up to the rounding of the
// pre-activation GeLU reads (losses within 1e-3 over the steps), eager
// equals graph bit for bit, and the captured step's pool is smaller by at
// least a block's activation.
// A model that saves its GeLU activations, captured, and the same model
// recomputing them (recompute_activation), captured and as an eager twin;
// the recomputing step's pool is smaller than the saving one's by at least
// `activation_bytes` (one block's activation).
struct SavedAndRecomputed {
  SavedAndRecomputed(Context& ctx, const ResidualStackConfig& saved_config, std::int64_t activation_bytes)
      : config(saved_config),
        saved(ctx, saved_config),
        eager(ctx, recomputing_config(saved_config)),
        graphed(ctx, recomputing_config(saved_config)),
        saving(CapturedStep::capture(ctx, [this, &ctx] { return saved.step(ctx); })),
        recomputing(CapturedStep::capture(ctx, [this, &ctx] { return graphed.step(ctx); },
                                          {.pool_report_policy = PoolReportPolicy::kError})) {
    EXPECT_LE(recomputing->plan().lower_bound_bytes, saving->plan().lower_bound_bytes - activation_bytes)
        << "saved " << saving->plan().lower_bound_bytes << ", recomputed " << recomputing->plan().lower_bound_bytes;
  }

  static ResidualStackConfig recomputing_config(ResidualStackConfig config) {
    config.recompute_activation = true;
    return config;
  }

  // Step s on the batch of `seed`, in all three: the recomputing model's
  // eager step equals its graph (expect_same_step). Returns the recomputing
  // loss and the saving one.
  std::pair<float, float> step(Context& ctx, std::uint32_t seed, int s) {
    for (Trainer* t : {&saved, &eager, &graphed}) load_batch(ctx, t->step, seed, config.hidden, config.vocab);
    const float loss = expect_same_step<ResidualStack>(ctx, eager, graphed, *recomputing, s);
    saving->replay();
    return {loss, ctx.to_vector<float>(saving->outputs()[0]).at(0)};
  }

  ResidualStackConfig config;
  Trainer saved, eager, graphed;
  std::shared_ptr<CapturedStep> saving, recomputing;
};

void expect_recompute_trains_alike(Device device, int steps, double tolerance) {
  Context ctx(device);
  SavedAndRecomputed models(ctx, small_model(), kTokens * small_model().ffn * 2);
  EXPECT_LE(models.recomputing->plan().ratio_to_lower_bound(), 1.10);
  for (int s = 0; s < steps; ++s) {
    const auto [loss, saved_loss] = models.step(ctx, 400 + static_cast<std::uint32_t>(s), s);
    EXPECT_NEAR(loss, saved_loss, tolerance * std::abs(saved_loss)) << "step " << s;
    if (s > 0) continue;
    // From equal weights only fc2's weight gradient reads the activation:
    // every other gradient is the same bits, fc2's within GeLU's rounding.
    const std::vector<Parameter*> a = models.saved.model.parameters(), b = models.graphed.model.parameters();
    for (std::size_t i = 0; i < a.size(); ++i) {
      const std::vector<float> x = ctx.to_vector<float>(a[i]->grad), y = ctx.to_vector<float>(b[i]->grad);
      if (a[i]->name.find("fc2.weight") == std::string::npos) {
        EXPECT_EQ(x, y) << a[i]->name;
        continue;
      }
      double difference = 0, norm = 0;
      for (std::size_t j = 0; j < x.size(); ++j) {
        difference += (static_cast<double>(x[j]) - y[j]) * (static_cast<double>(x[j]) - y[j]);
        norm += static_cast<double>(x[j]) * x[j];
      }
      EXPECT_LE(std::sqrt(difference / norm), 1e-2) << a[i]->name;
    }
  }
}

TEST(TrainStepHostTest, RecomputedActivationTrainsAsSavedWithASmallerPool) {
  expect_recompute_trains_alike(Device::kHost, 4, 1e-3);
}

TEST(TrainStepCudaTest, RecomputedActivationTrainsAsSavedWithASmallerPool) {
  SG_SKIP_WITHOUT_GPU();
  expect_recompute_trains_alike(Device::kCuda, 6, 1e-3);
}

// Note [Step-scoped gradients]: an optimizer whose gradients live only
// within the step trains exactly as one with persistent gradients (the same
// arithmetic on the same values), eager and graphed, on a model with
// attention and MoE blocks; its persistent bytes are smaller by the
// gradients' 4 bytes a parameter, the captured step's pool holds them
// instead (for less than all of them), and between steps no parameter has a
// gradient.
void expect_step_scoped_gradients_train_alike(Device device, int steps) {
  ResidualStackConfig config = small_model();
  config.heads = 4;
  config.experts = 4;
  Context ctx(device);
  Trainer persistent(ctx, config);
  const std::int64_t before = ctx.memory_stats().persistent_bytes;
  Trainer eager(ctx, config);
  Trainer graphed(ctx, config);
  const std::int64_t two_trainers = ctx.memory_stats().persistent_bytes - before;
  std::int64_t gradient_bytes = 0;
  for (const Parameter* p : graphed.model.parameters()) gradient_bytes += p->grad.bytes();
  eager.optimizer.use_step_scoped_gradients(ctx);
  graphed.optimizer.use_step_scoped_gradients(ctx);
  EXPECT_EQ(ctx.memory_stats().persistent_bytes - before, two_trainers - 2 * gradient_bytes);

  auto with_persistent = CapturedStep::capture(ctx, [&] { return persistent.step(ctx); });
  auto step_scoped =
      CapturedStep::capture(ctx, [&] { return graphed.step(ctx); }, {.pool_report_policy = PoolReportPolicy::kError});
  const std::int64_t bound = with_persistent->plan().lower_bound_bytes;
  EXPECT_GT(step_scoped->plan().lower_bound_bytes, bound);
  EXPECT_LT(step_scoped->plan().lower_bound_bytes, bound + gradient_bytes)
      << "the step-scoped gradients should never all be live at once";
  EXPECT_LE(step_scoped->plan().ratio_to_lower_bound(), 1.10);
  const auto no_gradients = [](Trainer& t) {
    for (const Parameter* p : t.model.parameters()) EXPECT_FALSE(p->grad.defined()) << p->name;
  };
  no_gradients(graphed);

  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const std::uint32_t seed = 500 + static_cast<std::uint32_t>(s % 2);  // two batches, alternating
    for (Trainer* t : {&persistent, &eager, &graphed}) load_batch(ctx, t->step, seed, config.hidden, config.vocab);
    losses.push_back(expect_same_step<ResidualStack>(ctx, eager, graphed, *step_scoped, s));
    with_persistent->replay();
    EXPECT_EQ(bits(losses.back()), bits(ctx.to_vector<float>(with_persistent->outputs()[0]).at(0))) << "step " << s;
    no_gradients(eager);
    no_gradients(graphed);
  }
  expect_trained_alike<ResidualStack>(ctx, eager, graphed, losses, steps);
  const std::vector<Parameter*> a = persistent.model.parameters(), b = eager.model.parameters(),
                                c = graphed.model.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::vector<float> master = ctx.to_vector<float>(a[i]->master);
    EXPECT_EQ(master, ctx.to_vector<float>(b[i]->master)) << a[i]->name;
    EXPECT_EQ(master, ctx.to_vector<float>(c[i]->master)) << a[i]->name;
  }
}

TEST(TrainStepHostTest, StepScopedGradientsTrainAsPersistentOnesInLessMemory) {
  expect_step_scoped_gradients_train_alike(Device::kHost, 3);
}

TEST(TrainStepCudaTest, StepScopedGradientsTrainAsPersistentOnesInLessMemory) {
  SG_SKIP_WITHOUT_GPU();
  expect_step_scoped_gradients_train_alike(Device::kCuda, 5);
}

// MoE experts that compute GeLU again in the backward (MoEMLPConfig::
// recompute_activation) train as the ones that save it, bit for bit (both
// GeLUs read the same 16-bit pre-activation), with a smaller pool.
void expect_moe_recompute_trains_as_saved(Device device, int steps) {
  ResidualStackConfig saved_config = small_model();
  saved_config.experts = 4;
  saved_config.moe_every = 1;
  Context ctx(device);
  SavedAndRecomputed models(ctx, saved_config, kTokens * saved_config.topk * saved_config.ffn * 2);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const auto [loss, saved_loss] = models.step(ctx, 600 + static_cast<std::uint32_t>(s % 2), s);
    losses.push_back(loss);
    EXPECT_EQ(bits(loss), bits(saved_loss)) << "step " << s;
  }
  expect_trained_alike<ResidualStack>(ctx, models.eager, models.graphed, losses, steps);
}

TEST(TrainStepHostTest, MoERecomputedActivationTrainsAsSavedBitForBit) {
  expect_moe_recompute_trains_as_saved(Device::kHost, 3);
}

TEST(TrainStepCudaTest, MoERecomputedActivationTrainsAsSavedBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  expect_moe_recompute_trains_as_saved(Device::kCuda, 5);
}

TEST(TrainStepHostTest, StepScopedGradientsRefuseWhatReadsPersistentOnes) {
  Context ctx(Device::kHost);
  Trainer skipping(ctx, small_model());
  skipping.optimizer.set_skip_nonfinite(ctx, true);
  EXPECT_ERROR_CONTAINS(skipping.optimizer.use_step_scoped_gradients(ctx), "the non-finite skip");
  Trainer scoped(ctx, small_model());
  scoped.optimizer.use_step_scoped_gradients(ctx);
  EXPECT_ERROR_CONTAINS(scoped.optimizer.set_skip_nonfinite(ctx, true), "step-scoped");
  EXPECT_ERROR_CONTAINS(scoped.optimizer.all_gradients(), "step-scoped");
  // An eager step: the backward makes the gradients, the updates drop them.
  scoped.step(ctx);
  for (const Parameter* p : scoped.model.parameters()) EXPECT_FALSE(p->grad.defined()) << p->name;
  // Released persistent gradients are not made again.
  Parameter& first = *scoped.model.parameters().front();
  first.step_scoped_gradient = false;
  EXPECT_ERROR_CONTAINS(first.gradient_for_write(ctx), "has no gradient tensor");
}

}  // namespace
}  // namespace stepgraph
