// Tensor-parallel training (Note [Tensor-parallel ResidualStack]) on host
// thread worlds: TP=2, TP=4 and a 2-D world of TP=2 x DP=2 train a
// ResidualStack with a dense and an MoE block and the vocabulary-parallel
// head, each rank on its 1/N of the global batch's tokens, against one
// process training on the whole batch; graph equals eager on every rank.
//
// Tolerance: the ranks compute the same sums as one process in another fp32
// order (fc2's and the head's partial sums, the split sum of exponentials,
// the norms' all-reduced gradients, pipelined rings), about 1e-7 relative per
// step; AdamW divides by the root of the second moment, so parameters can
// drift by up to a few lr-sized steps where a gradient is near zero. We allow
// 1e-5 relative on the global loss of every step and 1e-5 absolute on the
// replicated parameters (the final norm) after 4 steps of lr 1e-3. A missing
// reduction or a mis-scaled loss is off by orders of magnitude.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "optim/adamw.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "tests/layers/world_steps.h"
#include "tests/support/global_batch.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kVocab = 16;
constexpr std::int64_t kTokens = 16;  // the global batch
constexpr int kSteps = 4;

ResidualStackConfig config(const MLPOverlap& overlap) {
  return {.hidden = kHidden,
          .ffn = 32,
          .layers = 2,
          .vocab = kVocab,
          .dtype = DType::kFloat32,
          .seed = 7,
          .experts = 4,
          .topk = 2,
          .moe_every = 2,
          .overlap = overlap};
}

// The global batch of step s (tests/support/global_batch.h) at this file's sizes.
using Batch = testing::GlobalBatch;
Batch global_batch(std::uint32_t seed, int step) { return testing::global_batch(seed, step, kTokens, kHidden, kVocab); }

struct Rig {
  Rig(Context& ctx, std::int64_t tokens, Communicator* tp, Communicator* dp, const MLPOverlap& overlap)
      : model(ctx, config(overlap), tp),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f}),
        step(ctx, model, optimizer, tokens, dp) {}
  void load(Context& ctx, const Batch& b, std::int64_t first, std::int64_t tokens) {
    ctx.copy_from_host(step.inputs(), b.x.data() + first * kHidden, static_cast<std::size_t>(tokens * kHidden) * 4);
    ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(tokens) * 4);
  }
  std::vector<float> final_norm(Context& ctx) {
    const std::vector<Parameter*> p = model.parameters();
    // The final norm's gamma and beta come right before the head's weight.
    std::vector<float> out = ctx.to_vector<float>(p[p.size() - 3]->master);
    const std::vector<float> beta = ctx.to_vector<float>(p[p.size() - 2]->master);
    out.insert(out.end(), beta.begin(), beta.end());
    return out;
  }
  ResidualStack model;
  AdamW optimizer;
  TrainStep step;
};

struct Case {
  int tp;
  int dp;
  const char* overlap;
};

class TensorParallelTrainTest : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelTrainTest, EqualsOneProcessOnTheWholeBatchAndGraphEqualsEager) {
  const Case c = GetParam();
  const MLPOverlap overlap = MLPOverlap::parse(c.overlap);
  const testing::TestSeed seed;
  std::vector<float> want_losses;
  std::vector<float> want_norm;
  {
    Context ctx(Device::kHost, 2);
    Rig rig(ctx, kTokens, nullptr, nullptr, overlap);
    for (int s = 0; s < kSteps; ++s) {
      rig.load(ctx, global_batch(seed.value(), s), 0, kTokens);
      want_losses.push_back(ctx.to_vector<float>(rig.step(ctx)[0]).at(0));
    }
    want_norm = rig.final_norm(ctx);
  }
  const std::int64_t local = kTokens / (c.tp * c.dp);
  HostWorld::run(c.tp * c.dp, [&](Communicator& world) {
    const int w = world.rank();
    // Tensor-parallel groups of consecutive ranks, data-parallel across them.
    std::unique_ptr<Communicator> tp_group, dp_group;
    Communicator* tp = &world;
    Communicator* dp = nullptr;
    if (c.dp > 1) {
      tp_group = world.split(w / c.tp, w, "tp");
      dp_group = world.split(w % c.tp, w, "dp");
      tp = tp_group.get();
      dp = dp_group.get();
    }
    const std::string who = "world rank " + std::to_string(w) + " (tp " + std::to_string(c.tp) + ", dp " +
                            std::to_string(c.dp) + ", " + c.overlap + ")";
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Rig eager(ctx, local, tp, dp, overlap);
    Rig graphed(ctx, local, tp, dp, overlap);
    EXPECT_EQ(graphed.step.communicators().size(), c.dp > 1 ? 2u : 1u) << who;
    const int dp_rank = dp != nullptr ? dp->rank() : 0;
    const std::int64_t first = (dp_rank * c.tp + tp->rank()) * local;
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(ctx, eager, graphed, want_losses, who, [&](int s) {
      const Batch b = global_batch(seed.value(), s);
      eager.load(ctx, b, first, local);
      graphed.load(ctx, b, first, local);
    }));
    const std::vector<float> norm = graphed.final_norm(ctx);
    EXPECT_EQ(norm, eager.final_norm(ctx)) << who << ": graph and eager parameters differ";
    ASSERT_NO_FATAL_FAILURE(testing::expect_within(norm, want_norm, 1e-5f, who + ": the final norm"));
    for (std::size_t i = 0; i < graphed.model.parameters().size(); ++i) {
      const Parameter* pe = eager.model.parameters()[i];
      const Parameter* pg = graphed.model.parameters()[i];
      EXPECT_EQ(ctx.to_vector<float>(pg->master), ctx.to_vector<float>(pe->master)) << who << " " << pg->name;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelTrainTest,
                         ::testing::Values(Case{2, 1, "bulk"}, Case{2, 1, "overlap"}, Case{4, 1, "overlap"},
                                           Case{2, 2, "none"}, Case{2, 2, "overlap"}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "_dp" + std::to_string(info.param.dp) + "_" +
                                  info.param.overlap;
                         });

}  // namespace
}  // namespace stepgraph
