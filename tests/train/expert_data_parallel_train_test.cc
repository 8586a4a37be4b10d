// Expert x data parallelism in TrainStep (GradientGroups; the layout of
// train/expert_data_parallel_groups.h): a small MoE ResidualStack (hidden 16,
// ffn 32, 2 MLP blocks, vocab 32, E = 8, top-2; both blocks MoE, or block 1
// only) trained over host thread worlds of EP x DP ranks, each on its own
// rows of the global batch, data_parallel the whole world, the model's
// expert-parallel group its replica's EP ranks and expert_data_parallel the
// ranks holding its experts: EP 2 x DP 2, and through the same API EP 4 x
// DP 1 and EP 1 x DP 4 (every rank all experts: plain data parallelism);
// random routing, and routers steered so that every token goes to one EP
// rank's experts (the others' receive nothing) or experts 1 and E - 1
// receive nothing (their gradients checked to be zero, the others' not);
// against one process (no EP) on the whole batch over 3 AdamW steps: every
// step's loss, then every parameter (the replicated ones on every rank, each
// rank's experts against one process's same experts). On every rank graph
// equals eager bit for bit (losses and parameters), and every rank holds the
// same bits as every other rank holding that parameter (the replicas agree).
// The GPT LanguageModel at EP 2 x DP 2 alike. And the refusals: groups of
// sizes that do not multiply up, groups that mix replicas, an
// expert_data_parallel without an expert-parallel model or without
// data_parallel, ZeRO-1; each on every rank, naming the argument.
//
// Tolerance: as in expert_parallel_train_test.cc. Every token's forward is
// one process's on the same weights, and each EP group's experts' gradients
// are bit for bit one process's on that replica's tokens (Note
// [Expert-parallel MoE]). What differs is the order of fp32 additions: the
// replicated gradients are the world all-reduce of EP x DP partial sums, the
// experts' the expert-data-parallel all-reduce of DP replicas' partial sums,
// where one process adds all terms in one sequence; from the second step on,
// everything downstream of the weights this rounding moved: about 1e-7
// relative per step. The loss is held to 1e-5 relative. AdamW's eps = 1e-2
// (about the gradients' size here) bounds an update's change by lr / eps =
// 0.1 times its gradient's change, so every parameter stays within 1e-5
// absolute of one process's after 3 steps (measured over 5 runs of every
// case: at most 6e-8). A missing reduction (experts not summed over their
// replicas, or dense gradients over one replica only) or a doubled one is
// off by 1e-4 or more: the first step alone moves every weight by lr.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "graphs/program.h"
#include "layers/language_model.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/layers/world_steps.h"
#include "tests/support/expect_error.h"
#include "tests/support/global_batch.h"
#include "tests/support/moe_train_rig.h"
#include "tests/support/seed.h"
#include "train/expert_data_parallel_groups.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = testing::kSmallMoeHidden;
constexpr std::int64_t kVocab = testing::kSmallMoeVocab;
constexpr std::int64_t kExperts = testing::kSmallMoeExperts;
constexpr std::int64_t kTokens = 24;  // the global batch
constexpr int kSteps = 3;

using testing::small_moe_config;
using testing::small_moe_context;
using Rig = testing::MoeTrainRig<ResidualStack>;
using GptRig = testing::MoeTrainRig<LanguageModel>;

testing::GlobalBatch global_batch(std::uint32_t seed, int step) {
  return testing::global_batch(seed, step, kTokens, kHidden, kVocab);
}

// One process's parameters after the steps, and its losses.
struct Reference {
  std::vector<float> losses;
  std::vector<std::string> names;
  std::vector<std::vector<float>> params;
};

// This EP rank's experts [e L, (e+1) L): the leading rows of one process's [E, ...] parameter.
std::vector<float> experts_of(const std::vector<float>& whole, int ep_rank, int ep) {
  const std::size_t n = whole.size() / static_cast<std::size_t>(ep);
  return {whole.begin() + static_cast<std::ptrdiff_t>(ep_rank * n),
          whole.begin() + static_cast<std::ptrdiff_t>((ep_rank + 1) * n)};
}

// Every parameter of every rank, after the steps: params[rank][i].
struct WorldParams {
  std::mutex mutex;
  std::vector<std::vector<std::vector<float>>> params;
  void put(int rank, std::vector<std::vector<float>> values) {
    const std::lock_guard<std::mutex> lock(mutex);
    params[static_cast<std::size_t>(rank)] = std::move(values);
  }
};

// Ranks holding the same parameter hold the same bits: the replicated ones
// on every rank, an expert on every rank of its expert-data-parallel group
// (the same EP rank).
void expect_replicas_agree(const WorldParams& world, const std::vector<bool>& is_expert, int ep,
                           const std::string& what) {
  for (std::size_t r = 1; r < world.params.size(); ++r) {
    for (std::size_t i = 0; i < is_expert.size(); ++i) {
      const std::size_t peer = is_expert[i] ? r % static_cast<std::size_t>(ep) : 0;
      if (peer == r) continue;
      EXPECT_EQ(world.params[r][i], world.params[peer][i])
          << what << ": parameter " << i << " of rank " << r << " differs from rank " << peer << "'s";
    }
  }
}

enum class Routing {
  kRandom,
  kOneRanksExperts,  // every token to the last EP rank's experts: the others' receive nothing
  kEmptyExperts,     // experts 1 and E - 1 receive nothing
};

// Steers every MoE block's router through its norm's beta and its weight
// (replicated: the same values on every rank and in one process): beta[0] =
// 10 and W[e, 0] = push[e] / 10 move expert e's logit by about push[e] for
// every token, far more than the 3 steps' updates move them back.
void steer(Context& ctx, ResidualStack& model, Routing routing, int ep) {
  if (routing == Routing::kRandom) return;
  std::vector<float> push(kExperts, 0.0f);
  const std::int64_t local = kExperts / ep;
  for (std::int64_t e = 0; e < kExperts; ++e) {
    if (routing == Routing::kOneRanksExperts) push[e] = e >= (ep - 1) * local ? 30.0f : 0.0f;
    if (routing == Routing::kEmptyExperts) push[e] = e == 1 || e == kExperts - 1 ? -30.0f : 0.0f;
  }
  const std::vector<Parameter*> params = model.parameters();
  int steered = 0;
  for (Parameter* router : params) {
    const std::string suffix = ".router.weight";
    if (router->name.size() < suffix.size() ||
        router->name.compare(router->name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string block = router->name.substr(0, router->name.size() - suffix.size());
    for (Parameter* beta : params) {
      if (beta->name != block + ".norm.beta") continue;
      std::vector<float> b = ctx.to_vector<float>(beta->master);
      b[0] = 10.0f;
      ctx.copy_from_host(beta->master, b.data(), b.size() * sizeof(float));
    }
    std::vector<float> w = ctx.to_vector<float>(router->master);  // [E, H]
    for (std::int64_t e = 0; e < kExperts; ++e) w[static_cast<std::size_t>(e * kHidden)] = push[e] / 10.0f;
    ctx.copy_from_host(router->master, w.data(), w.size() * sizeof(float));
    ++steered;
  }
  ASSERT_EQ(steered, model.config().layers) << "every block is an MoE block in the steered cases";
}

// The steered routing really happened: the experts that received nothing
// have zero gradients in the last step (summed over their replicas), every
// other EP rank's experts some. `grads`: this rank's expert parameters' gradients.
void expect_routing(Routing routing, int ep_rank, int ep, const std::vector<std::vector<float>>& grads,
                    const std::string& who) {
  if (routing == Routing::kRandom) return;
  const std::int64_t local = kExperts / ep;
  for (const std::vector<float>& g : grads) {
    const std::size_t per_expert = g.size() / static_cast<std::size_t>(local);
    for (std::int64_t l = 0; l < local; ++l) {
      const std::int64_t expert = ep_rank * local + l;
      const bool empty =
          routing == Routing::kOneRanksExperts ? ep_rank != ep - 1 : expert == 1 || expert == kExperts - 1;
      bool zero = true;
      for (std::size_t i = 0; i < per_expert; ++i)
        zero = zero && g[static_cast<std::size_t>(l) * per_expert + i] == 0.0f;
      EXPECT_EQ(zero, empty) << who << ": expert " << expert
                             << (empty ? " should receive nothing" : " received nothing");
    }
  }
}

struct Case {
  int ep;
  int dp;
  std::int64_t moe_every;
  bool grouped;
  Routing routing = Routing::kRandom;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "ep " << c.ep << " x dp " << c.dp << ", moe_every " << c.moe_every << (c.grouped ? ", grouped" : "")
       << ", routing " << static_cast<int>(c.routing);
}

class ExpertDataParallelTrainTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertDataParallelTrainTest, EqualsOneProcessOnTheGlobalBatchOverThreeAdamWStepsAndGraphEqualsEager) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  Reference want;
  {
    const std::unique_ptr<Context> ctx = small_moe_context(c.grouped);
    Rig rig(*ctx, small_moe_config(c.moe_every), kTokens, nullptr, {});
    steer(*ctx, rig.model, c.routing, c.ep);
    for (int s = 0; s < kSteps; ++s) {
      rig.load(*ctx, global_batch(seed.value(), s), 0, kTokens);
      want.losses.push_back(ctx->to_vector<float>(rig.step(*ctx)[0]).at(0));
    }
    for (const Parameter* p : rig.model.parameters()) {
      want.names.push_back(p->name);
      want.params.push_back(ctx->to_vector<float>(p->master));
    }
  }
  const int ranks = c.ep * c.dp;
  const std::int64_t local = kTokens / ranks;
  WorldParams world_params;
  world_params.params.resize(static_cast<std::size_t>(ranks));
  std::vector<bool> is_expert(want.names.size(), false);
  std::mutex is_expert_mutex;
  HostWorld::run(ranks, [&](Communicator& world) {
    const int w = world.rank();
    const std::string who = "rank " + std::to_string(w) + " of ep " + std::to_string(c.ep) + " x dp " +
                            std::to_string(c.dp) + " (moe_every " + std::to_string(c.moe_every) +
                            (c.grouped ? ", grouped)" : ", one update)");
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, c.ep);
    ASSERT_EQ(groups.expert_parallel->rank(), w % c.ep) << who;
    ASSERT_EQ(groups.expert_data_parallel->rank(), w / c.ep) << who;
    const GradientGroups sums{.data_parallel = &world, .expert_data_parallel = groups.expert_data_parallel.get()};
    const std::unique_ptr<Context> ctx = small_moe_context(c.grouped);
    Rig eager(*ctx, small_moe_config(c.moe_every), local, groups.expert_parallel.get(), sums);
    Rig graphed(*ctx, small_moe_config(c.moe_every), local, groups.expert_parallel.get(), sums);
    steer(*ctx, eager.model, c.routing, c.ep);
    steer(*ctx, graphed.model, c.routing, c.ep);
    ASSERT_EQ(eager.optimizer.group_count() > 0, c.grouped) << who;
    const std::vector<Communicator*> comms = graphed.step.communicators();
    EXPECT_EQ(comms.size(), 3u) << who << ": the EP group, the world and the expert-data-parallel group";
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(*ctx, eager, graphed, want.losses, who, [&](int s) {
      const testing::GlobalBatch b = global_batch(seed.value(), s);
      eager.load(*ctx, b, w * local, local);
      graphed.load(*ctx, b, w * local, local);
    }));
    const std::vector<Parameter*> expert_list = eager.model.expert_parameters();
    const std::unordered_set<const Parameter*> experts(expert_list.begin(), expert_list.end());
    EXPECT_EQ(experts.size(), 4u * static_cast<std::size_t>(c.moe_every == 1 ? 2 : 1)) << who;
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    ASSERT_EQ(pg.size(), want.names.size()) << who;
    std::vector<std::vector<float>> mine;
    for (std::size_t i = 0; i < pg.size(); ++i) {
      ASSERT_EQ(pg[i]->name, want.names[i]) << who;
      const std::vector<float> values = ctx->to_vector<float>(pg[i]->master);
      EXPECT_EQ(values, ctx->to_vector<float>(pe[i]->master)) << who << " " << want.names[i] << ": graph != eager";
      mine.push_back(values);
      if (experts.count(pe[i]) == 0) {
        testing::expect_within(values, want.params[i], 1e-5f, who + " " + want.names[i] + " (replicated)");
        continue;
      }
      if (w == 0) {
        const std::lock_guard<std::mutex> lock(is_expert_mutex);
        is_expert[i] = true;
      }
      ASSERT_EQ(values.size() * static_cast<std::size_t>(c.ep), want.params[i].size()) << who << " " << want.names[i];
      testing::expect_within(values, experts_of(want.params[i], w % c.ep, c.ep), 1e-5f,
                             who + " " + want.names[i] + " (this rank's experts)");
    }
    std::vector<std::vector<float>> expert_grads;
    for (const Parameter* p : expert_list) expert_grads.push_back(ctx->to_vector<float>(p->grad));
    expect_routing(c.routing, w % c.ep, c.ep, expert_grads, who);
    world_params.put(w, std::move(mine));
    eager.step.check_errors(*ctx);
    graphed.step.check_errors(*ctx);
  });
  expect_replicas_agree(world_params, is_expert, c.ep, "after " + std::to_string(kSteps) + " steps");
}

INSTANTIATE_TEST_SUITE_P(Worlds, ExpertDataParallelTrainTest,
                         ::testing::Values(Case{2, 2, 1, true}, Case{2, 2, 2, true}, Case{2, 2, 1, false},
                                           Case{4, 1, 1, true}, Case{1, 4, 1, true}, Case{1, 4, 2, false},
                                           Case{2, 2, 1, true, Routing::kOneRanksExperts},
                                           Case{2, 2, 1, false, Routing::kEmptyExperts},
                                           Case{4, 1, 1, true, Routing::kEmptyExperts}),
                         [](const auto& info) {
                           const Routing routing = info.param.routing;
                           return "ep" + std::to_string(info.param.ep) + "_dp" + std::to_string(info.param.dp) +
                                  "_moe_every" + std::to_string(info.param.moe_every) +
                                  (info.param.grouped ? "_grouped" : "_one_update") +
                                  (routing == Routing::kOneRanksExperts ? "_one_ranks_experts"
                                   : routing == Routing::kEmptyExperts  ? "_empty_experts"
                                                                        : "");
                         });

// The GPT LanguageModel (embedding, attention, MoE blocks) at EP 2 x DP 2:
// each rank its own sequence of the global batch's four, against one process
// on all of them; the same tolerance (the embedding's and attention's
// gradients are replicated: summed in another order).
constexpr std::int64_t kSequences = 4;  // the global batch's
using testing::small_moe_gpt_config;

TEST(ExpertDataParallelGptTrain, EqualsOneProcessOnEveryRanksSequenceAndGraphEqualsEager) {
  const testing::TestSeed seed;
  constexpr int kEp = 2;
  constexpr int kDp = 2;
  constexpr std::int64_t kAll = kSequences * testing::kSmallMoeContext;
  auto batch = [&](int s) { return testing::small_moe_gpt_batch(seed.value(), s, kAll); };
  Reference want;
  {
    const std::unique_ptr<Context> ctx = small_moe_context(true);
    GptRig rig(*ctx, small_moe_gpt_config(), kSequences, nullptr, {});
    for (int s = 0; s < kSteps; ++s) {
      const auto [tokens, labels] = batch(s);
      rig.load(*ctx, tokens, labels, 0, kAll);
      want.losses.push_back(ctx->to_vector<float>(rig.step(*ctx)[0]).at(0));
    }
    for (const Parameter* p : rig.model.parameters()) want.params.push_back(ctx->to_vector<float>(p->master));
  }
  constexpr std::int64_t kLocal = kAll / (kEp * kDp);
  HostWorld::run(kEp * kDp, [&](Communicator& world) {
    const int w = world.rank();
    const std::string who = "rank " + std::to_string(w) + " of ep 2 x dp 2 (GPT)";
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, kEp);
    const GradientGroups sums{.data_parallel = &world, .expert_data_parallel = groups.expert_data_parallel.get()};
    const std::unique_ptr<Context> ctx = small_moe_context(true);
    GptRig eager(*ctx, small_moe_gpt_config(), kSequences / (kEp * kDp), groups.expert_parallel.get(), sums);
    GptRig graphed(*ctx, small_moe_gpt_config(), kSequences / (kEp * kDp), groups.expert_parallel.get(), sums);
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(*ctx, eager, graphed, want.losses, who, [&](int s) {
      const auto [tokens, labels] = batch(s);
      eager.load(*ctx, tokens, labels, w * kLocal, kLocal);
      graphed.load(*ctx, tokens, labels, w * kLocal, kLocal);
    }));
    const std::vector<Parameter*> expert_list = eager.model.expert_parameters();
    const std::unordered_set<const Parameter*> experts(expert_list.begin(), expert_list.end());
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    ASSERT_EQ(pg.size(), want.params.size()) << who;
    for (std::size_t i = 0; i < pg.size(); ++i) {
      const std::vector<float> values = ctx->to_vector<float>(pg[i]->master);
      EXPECT_EQ(values, ctx->to_vector<float>(pe[i]->master)) << who << " " << pg[i]->name << ": graph != eager";
      const std::vector<float> reference =
          experts.count(pe[i]) == 0 ? want.params[i] : experts_of(want.params[i], w % kEp, kEp);
      testing::expect_within(values, reference, 1e-5f, who + " " + pg[i]->name);
    }
    eager.step.check_errors(*ctx);
  });
}

// Where the sums run, in the captured step at EP 2 x DP 2 with the
// optimizer's groups: the experts' gradients (and nothing else) are summed
// over expert_data_parallel, the others (and no expert's) over the world,
// every sum on the communication stream, and an MoE block's expert sum is
// issued as soon as the backward finishes that block: block 1's before
// block 0's expert products' backward, overlapping it.
TEST(ExpertDataParallelTrainSums,
     ExpertsOverTheirGroupAndTheRestOverTheWorldOnTheCommunicationStreamDuringTheBackward) {
  constexpr int kCommStream = 2;
  HostWorld::run(4, [&](Communicator& world) {
    const std::string who = "rank " + std::to_string(world.rank());
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, 2);
    const std::unique_ptr<Context> ctx = small_moe_context(true);
    ASSERT_EQ(ctx->communication_stream(), kCommStream);
    Rig rig(*ctx, small_moe_config(1), kTokens / 4, groups.expert_parallel.get(),
            {.data_parallel = &world, .expert_data_parallel = groups.expert_data_parallel.get()});
    auto graph = CapturedStep::capture(
        *ctx, [&] { return rig.step(*ctx); },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = rig.step.communicators()});
    std::int64_t expert_elements = 0;
    std::int64_t all_elements = 0;
    for (const Parameter* p : rig.model.expert_parameters()) expert_elements += p->value.numel();
    for (const Parameter* p : rig.model.parameters()) all_elements += p->value.numel();
    const Program& program = graph->program();
    std::int64_t over_edp = 0;
    std::int64_t over_world = 0;
    std::vector<std::size_t> edp_sums;  // instruction indices
    std::size_t last_expert_dgrad = 0;
    for (std::size_t i = 0; i < program.instructions().size(); ++i) {
      const Instruction& instruction = program.instructions()[i];
      if (instruction.op->name == "grouped_linear_dgrad") last_expert_dgrad = i;
      if (instruction.op->collective == nullptr || instruction.op->name != "all_reduce_many_") continue;
      EXPECT_EQ(instruction.stream, kCommStream) << who << ": a gradient sum off the communication stream";
      std::int64_t elements = 0;
      for (const ValueId id : instruction.inputs) elements += program.value(id).meta.numel();
      const std::uint64_t comm = instruction.op->collective(instruction.params).communicator;
      if (comm == groups.expert_data_parallel->id()) {
        over_edp += elements;
        edp_sums.push_back(i);
      } else {
        EXPECT_EQ(comm, world.id()) << who << ": a gradient sum over neither the world nor expert_data_parallel";
        over_world += elements;
      }
    }
    EXPECT_EQ(over_edp, expert_elements) << who << ": the experts' gradients, and only they, over expert_data_parallel";
    EXPECT_EQ(over_world, all_elements - expert_elements) << who << ": every other gradient over the world";
    ASSERT_EQ(edp_sums.size(), 2u) << who << ": one expert sum per MoE block";
    EXPECT_LT(edp_sums[0], last_expert_dgrad) << who << ": block 1's experts are summed while block 0's backward runs";
  });
}

// The refusals, on a world of 4 ranks: every rank must raise the same Error
// (a rank that went on would wait in a collective for the others).
void on_four_ranks(const std::function<void(Communicator& world, Context& ctx)>& body) {
  HostWorld::run(4, [&](Communicator& world) {
    Context ctx(Device::kHost);
    SCOPED_TRACE("rank " + std::to_string(world.rank()));
    body(world, ctx);
  });
}

TEST(ExpertDataParallelTrainErrors, AWorldWithoutExpertDataParallelIsRefusedNamingIt) {
  on_four_ranks([](Communicator& world, Context& ctx) {
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, 2);
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, groups.expert_parallel.get());
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6, &world), "data_parallel must be",
                          "GradientGroups::expert_data_parallel");
  });
}

TEST(ExpertDataParallelTrainErrors, SizesThatDoNotMultiplyUpAreRefusedOnEveryRank) {
  on_four_ranks([](Communicator& world, Context& ctx) {
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, 2);
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, groups.expert_parallel.get());
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    // The whole world as the experts' group: 2 x 4 ranks in a world of 4.
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6,
                                         GradientGroups{.data_parallel = &world, .expert_data_parallel = &world}),
                          "data_parallel (world, 4 ranks) must be the expert-parallel group times expert_data_parallel",
                          "expert_data_parallel of 4");
    // The EP group as data_parallel, with an expert-data-parallel group: 2 x 2 ranks in a group of 2.
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6,
                                         GradientGroups{.data_parallel = groups.expert_parallel.get(),
                                                        .expert_data_parallel = groups.expert_data_parallel.get()}),
                          "must be the expert-parallel group times expert_data_parallel");
  });
}

TEST(ExpertDataParallelTrainErrors, ExpertParallelismNotInnermostIsRefusedOnEveryRank) {
  on_four_ranks([](Communicator& world, Context& ctx) {
    const int w = world.rank();
    // EP groups {0, 2} and {1, 3}: each mixes the replicas {0, 1} and {2, 3}.
    const std::unique_ptr<Communicator> ep = world.split(w % 2, w, "ep");
    const std::unique_ptr<Communicator> edp = world.split(w / 2, w, "edp");
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, ep.get());
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6,
                                         GradientGroups{.data_parallel = &world, .expert_data_parallel = edp.get()}),
                          "TrainStep: data_parallel's rank 1 is rank 0 of the model's expert-parallel group",
                          "expert parallelism is innermost", "split_expert_data_parallel");
  });
}

TEST(ExpertDataParallelTrainErrors, GroupsThatMixReplicasAreRefusedOnEveryRank) {
  on_four_ranks([](Communicator& world, Context& ctx) {
    const int w = world.rank();
    // Every rank at its place (EP rank w % 2), but the EP groups are {0, 3}
    // and {2, 1}: each holds one rank of each replica.
    const std::unique_ptr<Communicator> ep = world.split(w == 0 || w == 3 ? 0 : 1, w % 2, "ep");
    const std::unique_ptr<Communicator> edp = world.split(w % 2, w, "edp");
    ASSERT_EQ(ep->rank(), w % 2);
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, ep.get());
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6,
                                         GradientGroups{.data_parallel = &world, .expert_data_parallel = edp.get()}),
                          "TrainStep: the model's expert-parallel group", "must hold this rank's replica",
                          "(found on data_parallel rank 0)");
  });
  on_four_ranks([](Communicator& world, Context& ctx) {
    const int w = world.rank();
    // The EP groups right; the expert-data-parallel groups {0, 3} and {2, 1}
    // pair ranks holding different experts.
    const std::unique_ptr<Communicator> ep = world.split(w / 2, w, "ep");
    const std::unique_ptr<Communicator> edp = world.split(w == 0 || w == 3 ? 0 : 1, w / 2, "edp");
    ASSERT_EQ(edp->rank(), w / 2);
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, ep.get());
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6,
                                         GradientGroups{.data_parallel = &world, .expert_data_parallel = edp.get()}),
                          "TrainStep: expert_data_parallel", "must hold the ranks with this rank's experts",
                          "(found on data_parallel rank 0)");
  });
}

TEST(ExpertDataParallelTrainErrors, ExpertDataParallelNeedsAnExpertParallelModelAndDataParallelWithoutZero1) {
  on_four_ranks([](Communicator& world, Context& ctx) {
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, 2);
    {
      ResidualStack dense_experts(ctx, small_moe_config(1));  // not expert-parallel
      AdamW optimizer(ctx, dense_experts.parameters(), {.lr = 1e-3f});
      EXPECT_ERROR_CONTAINS(TrainStep step(ctx, dense_experts, optimizer, 6,
                                           GradientGroups{.data_parallel = &world,
                                                          .expert_data_parallel = groups.expert_data_parallel.get()}),
                            "expert_data_parallel", "the model is not expert-parallel");
    }
    ResidualStack model(ctx, small_moe_config(1), nullptr, nullptr, groups.expert_parallel.get());
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep step(ctx, model, optimizer, 6,
                                         GradientGroups{.expert_data_parallel = groups.expert_data_parallel.get()}),
                          "expert_data_parallel", "data_parallel is none");
    testing::expect_error_code(
        [&] {
          TrainStep step(ctx, model, optimizer, 6,
                         GradientGroups{.data_parallel = &world,
                                        .mode = DataParallelMode::kZero1,
                                        .expert_data_parallel = groups.expert_data_parallel.get()});
        },
        ErrorCode::kUnsupported, "ZeRO-1");
  });
}

TEST(ExpertDataParallelTrainErrors, SplitNeedsAnExpertParallelSizeDividingTheWorld) {
  on_four_ranks([](Communicator& world, Context&) {
    EXPECT_ERROR_CONTAINS(split_expert_data_parallel(world, 3), "expert-parallel size (3)", "divide");
    EXPECT_ERROR_CONTAINS(split_expert_data_parallel(world, 0), "expert-parallel size (0)");
  });
}

}  // namespace
}  // namespace stepgraph
