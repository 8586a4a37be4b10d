// A 4-block LayerNormMLP model's whole training step (forward, cross-entropy,
// backward, AdamW), run eager and captured as one graph from identical
// states: the losses must be identical, bit for bit, step after step. On the
// host everywhere; on CUDA where there is a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/layers/model.h"
#include "engine/layers/train_step.h"
#include "graphs/captured_step.h"
#include "tests/support/gpu.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kTokens = 64;

ModelConfig small_model() {
  return {.hidden = 64, .ffn = 256, .layers = 4, .vocab = 128, .dtype = DType::kBFloat16, .seed = 5};
}

// One model with its optimizer and step, all persistent in `ctx`.
struct Trainer {
  Trainer(Context& ctx, const ModelConfig& config)
      : model(ctx, config), optimizer(ctx, model.parameters(), {.lr = 1e-2f}), step(ctx, model, optimizer, kTokens) {}
  Model model;
  AdamW optimizer;
  TrainStep step;
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

std::uint32_t bits(float value) {
  std::uint32_t out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

void expect_eager_equals_graph(Device device, int steps) {
  Context ctx(device);
  const ModelConfig config = small_model();
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
    const std::vector<Tensor> eager_out = eager.step(ctx);
    captured->replay();
    const float eager_loss = ctx.to_vector<float>(eager_out[0]).at(0);
    const float graph_loss = ctx.to_vector<float>(captured->outputs()[0]).at(0);
    EXPECT_EQ(bits(eager_loss), bits(graph_loss))
        << "step " << s << ": eager " << eager_loss << ", graph " << graph_loss;
    losses.push_back(graph_loss);
    eager.step.check_labels(ctx);
    graphed.step.check_labels(ctx);
  }
  EXPECT_EQ(eager.optimizer.steps_taken(ctx), steps);
  EXPECT_EQ(graphed.optimizer.steps_taken(ctx), steps);
  EXPECT_LT(losses.back(), losses.front()) << "training on two fixed batches did not reduce the loss";
}

TEST(TrainStepHostTest, FourBlockModelEagerEqualsGraphForTenSteps) { expect_eager_equals_graph(Device::kHost, 10); }

TEST(TrainStepCudaTest, FourBlockModelEagerEqualsGraphForTenSteps) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph(Device::kCuda, 10);
}

}  // namespace
}  // namespace stepgraph
