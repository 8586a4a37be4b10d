// FP8 weights quantized once per optimizer step (Note [FP8 weight cache]):
// a model whose recipe caches its weights trains bit for bit as the same
// model quantizing them in every forward and backward: the losses and every
// weight after each step, eager and captured (dense FP8 MLPs and FP8 MoE
// experts, current and delayed scaling, on the host; 100 captured steps on a
// GPU). The cache follows a weight set from outside a step (a checkpoint's
// load: sync_copy_from_master), and the recipe field is a clear error where
// it is not built.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "engine/half_precision.h"
#include "graphs/captured_step.h"
#include "layers/linear.h"
#include "layers/residual_stack.h"
#include "tests/layers/tensor_io.h"
#include "tests/layers/train_rig.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::bits;
using testing::raw_bytes;
using testing::TrainRig;

constexpr std::int64_t kTokens = 64;

ResidualStackConfig model_config(const Fp8Recipe& recipe, std::int64_t experts) {
  return {.hidden = 64,
          .ffn = 128,
          .layers = 2,
          .vocab = 64,
          .dtype = DType::kBFloat16,
          .seed = 3,
          .experts = experts,
          .topk = 2,
          .moe_every = 2,
          .fp8 = recipe};
}

void load_batch(Context& ctx, const TrainStep& step, std::uint32_t seed, std::int64_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<std::uint8_t> x(static_cast<std::size_t>(step.inputs().bytes()));
  for (std::int64_t i = 0; i < step.inputs().numel(); ++i) store_from_float(DType::kBFloat16, x.data(), i, uniform(rng));
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> labels(kTokens);
  for (auto& v : labels) v = label(rng);
  ctx.copy_from_host(step.inputs(), x.data(), x.size());
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
}

// `steps` training steps of the cached and the uncached model on the same
// batches; `graphed`: each model's step captured once and replayed.
void expect_cached_equals_uncached(Device device, Fp8Recipe recipe, std::int64_t experts, bool graphed, int steps) {
  SCOPED_TRACE(recipe.to_string() + (experts > 0 ? " moe" : " dense") + (graphed ? " graphed" : " eager"));
  Context ctx(device);
  Fp8Recipe cached_recipe = recipe;
  cached_recipe.cache_weights = true;
  TrainRig<ResidualStack> plain(ctx, model_config(recipe, experts), kTokens);
  TrainRig<ResidualStack> cached(ctx, model_config(cached_recipe, experts), kTokens);
  std::shared_ptr<CapturedStep> plain_graph, cached_graph;
  if (graphed) {
    plain_graph = CapturedStep::capture(ctx, [&] { return plain.step(ctx); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
    cached_graph = CapturedStep::capture(ctx, [&] { return cached.step(ctx); },
                                         {.pool_report_policy = PoolReportPolicy::kError});
  }
  const testing::TestSeed first_seed;
  for (int s = 0; s < steps; ++s) {
    const std::uint32_t seed = first_seed.value() + static_cast<std::uint32_t>(s);
    load_batch(ctx, plain.step, seed, 64);
    load_batch(ctx, cached.step, seed, 64);
    Tensor plain_loss, cached_loss;
    if (graphed) {
      plain_graph->replay();
      cached_graph->replay();
      plain_loss = plain_graph->outputs()[0];
      cached_loss = cached_graph->outputs()[0];
    } else {
      plain_loss = plain.step(ctx)[0];
      cached_loss = cached.step(ctx)[0];
    }
    const float want = ctx.to_vector<float>(plain_loss).at(0), got = ctx.to_vector<float>(cached_loss).at(0);
    ASSERT_EQ(bits(want), bits(got)) << "step " << s << ": uncached " << want << ", cached " << got;
    const std::vector<Parameter*> p = plain.model.parameters(), c = cached.model.parameters();
    for (std::size_t i = 0; i < p.size(); ++i) {
      ASSERT_EQ(raw_bytes(ctx, p[i]->value), raw_bytes(ctx, c[i]->value)) << p[i]->name << " after step " << s;
    }
  }
  cached.step.check_errors(ctx);
  EXPECT_EQ(cached.model.non_finite_amaxes(ctx), 0);
}

TEST(Fp8WeightCacheTest, CachedWeightsTrainAsUncachedOnTheHost) {
  for (const Fp8Recipe& recipe : {Fp8Recipe::current(), Fp8Recipe::delayed(4)}) {
    for (std::int64_t experts : {0, 4}) {
      for (bool graphed : {false, true}) expect_cached_equals_uncached(Device::kHost, recipe, experts, graphed, 4);
    }
  }
}

TEST(Fp8WeightCacheTest, CachedWeightsTrainAsUncachedOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  for (const Fp8Recipe& recipe : {Fp8Recipe::current(), Fp8Recipe::delayed(16)}) {
    for (std::int64_t experts : {0, 4}) expect_cached_equals_uncached(Device::kCuda, recipe, experts, true, 100);
  }
}

// A weight written outside a step (as a checkpoint's load does) reaches the
// cache through sync_copy_from_master: the next step equals a fresh layer's.
TEST(Fp8WeightCacheTest, AWeightSetOutsideAStepIsRequantized) {
  Context ctx(Device::kHost);
  Fp8Recipe recipe = Fp8Recipe::current();
  recipe.cache_weights = true;
  const LinearConfig config{.in_features = 32, .out_features = 48, .bias = false, .fp8 = recipe};
  Linear layer(ctx, "a", config, 1);
  Linear fresh(ctx, "b", config, 2);  // another seed: other weights
  const Tensor x = ctx.persistent("x", {Shape{16, 32}, DType::kBFloat16});
  std::vector<float> values(16 * 32);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& v : values) v = uniform(rng);
  testing::write_floats(ctx, x, values);
  // Give `layer` fresh's weights by its master, as a checkpoint load does.
  const std::vector<float> master = ctx.to_vector<float>(fresh.weight().master);
  ctx.copy_from_host(layer.weight().master, master.data(), master.size() * sizeof(float));
  sync_copy_from_master(ctx, layer.weight());
  EXPECT_EQ(raw_bytes(ctx, layer.forward(ctx, {x}).y), raw_bytes(ctx, fresh.forward(ctx, {x}).y));
}

TEST(Fp8WeightCacheTest, CacheWeightsIsForTensorWiseScaling) {
  Fp8Recipe recipe = Fp8Recipe::block();
  recipe.cache_weights = true;
  EXPECT_ERROR_CONTAINS(recipe.check(), "cache_weights", "block");
  Fp8Recipe current = Fp8Recipe::current();
  Fp8Recipe cached = current;
  cached.cache_weights = true;
  EXPECT_FALSE(current == cached) << "cache_weights must enter the graph key";
  EXPECT_NE(cached.to_string().find("cache_weights=true"), std::string::npos) << cached.to_string();
}

}  // namespace
}  // namespace stepgraph
