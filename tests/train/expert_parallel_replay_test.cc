// Routing that changes on every replay: an expert-parallel step captured once
// and replayed 1,000 times, new inputs copied in before each (so new expert
// choices and new per-rank counts every time), each replay equal to an eager
// run on the same inputs bit for bit. Host thread worlds, tiny sizes:
//   - the MoE layer at EP 2 (fp32, hidden 16, ffn 32, E = 8, top-2, 12
//     tokens a rank), forward and backward: y, dx, the chosen experts, every
//     rank's counts (ep_counts) and every parameter's gradient; the test
//     asserts that the experts chosen differ from the previous replay's on
//     every replay and that the count matrices vary;
//   - TrainStep on a small MoE ResidualStack at EP 2 x DP 2, 1,000 AdamW
//     steps: every step's loss, and every parameter after the last, graph ==
//     eager (the weights move too, so the routing changes twice over).
// A failure names the replay and prints the seed (tests/support/seed.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/moe_mlp.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/moe_train_rig.h"
#include "tests/support/seed.h"
#include "train/expert_data_parallel_groups.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

using testing::read_floats;
using testing::write_floats;

constexpr int kReplays = 1000;
constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kExperts = 8;
constexpr std::int64_t kTokens = 12;  // a rank's

// A difference ends the whole world at once (HostWorld::run rethrows it):
// one message, and no rank left waiting in a collective for a rank that
// stopped.
void require(bool ok, const std::string& what) { SG_CHECK(ok, what); }

// Runs `body` on every rank of a world of `ranks`; a rank's Error becomes one
// test failure (with the seed's note, unlike an exception gtest catches).
void run_world(int ranks, const std::function<void(Communicator&)>& body) {
  try {
    HostWorld::run(ranks, body);
  } catch (const Error& error) {
    ADD_FAILURE() << error.what();
  }
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

std::vector<float> normal(std::mt19937& rng, std::int64_t count) {
  std::normal_distribution<float> draw;
  std::vector<float> out(static_cast<std::size_t>(count));
  for (float& v : out) v = draw(rng);
  return out;
}

// One forward and backward's results.
struct LayerRun {
  std::vector<float> y, dx;
  std::vector<std::int32_t> experts, counts;
  std::vector<std::vector<float>> grads;
};

std::vector<std::vector<float>> gradients(Context& ctx, MoEMLP& layer) {
  std::vector<std::vector<float>> out;
  for (const Parameter* p : layer.parameters()) out.push_back(read_floats(ctx, p->grad));
  return out;
}

TEST(ExpertParallelReplay, MoELayerStepOnNewRoutingEveryReplayEqualsEagerBitForBit) {
  const testing::TestSeed seed;
  constexpr int kRanks = 2;
  const MoEMLPConfig config{.hidden = kHidden, .ffn = 32, .experts = kExperts, .topk = 2, .dtype = DType::kFloat32};
  run_world(kRanks, [&](Communicator& ep) {
    const int r = ep.rank();
    const std::string who = "rank " + std::to_string(r) + " of ep " + std::to_string(kRanks);
    SCOPED_TRACE(who);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    MoEMLP eager(ctx, "moe", config, 23, nullptr, &ep);
    MoEMLP graphed(ctx, "moe", config, 23, nullptr, &ep);
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const MoEMLP::Forward f = graphed.forward(ctx, {x});
                                         const Tensor dx = graphed.backward(ctx, f.saved, {dy});
                                         return std::vector<Tensor>{f.y, dx, f.saved.routed.experts, f.saved.ep_counts};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&ep}});
    std::mt19937 rng(seed.value() + 7919u * static_cast<std::uint32_t>(r));
    std::vector<std::int32_t> previous_experts;
    std::set<std::vector<std::int32_t>> count_patterns;
    for (int replay = 0; replay < kReplays; ++replay) {
      const std::string at = who + ", replay " + std::to_string(replay);
      write_floats(ctx, x, normal(rng, kTokens * kHidden));
      write_floats(ctx, dy, normal(rng, kTokens * kHidden));
      LayerRun want;
      {
        const MoEMLP::Forward f = eager.forward(ctx, {x});
        const Tensor dx = eager.backward(ctx, f.saved, {dy});
        want = {read_floats(ctx, f.y), read_floats(ctx, dx), ctx.to_vector<std::int32_t>(f.saved.routed.experts),
                ctx.to_vector<std::int32_t>(f.saved.ep_counts), gradients(ctx, eager)};
      }
      graph->replay();
      const std::vector<Tensor>& out = graph->outputs();
      const LayerRun got{read_floats(ctx, out[0]), read_floats(ctx, out[1]), ctx.to_vector<std::int32_t>(out[2]),
                         ctx.to_vector<std::int32_t>(out[3]), gradients(ctx, graphed)};
      require(same_bits(got.experts, want.experts), at + ": the graph routed otherwise");
      require(same_bits(got.counts, want.counts), at + ": the graph's counts differ");
      require(same_bits(got.y, want.y), at + ": y, graph != eager");
      require(same_bits(got.dx, want.dx), at + ": dx, graph != eager");
      require(got.grads.size() == want.grads.size(), at + ": gradient count");
      for (std::size_t i = 0; i < got.grads.size(); ++i) {
        require(same_bits(got.grads[i], want.grads[i]),
                at + ": gradient of " + graphed.parameters()[i]->name + ", graph != eager");
      }
      require(got.experts != previous_experts, at + ": the routing did not change");
      previous_experts = got.experts;
      count_patterns.insert(got.counts);
    }
    // Both ranks' counts [2, E] over 1,000 random routings: far more than a
    // handful of patterns (a test whose counts never moved would prove little).
    EXPECT_GT(count_patterns.size(), static_cast<std::size_t>(kReplays / 2)) << "count matrices seen";
    EXPECT_EQ(graph->replay_count(), kReplays);
    eager.check_errors(ctx);
    graphed.check_errors(ctx);
  });
}

// TrainStep at EP 2 x DP 2 on a small MoE stack (both blocks MoE), 1,000
// steps of new batches: eager and graph side by side on every rank.
TEST(ExpertParallelReplay, TrainStepAtEp2Dp2OnNewBatchesEveryReplayEqualsEagerBitForBit) {
  const testing::TestSeed seed;
  constexpr int kEp = 2;
  constexpr int kDp = 2;
  constexpr std::int64_t kVocab = testing::kSmallMoeVocab;
  run_world(kEp * kDp, [&](Communicator& world) {
    const int w = world.rank();
    const std::string who = "rank " + std::to_string(w) + " of ep 2 x dp 2";
    SCOPED_TRACE(who);
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, kEp);
    const GradientGroups sums{.data_parallel = &world, .expert_data_parallel = groups.expert_data_parallel.get()};
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    using Rig = testing::MoeTrainRig<ResidualStack>;
    Rig eager(ctx, testing::small_moe_config(1), kTokens, groups.expert_parallel.get(), sums);
    Rig graphed(ctx, testing::small_moe_config(1), kTokens, groups.expert_parallel.get(), sums);
    auto graph = CapturedStep::capture(
        ctx, [&] { return graphed.step(ctx); },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.step.communicators()});
    std::mt19937 rng(seed.value() + 7919u * static_cast<std::uint32_t>(w));
    std::uniform_int_distribution<std::int32_t> label(0, kVocab - 1);
    std::vector<std::int32_t> labels(kTokens);
    for (int replay = 0; replay < kReplays; ++replay) {
      const std::vector<float> x = normal(rng, kTokens * kHidden);
      for (std::int32_t& l : labels) l = label(rng);
      for (Rig* rig : {&eager, &graphed}) {
        write_floats(ctx, rig->step.inputs(), x);
        ctx.copy_from_host(rig->step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
      }
      const std::vector<float> want = read_floats(ctx, eager.step(ctx)[0]);
      graph->replay();
      require(same_bits(read_floats(ctx, graph->outputs()[0]), want),
              who + ", replay " + std::to_string(replay) + ": loss, graph != eager");
    }
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    for (std::size_t i = 0; i < pg.size(); ++i) {
      EXPECT_TRUE(same_bits(read_floats(ctx, pg[i]->master), read_floats(ctx, pe[i]->master)))
          << pg[i]->name << " after " << kReplays << " steps: graph != eager";
    }
    eager.step.check_errors(ctx);
    graphed.step.check_errors(ctx);
  });
}

}  // namespace
}  // namespace stepgraph
