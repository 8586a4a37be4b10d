// TrainStep with MoE load balancing (Note [MoE load balancing] in
// layers/moe_mlp.h) over host thread worlds of 2 ranks, each rank on its own
// rows of a global batch: expert-parallel (data_parallel = the EP group) and
// plain data-parallel. Every rank keeps the same expert biases (the loads
// are summed over the gradient group: each rank routes other tokens, so
// rank-local loads would move the biases apart) and reports the same aux
// loss (the ranks' mean); graph equals eager bit for bit on every rank (loss,
// aux loss, biases); the loss falls. And the GPT LanguageModel reports its
// aux loss too. The data's seed is printed on failure.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/language_model.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/global_batch.h"
#include "tests/support/seed.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = 16, kVocab = 32, kTokens = 32;  // the global batch
constexpr int kRanks = 2, kSteps = 6;

ResidualStackConfig config() {
  return {.hidden = kHidden,
          .ffn = 16,
          .layers = 2,
          .vocab = kVocab,
          .dtype = DType::kFloat32,
          .seed = 3,
          .experts = 4,
          .topk = 2,
          .moe_every = 1,
          .moe_aux_loss_coef = 0.01f,
          .moe_bias_update_rate = 1e-2f};
}

struct Rig {
  Rig(Context& ctx, Communicator& comm, bool expert_parallel)
      : model(ctx, config(), nullptr, nullptr, expert_parallel ? &comm : nullptr),
        optimizer(ctx, model.parameters(), {.lr = 1e-2f}),
        step(ctx, model, optimizer, kTokens / kRanks, &comm) {}
  void load(Context& ctx, const testing::GlobalBatch& b, int rank) {
    const std::int64_t local = kTokens / kRanks;
    ctx.copy_from_host(step.inputs(), b.x.data() + rank * local * kHidden,
                       static_cast<std::size_t>(local * kHidden) * sizeof(float));
    ctx.copy_from_host(step.labels(), b.labels.data() + rank * local, static_cast<std::size_t>(local) * 4);
  }
  std::vector<float> biases(Context& ctx) const {
    std::vector<float> out;
    for (const StateTensor& t : model.state()) {
      if (t.name.find("expert_bias") == std::string::npos) continue;
      const std::vector<float> b = ctx.to_vector<float>(t.tensor);
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
  ResidualStack model;
  AdamW optimizer;
  TrainStep step;
};

// What one rank saw, step by step.
struct RankRun {
  std::vector<float> losses, aux;
  std::vector<std::vector<float>> biases;
};

void expect_ranks_agree(bool expert_parallel) {
  const testing::TestSeed seed;
  std::vector<RankRun> runs(kRanks);
  HostWorld::run(kRanks, [&](Communicator& comm) {
    const int r = comm.rank();
    SCOPED_TRACE("rank " + std::to_string(r));
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Rig eager(ctx, comm, expert_parallel), graphed(ctx, comm, expert_parallel);
    auto graph = CapturedStep::capture(ctx, [&] { return graphed.step(ctx); },
                                       {.communicators = graphed.step.communicators()});
    ASSERT_EQ(graph->outputs().size(), 2u) << "{loss, aux_loss}";
    for (int s = 0; s < kSteps; ++s) {
      const testing::GlobalBatch b = testing::global_batch(seed.value(), 0, kTokens, kHidden, kVocab);
      eager.load(ctx, b, r);
      graphed.load(ctx, b, r);
      const std::vector<Tensor> out = eager.step(ctx);
      graph->replay();
      const std::vector<float> loss = ctx.to_vector<float>(graph->outputs()[0]);
      const std::vector<float> aux = ctx.to_vector<float>(graph->outputs()[1]);
      EXPECT_EQ(ctx.to_vector<float>(out[0]), loss) << "loss, step " << s;
      EXPECT_EQ(ctx.to_vector<float>(out[1]), aux) << "aux loss, step " << s;
      EXPECT_EQ(eager.biases(ctx), graphed.biases(ctx)) << "biases, step " << s;
      eager.step.check_errors(ctx);
      graphed.step.check_errors(ctx);
      runs[r].losses.push_back(loss.at(0));
      runs[r].aux.push_back(aux.at(0));
      runs[r].biases.push_back(graphed.biases(ctx));
    }
  });
  EXPECT_EQ(runs[0].aux, runs[1].aux) << "the reported aux loss is the ranks' mean, the same on both";
  EXPECT_EQ(runs[0].losses, runs[1].losses);
  EXPECT_EQ(runs[0].biases, runs[1].biases) << "the loads are summed over the ranks: one bias for all";
  EXPECT_NE(runs[0].biases.front(), runs[0].biases.back()) << "the bias never moved";
  EXPECT_LT(runs[0].losses.back(), runs[0].losses.front()) << "training did not reduce the loss";
}

TEST(MoEBalanceParallelTrainTest, ExpertParallelRanksShareTheBiasAndTheAuxLoss) { expect_ranks_agree(true); }
TEST(MoEBalanceParallelTrainTest, DataParallelRanksShareTheBiasAndTheAuxLoss) { expect_ranks_agree(false); }

TEST(MoEBalanceParallelTrainTest, TheGptReportsItsAuxLossAndMovesItsBias) {
  ResidualStackConfig stack = config();
  stack.heads = 2;
  const LanguageModelConfig c{.model = stack, .context = 8};
  Context ctx(Device::kHost);
  LanguageModel model(ctx, c);
  AdamW optimizer(ctx, model.parameters(), {.lr = 1e-2f});
  TrainStep step(ctx, model, optimizer, 2);  // two sequences of 8 tokens
  std::vector<std::int32_t> tokens(16), labels(16);
  for (int i = 0; i < 16; ++i) {
    tokens[i] = (3 * i + 1) % static_cast<int>(kVocab);
    labels[i] = (3 * i + 4) % static_cast<int>(kVocab);
  }
  ctx.copy_from_host(step.inputs(), tokens.data(), tokens.size() * 4);
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * 4);
  const std::vector<Tensor> out = step(ctx);
  ASSERT_EQ(out.size(), 2u) << "{loss, aux_loss}";
  EXPECT_GT(ctx.to_vector<float>(out[1]).at(0), 0.0f);
  step.check_errors(ctx);
  bool moved = false;
  for (const StateTensor& t : model.state()) {
    if (t.name.find("expert_bias") == std::string::npos) continue;
    for (float b : ctx.to_vector<float>(t.tensor)) moved = moved || b != 0.0f;
  }
  EXPECT_TRUE(moved) << "no expert bias moved after a step";
}

}  // namespace
}  // namespace stepgraph
