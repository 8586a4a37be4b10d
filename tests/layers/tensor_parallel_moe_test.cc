// Tensor and sequence parallelism of MoEMLP (Note [Tensor-parallel MoE] in
// layers/moe_mlp.h) on host thread worlds of 1, 2 and 4 ranks, fp32, top-1
// and top-2, against one rank's plain layer on the same global tokens: each
// rank's output and input-gradient rows, its routing (exactly), its slices of
// the experts' weight gradients and the replicated gradients (norm, router,
// fc2's bias) equal the one-rank layer's; the captured step equals the eager
// one bit for bit on every rank, over inputs that change the routing.
//
// Tolerance: 1e-5 of the largest reference value (at least 1). The routing is
// exact (every rank's router sees the same normed rows, bit for bit, as the
// one-rank router), so what differs is only the order of fp32 additions:
// fc2's partial sums over ffn / N columns added by the reduce-scatter, fc1's
// data gradients likewise, the d gates summed by an all-reduce of per-rank
// dot products, and the norm's gradients summed over token shards. Each is a
// sum of at most a few hundred terms of size ~1, so the difference is a few
// ulps of fp32 (~1e-7 relative); everything downstream of d gates (the
// router's gradients, d normed) inherits that, well under 1e-5. Measured: at
// most 2.4e-7 of the scale (the router's weight gradient, 4 ranks). The faults
// this guards against are off by 1e-1 or more (measured on 2 ranks, top-2, by
// breaking the layer on purpose: fc2's bias added on every rank, d gates not
// all-reduced, the router's d normed added on every rank: 0.11-0.38 in dx).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/grouped_linear.h"
#include "layers/moe_mlp.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/layers/moe_one_rank_parity.h"
#include "tests/layers/shard_values.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::normal_values;
using testing::rows;
using testing::columns;
using testing::expect_close;

using testing::read_floats;
using testing::write_floats;

constexpr std::int64_t kTokens = 32;
constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kFfn = 32;
constexpr std::int64_t kExperts = 4;
constexpr std::uint32_t kLayerSeed = 11;
constexpr int kRounds = 2;  // inputs per test: the captured step is replayed on each

MoEMLPConfig config(int topk) {
  return {.hidden = kHidden, .ffn = kFfn, .experts = kExperts, .topk = topk, .dtype = DType::kFloat32};
}

// One forward and backward: y, dx, the routing and every parameter's gradient
// (norm gamma, beta, router weight, fc1 weight, bias, fc2 weight, bias).
struct Result {
  std::vector<float> y, dx;
  std::vector<std::int32_t> experts;
  std::vector<std::vector<float>> grads;
};

Result run(Context& ctx, MoEMLP& layer, const Tensor& x, const Tensor& dy) {
  const MoEMLP::Forward f = layer.forward(ctx, {x});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  Result r{read_floats(ctx, f.y), read_floats(ctx, dx), ctx.to_vector<std::int32_t>(f.saved.routed.experts), {}};
  for (const Parameter* p : layer.parameters()) r.grads.push_back(read_floats(ctx, p->grad));
  layer.check_errors(ctx);
  return r;
}

// Rank r's part of each of the one-rank layer's gradients (Note
// [Tensor-parallel MoE]): fc1's weight [E, F, H] and bias [E, F] hold rows
// [r f, (r+1) f) of every expert, fc2's weight [E, H, F] the matching columns;
// the rest is whole on every rank.
std::vector<std::vector<float>> gradient_slices(const std::vector<std::vector<float>>& whole, int r, int n) {
  const std::int64_t f = kFfn / n, E = kExperts, H = kHidden, F = kFfn;
  std::vector<std::vector<float>> out = whole;
  out[3] = columns(whole[3], E, F * H, r * f * H, f * H);
  out[4] = columns(whole[4], E, F, r * f, f);
  out[5] = columns(whole[5], E * H, F, r * f, f);
  return out;
}

struct Inputs {
  std::vector<float> x, dy;  // [kTokens, kHidden] each, all the tokens
};

class TensorParallelMoETest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(TensorParallelMoETest, EveryRankMatchesOneRankAndItsGraphEqualsEager) {
  const auto [n, topk] = GetParam();
  const testing::TestSeed seed;
  std::vector<Inputs> inputs;
  std::vector<Result> reference;
  {
    Context ctx(Device::kHost);
    MoEMLP layer(ctx, "moe", config(topk), kLayerSeed);
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
    for (int round = 0; round < kRounds; ++round) {
      inputs.push_back({normal_values(seed.value() + 2 * round, kTokens * kHidden),
                        normal_values(seed.value() + 2 * round + 1, kTokens * kHidden)});
      write_floats(ctx, x, inputs.back().x);
      write_floats(ctx, dy, inputs.back().dy);
      reference.push_back(run(ctx, layer, x, dy));
    }
  }
  ASSERT_NE(reference[0].experts, reference[1].experts) << "the rounds' inputs should route differently";
  const std::int64_t t = kTokens / n;
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    MoEMLP eager(ctx, "moe", config(topk), kLayerSeed, &comm);
    MoEMLP graphed(ctx, "moe", config(topk), kLayerSeed, &comm);
    const Tensor x = ctx.persistent("x", {Shape{t, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{t, kHidden}, DType::kFloat32});
    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const MoEMLP::Forward f = graphed.forward(ctx, {x});
                                         const Tensor dx = graphed.backward(ctx, f.saved, {dy});
                                         return std::vector<Tensor>{f.y, dx, f.saved.routed.experts};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    for (int round = 0; round < kRounds; ++round) {
      SCOPED_TRACE(who + ", round " + std::to_string(round));
      write_floats(ctx, x, rows(inputs[round].x, kHidden, r * t, t));
      write_floats(ctx, dy, rows(inputs[round].dy, kHidden, r * t, t));
      const Result got = run(ctx, eager, x, dy);
      const Result& want = reference[round];
      EXPECT_EQ(got.experts, want.experts) << "every rank routes all the tokens as one rank does";
      expect_close(got.y, rows(want.y, kHidden, r * t, t), "y rows");
      expect_close(got.dx, rows(want.dx, kHidden, r * t, t), "dx rows");
      const std::vector<std::vector<float>> slices = gradient_slices(want.grads, r, n);
      const char* names[] = {"norm gamma (all-reduced)", "norm beta (all-reduced)", "router weight (replicated)",
                             "fc1 weight rows",          "fc1 bias slice",          "fc2 weight columns",
                             "fc2 bias (whole)"};
      ASSERT_EQ(got.grads.size(), slices.size());
      for (std::size_t i = 0; i < slices.size(); ++i) expect_close(got.grads[i], slices[i], names[i]);

      graph->replay();
      EXPECT_EQ(read_floats(ctx, graph->outputs()[0]), got.y) << "graph y";
      EXPECT_EQ(read_floats(ctx, graph->outputs()[1]), got.dx) << "graph dx";
      EXPECT_EQ(ctx.to_vector<std::int32_t>(graph->outputs()[2]), got.experts) << "graph routing";
      const std::vector<Parameter*> params = graphed.parameters();
      for (std::size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(read_floats(ctx, params[i]->grad), got.grads[i]) << "graph gradient " << params[i]->name;
      }
      graphed.check_errors(ctx);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelMoETest,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) + "_top" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(TensorParallelMoEErrorsTest, FfnMustDivideByTheRanks) {
  EXPECT_ERROR_CONTAINS(HostWorld::run(3,
                                       [](Communicator& comm) {
                                         Context ctx(Device::kHost);
                                         MoEMLP layer(ctx, "moe", config(2), kLayerSeed, &comm);
                                       }),
                        "MoEMLP 'moe': ffn 32 must divide by the 3 tensor-parallel ranks");
}

TEST(TensorParallelMoEErrorsTest, GroupedLinearNeedsAShardedSideThatDivides) {
  HostWorld::run(3, [](Communicator& comm) {
    Context ctx(Device::kHost);
    const GroupedLinearConfig whole{.experts = 2, .in_features = 6, .out_features = 4, .dtype = DType::kFloat32};
    EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "g", whole, 1, &comm),
                          "GroupedLinear 'g': a tensor-parallel communicator needs config.parallel");
    GroupedLinearConfig column = whole;
    column.parallel = GroupedParallel::kColumn;
    EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "g", column, 1, &comm),
                          "GroupedLinear 'g': out_features 4 must divide by the 3 tensor-parallel ranks");
    GroupedLinearConfig row = whole;
    row.parallel = GroupedParallel::kRow;
    const GroupedLinear ok(ctx, "g", row, 1, &comm);  // in_features 6 divides by 3
    EXPECT_EQ(ok.local_in(), 2);
    EXPECT_EQ(ok.local_out(), 4);
  });
}

// A layer built for tensor parallelism with no communicator is the plain
// layer, bit for bit (the same parameters, the same results).
TEST(TensorParallelMoEErrorsTest, ShardedGroupedLinearConfigWithoutCommunicatorIsWhole) {
  Context ctx(Device::kHost);
  GroupedLinearConfig row{.experts = 2, .in_features = 6, .out_features = 4, .dtype = DType::kFloat32};
  GroupedLinear plain(ctx, "g", row, 5);
  row.parallel = GroupedParallel::kRow;
  GroupedLinear sharded(ctx, "g", row, 5);
  const std::vector<Parameter*> a = sharded.parameters();
  const std::vector<Parameter*> b = plain.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(read_floats(ctx, a[i]->value), read_floats(ctx, b[i]->value));
}

// On the GPU, one rank through real NCCL: the layer's all-gathers,
// reduce-scatters and all-reduces are identities, captured into the graph;
// replayed with new inputs (so the routing changes), the bf16 layer equals the
// plain layer bit for bit, outputs and gradients.
TEST(TensorParallelMoECudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainLayer) {
  SG_SKIP_WITHOUT_GPU();
  testing::expect_moe_equals_plain_at_one_nccl_rank(
      kLayerSeed, [](Context& ctx, const MoEMLPConfig& config, std::uint32_t seed, Communicator& comm) {
        return std::make_unique<MoEMLP>(ctx, "moe", config, seed, &comm);
      });
}

}  // namespace
}  // namespace stepgraph
