// A small MoE ResidualStack (hidden 16, ffn 32, 2 MLP blocks, vocab 32,
// E = 8, top-2; both blocks MoE, or block 1 only) trained by TrainStep over
// expert-parallel host thread worlds of 2 and 4 ranks (Note [Expert-parallel
// ResidualStack]), each rank on its own rows of the global batch with
// data_parallel = the EP communicator, against one process (no EP) on the
// whole batch over 3 AdamW steps: every step's loss, and after them every
// parameter: the replicated ones on every rank, and each rank's experts
// against the one process's same experts. Graph equals eager bit for bit on
// every rank, losses and parameters. With the optimizer's groups (updates
// overlapping the backward) and without (one update after it). The GPT
// LanguageModel (embedding, attention) alike at EP 2. And what an
// expert-parallel model or step refuses.
//
// Tolerance: the forward of every token is the one process's on the same
// weights (the MoE layer's outputs and expert gradients are bit for bit,
// Note [Expert-parallel MoE]); what differs is the order of fp32 additions
// in the replicated gradients (each rank sums its tokens' terms and the
// all-reduce adds the P partial sums, where one process adds all terms in one
// sequence) and, from the second step on, everything downstream of the
// weights that this rounding moved: about 1e-7 relative per step. The loss
// is held to 1e-5 relative. AdamW divides each update by the root of the
// second moment, which turns a gradient element within rounding of zero into
// a whole lr-sized step of either sign; with eps = 1e-2 (about the
// gradients' size here) an update changes by at most lr / eps = 0.1 times
// its gradient's change, so every parameter stays within 1e-5 absolute of one
// process's after 3 steps (measured over 5 runs of every case: at most
// 6e-8). A missing or doubled reduction (the replicated
// gradients of one rank's tokens only, or the experts' summed over the ranks)
// is off by 1e-4 or more: the first step alone moves every weight by lr.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/language_model.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/layers/world_steps.h"
#include "tests/support/expect_error.h"
#include "tests/support/global_batch.h"
#include "tests/support/moe_train_rig.h"
#include "tests/support/seed.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = testing::kSmallMoeHidden;
constexpr std::int64_t kVocab = testing::kSmallMoeVocab;
constexpr std::int64_t kTokens = 24;  // the global batch
constexpr int kSteps = 3;

using testing::small_moe_config;
using testing::small_moe_context;
using Rig = testing::MoeTrainRig<ResidualStack>;
using GptRig = testing::MoeTrainRig<LanguageModel>;

testing::GlobalBatch global_batch(std::uint32_t seed, int step) {
  return testing::global_batch(seed, step, kTokens, kHidden, kVocab);
}

struct Case {
  int ep;
  std::int64_t moe_every;
  bool grouped;
};

class ExpertParallelTrainTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertParallelTrainTest, EqualsOneProcessOnTheWholeBatchOverThreeAdamWStepsAndGraphEqualsEager) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  std::vector<float> want_losses;
  std::vector<std::string> names;
  std::vector<std::vector<float>> want_params;
  {
    const std::unique_ptr<Context> ctx = small_moe_context(c.grouped);
    Rig rig(*ctx, small_moe_config(c.moe_every), kTokens, nullptr, {});
    EXPECT_TRUE(rig.model.expert_parameters().empty()) << "no expert parallelism, no rank-local experts";
    for (int s = 0; s < kSteps; ++s) {
      rig.load(*ctx, global_batch(seed.value(), s), 0, kTokens);
      want_losses.push_back(ctx->to_vector<float>(rig.step(*ctx)[0]).at(0));
    }
    for (const Parameter* p : rig.model.parameters()) {
      names.push_back(p->name);
      want_params.push_back(ctx->to_vector<float>(p->master));
    }
  }
  const std::int64_t local = kTokens / c.ep;
  HostWorld::run(c.ep, [&](Communicator& ep) {
    const int r = ep.rank();
    const std::string who = "rank " + std::to_string(r) + " of ep " + std::to_string(c.ep) + " (moe_every " +
                            std::to_string(c.moe_every) + (c.grouped ? ", grouped)" : ", one update)");
    const std::unique_ptr<Context> ctx = small_moe_context(c.grouped);
    Rig eager(*ctx, small_moe_config(c.moe_every), local, &ep, {.data_parallel = &ep});
    Rig graphed(*ctx, small_moe_config(c.moe_every), local, &ep, {.data_parallel = &ep});
    ASSERT_EQ(eager.optimizer.group_count() > 0, c.grouped) << who;
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(*ctx, eager, graphed, want_losses, who, [&](int s) {
      const testing::GlobalBatch b = global_batch(seed.value(), s);
      eager.load(*ctx, b, r * local, local);
      graphed.load(*ctx, b, r * local, local);
    }));
    const std::vector<Parameter*> expert_list = eager.model.expert_parameters();
    const std::unordered_set<const Parameter*> experts(expert_list.begin(), expert_list.end());
    // fc1's and fc2's weight and bias in every MoE block.
    EXPECT_EQ(experts.size(), 4u * static_cast<std::size_t>(c.moe_every == 1 ? 2 : 1)) << who;
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    ASSERT_EQ(pg.size(), names.size()) << who;
    for (std::size_t i = 0; i < pg.size(); ++i) {
      ASSERT_EQ(pg[i]->name, names[i]) << who;
      const std::vector<float> values = ctx->to_vector<float>(pg[i]->master);
      EXPECT_EQ(values, ctx->to_vector<float>(pe[i]->master)) << who << " " << names[i] << ": graph != eager";
      if (experts.count(pe[i]) == 0) {
        testing::expect_within(values, want_params[i], 1e-5f, who + " " + names[i] + " (replicated)");
        continue;
      }
      // This rank's experts [r E/P, (r+1) E/P): the leading rows of the [E, ...] parameter.
      const std::size_t n = values.size();
      ASSERT_EQ(n * static_cast<std::size_t>(c.ep), want_params[i].size()) << who << " " << names[i];
      const std::vector<float> mine(want_params[i].begin() + static_cast<std::ptrdiff_t>(r * n),
                                    want_params[i].begin() + static_cast<std::ptrdiff_t>((r + 1) * n));
      testing::expect_within(values, mine, 1e-5f, who + " " + names[i] + " (this rank's experts)");
    }
    eager.step.check_errors(*ctx);
    graphed.step.check_errors(*ctx);
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ExpertParallelTrainTest,
                         ::testing::Values(Case{2, 1, true}, Case{2, 2, true}, Case{2, 1, false}, Case{4, 1, true},
                                           Case{4, 2, false}),
                         [](const auto& info) {
                           return "ep" + std::to_string(info.param.ep) + "_moe_every" +
                                  std::to_string(info.param.moe_every) +
                                  (info.param.grouped ? "_grouped" : "_one_update");
                         });

// The GPT LanguageModel (embedding, attention, MoE blocks) at EP 2: each
// rank's own sequences, against one process on all of them. The same
// tolerance as above (the embedding's and attention's gradients are
// replicated: summed in another order; measured over 3 runs: at most 1.2e-7).
constexpr std::int64_t kSequences = 4;  // the global batch's
using testing::small_moe_gpt_config;

TEST(ExpertParallelGptTrain, EqualsOneProcessOnEveryRanksSequencesAndGraphEqualsEager) {
  const testing::TestSeed seed;
  constexpr int kRanks = 2;
  constexpr std::int64_t kAll = kSequences * testing::kSmallMoeContext;
  auto batch = [&](int s) { return testing::small_moe_gpt_batch(seed.value(), s, kAll); };
  std::vector<float> want_losses;
  std::vector<std::vector<float>> want_params;
  {
    const std::unique_ptr<Context> ctx = small_moe_context(true);
    GptRig rig(*ctx, small_moe_gpt_config(), kSequences, nullptr, {});
    for (int s = 0; s < kSteps; ++s) {
      const auto [tokens, labels] = batch(s);
      rig.load(*ctx, tokens, labels, 0, kAll);
      want_losses.push_back(ctx->to_vector<float>(rig.step(*ctx)[0]).at(0));
    }
    for (const Parameter* p : rig.model.parameters()) want_params.push_back(ctx->to_vector<float>(p->master));
  }
  constexpr std::int64_t kLocal = kAll / kRanks;
  HostWorld::run(kRanks, [&](Communicator& ep) {
    const int r = ep.rank();
    const std::string who = "rank " + std::to_string(r) + " of ep " + std::to_string(kRanks) + " (GPT)";
    const std::unique_ptr<Context> ctx = small_moe_context(true);
    GptRig eager(*ctx, small_moe_gpt_config(), kSequences / kRanks, &ep, {.data_parallel = &ep});
    GptRig graphed(*ctx, small_moe_gpt_config(), kSequences / kRanks, &ep, {.data_parallel = &ep});
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(*ctx, eager, graphed, want_losses, who, [&](int s) {
      const auto [tokens, labels] = batch(s);
      eager.load(*ctx, tokens, labels, r * kLocal, kLocal);
      graphed.load(*ctx, tokens, labels, r * kLocal, kLocal);
    }));
    const std::vector<Parameter*> expert_list = eager.model.expert_parameters();
    const std::unordered_set<const Parameter*> experts(expert_list.begin(), expert_list.end());
    EXPECT_EQ(experts.size(), 8u) << who;
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    ASSERT_EQ(pg.size(), want_params.size()) << who;
    for (std::size_t i = 0; i < pg.size(); ++i) {
      const std::vector<float> values = ctx->to_vector<float>(pg[i]->master);
      EXPECT_EQ(values, ctx->to_vector<float>(pe[i]->master)) << who << " " << pg[i]->name << ": graph != eager";
      if (experts.count(pe[i]) == 0) {
        testing::expect_within(values, want_params[i], 1e-5f, who + " " + pg[i]->name + " (replicated)");
        continue;
      }
      const std::size_t n = values.size();
      ASSERT_EQ(n * kRanks, want_params[i].size()) << who << " " << pg[i]->name;
      const std::vector<float> mine(want_params[i].begin() + static_cast<std::ptrdiff_t>(r * n),
                                    want_params[i].begin() + static_cast<std::ptrdiff_t>((r + 1) * n));
      testing::expect_within(values, mine, 1e-5f, who + " " + pg[i]->name + " (this rank's experts)");
    }
    eager.step.check_errors(*ctx);
  });
}

TEST(ExpertParallelTrainErrors, ExpertTimesTensorParallelIsRefusedNamingBoth) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    testing::expect_error_code([&] { ResidualStack model(ctx, small_moe_config(1), &comm, nullptr, &comm); },
                               ErrorCode::kUnsupported, "expert parallelism over");
    EXPECT_ERROR_CONTAINS(ResidualStack model(ctx, small_moe_config(1), &comm, nullptr, &comm),
                          "tensor parallelism over", "not both");
  });
}

TEST(ExpertParallelTrainErrors, ExpertParallelWithoutExpertsIsRefused) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    ResidualStackConfig dense = small_moe_config(1);
    dense.experts = 0;
    EXPECT_ERROR_CONTAINS(ResidualStack model(ctx, dense, nullptr, nullptr, &comm), "expert_parallel", "experts is 0");
  });
}

TEST(ExpertParallelTrainErrors, StepMustReduceOverTheExpertParallelGroupWithoutZero1) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, &comm);
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, kTokens / 2), "data_parallel must be",
                          "expert-parallel", "none");
    testing::expect_error_code(
        [&] { TrainStep step(ctx, model, optimizer, kTokens / 2, &comm, DataParallelMode::kZero1); },
        ErrorCode::kUnsupported, "ZeRO-1");
  });
}

}  // namespace
}  // namespace stepgraph
