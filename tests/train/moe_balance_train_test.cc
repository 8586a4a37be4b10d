// TrainStep with MoE load balancing (Note [MoE load balancing] in
// layers/moe_mlp.h), host: a ResidualStack whose MoE blocks have both the
// auxiliary loss and the expert bias trains, eager and graphed alike bit
// for bit (loss, aux loss, biases); the step reports {loss, aux_loss}; and a
// checkpoint taken mid-run resumes exactly: the biases restored bit for bit
// and the steps after the load equal the uninterrupted run's. The seed of
// the data is printed on failure.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/training_state.h"
#include "engine/context.h"
#include "graphs/captured_step.h"
#include "layers/residual_stack.h"
#include "tests/layers/tensor_io.h"
#include "tests/layers/train_rig.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

using Rig = testing::TrainRig<ResidualStack>;

constexpr std::int64_t kTokens = 32;

ResidualStackConfig moe_config() {
  return {.hidden = 16,
          .ffn = 16,
          .layers = 2,
          .vocab = 32,
          .dtype = DType::kFloat32,
          .seed = 7,
          .experts = 4,
          .topk = 2,
          .moe_every = 1,
          .moe_aux_loss_coef = 0.01f,
          .moe_bias_update_rate = 1e-2f};
}

struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> labels;
};

Batch batch(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<std::int32_t> label(0, 31);
  Batch b;
  for (std::int64_t i = 0; i < kTokens * 16; ++i) b.x.push_back(u(rng));
  for (std::int64_t i = 0; i < kTokens; ++i) b.labels.push_back(label(rng));
  return b;
}

void load(Context& ctx, const Rig& rig, const Batch& b) {
  testing::write_floats(ctx, rig.step.inputs(), b.x);
  ctx.copy_from_host(rig.step.labels(), b.labels.data(), b.labels.size() * sizeof(std::int32_t));
}

// Every MoE block's expert bias, in the stack's state() order.
std::vector<std::vector<std::uint8_t>> biases(Context& ctx, const ResidualStack& model) {
  std::vector<std::vector<std::uint8_t>> out;
  for (const StateTensor& t : model.state()) {
    if (t.name.find("expert_bias") != std::string::npos) out.push_back(testing::raw_bytes(ctx, t.tensor));
  }
  return out;
}

TEST(MoEBalanceTrainTest, GraphedEqualsEagerTrainsAndReportsTheAuxLoss) {
  const testing::TestSeed seed;
  Context ctx(Device::kHost);
  Rig eager(ctx, moe_config(), kTokens), graphed(ctx, moe_config(), kTokens);
  ASSERT_EQ(biases(ctx, eager.model).size(), 2u) << "two MoE blocks, one bias each";
  auto graph = CapturedStep::capture(ctx, [&] { return graphed.step(ctx); });
  ASSERT_EQ(graph->outputs().size(), 2u) << "{loss, aux_loss}";
  const std::vector<std::uint8_t> zero_bias = biases(ctx, eager.model)[0];
  const Batch b = batch(seed.value());
  std::vector<float> losses;
  constexpr int kSteps = 12;
  for (int step = 0; step < kSteps; ++step) {
    load(ctx, eager, b);
    load(ctx, graphed, b);
    const std::vector<Tensor> out = eager.step(ctx);
    ASSERT_EQ(out.size(), 2u);
    graph->replay();
    const float loss = ctx.to_vector<float>(graph->outputs()[0]).at(0);
    EXPECT_EQ(testing::bits(ctx.to_vector<float>(out[0]).at(0)), testing::bits(loss)) << "loss, step " << step;
    const float aux = ctx.to_vector<float>(graph->outputs()[1]).at(0);
    EXPECT_EQ(testing::bits(ctx.to_vector<float>(out[1]).at(0)), testing::bits(aux)) << "aux loss, step " << step;
    // Two blocks, each coef E sum f P >= coef (equality at perfect balance), near it.
    EXPECT_GE(aux, 2 * 0.01f * 0.999f) << "step " << step;
    EXPECT_LT(aux, 2 * 0.01f * 4.0f) << "step " << step;
    ASSERT_EQ(biases(ctx, eager.model), biases(ctx, graphed.model)) << "step " << step;
    eager.step.check_errors(ctx);
    graphed.step.check_errors(ctx);
    losses.push_back(loss);
  }
  EXPECT_NE(biases(ctx, graphed.model)[0], zero_bias) << "the bias never moved";
  testing::expect_trained_alike(ctx, eager, graphed, losses, kSteps);
}

TEST(MoEBalanceTrainTest, CheckpointRestoresTheBiasAndResumesExactly) {
  const testing::TestSeed seed;
  constexpr int kBefore = 4, kAfter = 4;
  std::vector<Batch> batches;
  for (int i = 0; i < kBefore + kAfter; ++i) batches.push_back(batch(seed.value() + i));

  Context ctx(Device::kHost);
  Rig run(ctx, moe_config(), kTokens);
  auto graph = CapturedStep::capture(ctx, [&] { return run.step(ctx); });
  auto step = [&](Context& c, Rig& rig, CapturedStep& g, int i) {
    load(c, rig, batches[i]);
    g.replay();
    rig.step.check_errors(c);
    return testing::bits(c.to_vector<float>(g.outputs()[0]).at(0));
  };
  for (int i = 0; i < kBefore; ++i) step(ctx, run, *graph, i);
  const Checkpoint saved = save_training_state(ctx, {run.model.parameters(), run.model.state()}, run.optimizer, {},
                                               kBefore);
  int bias_tensors = 0;
  for (const CheckpointTensor& t : saved.tensors) bias_tensors += t.name.find("expert_bias") != std::string::npos;
  EXPECT_EQ(bias_tensors, 2) << "the checkpoint holds both blocks' expert biases";
  const auto saved_biases = biases(ctx, run.model);
  std::vector<std::uint32_t> want;
  for (int i = kBefore; i < kBefore + kAfter; ++i) want.push_back(step(ctx, run, *graph, i));
  const auto want_biases = biases(ctx, run.model);

  Context resumed_ctx(Device::kHost);
  Rig resumed(resumed_ctx, moe_config(), kTokens);
  EXPECT_NE(biases(resumed_ctx, resumed.model), saved_biases) << "a fresh model already had the saved biases";
  EXPECT_EQ(load_training_state(resumed_ctx, {resumed.model.parameters(), resumed.model.state()}, resumed.optimizer,
                                saved),
            kBefore);
  EXPECT_EQ(biases(resumed_ctx, resumed.model), saved_biases) << "the biases restored bit for bit";
  auto resumed_graph = CapturedStep::capture(resumed_ctx, [&] { return resumed.step(resumed_ctx); });
  for (int i = kBefore; i < kBefore + kAfter; ++i) {
    EXPECT_EQ(step(resumed_ctx, resumed, *resumed_graph, i), want[i - kBefore]) << "loss at step " << i;
  }
  EXPECT_EQ(biases(resumed_ctx, resumed.model), want_biases) << "the biases after the resumed steps";
}

// A checkpoint and a model that disagree on the bias are refused, naming it:
// resuming with balancing turned on or off is not the run that was saved.
TEST(MoEBalanceTrainTest, CheckpointsWithAndWithoutTheBiasDoNotMix) {
  ResidualStackConfig plain_config = moe_config();
  plain_config.moe_bias_update_rate = 0.0f;
  Context ctx(Device::kHost);
  Rig biased(ctx, moe_config(), kTokens), plain(ctx, plain_config, kTokens);
  const Checkpoint with_bias =
      save_training_state(ctx, {biased.model.parameters(), biased.model.state()}, biased.optimizer, {}, 0);
  const Checkpoint without_bias =
      save_training_state(ctx, {plain.model.parameters(), plain.model.state()}, plain.optimizer, {}, 0);
  EXPECT_ERROR_CONTAINS(
      load_training_state(ctx, {biased.model.parameters(), biased.model.state()}, biased.optimizer, without_bias),
      "the checkpoint has no tensor 'block0.expert_bias'");
  EXPECT_ERROR_CONTAINS(
      load_training_state(ctx, {plain.model.parameters(), plain.model.state()}, plain.optimizer, with_bias),
      "tensor(s) this model does not have: 'block0.expert_bias', 'block1.expert_bias'");
}

}  // namespace
}  // namespace stepgraph
