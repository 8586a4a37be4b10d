// Expert parallelism of MoEMLP (Note [Expert-parallel MoE] in
// layers/moe_mlp.h) on host thread worlds of 2 and 4 ranks, fp32, hidden 16,
// ffn 32, E = 8, top-2, 12 tokens a rank, each rank with its own tokens,
// against one plain layer (the same seed) on the ranks' tokens concatenated in
// rank order, over random routing, every token routed to one rank's experts,
// and experts that receive nothing:
//   - each rank's y and dx rows, and its local experts' weights and weight and
//     bias gradients, equal the plain layer's bit for bit;
//   - the norm's and router's gradients summed over the ranks equal the plain
//     layer's within a tolerance (below);
//   - the captured step equals the eager one bit for bit over 20 replays, new
//     inputs copied in before each;
// each with and without recompute_activation. On the GPU (skipped without
// one): one NCCL rank, captured, equal to the plain bf16 layer bit for bit.
// And GroupedLinear's splits that cover fewer rows than x has (the padding
// rows reach nothing), split_offsets' error word in both modes, and the
// errors.
//
// Tolerance of the summed replicated gradients: 1e-5 of the largest reference
// value (at least 1). The plain layer adds each gradient element's 12 P token
// terms in one sequence; the ranks add 12 each and the test adds the P
// partial sums, the same terms in another order. Every term is the same bits
// on both sides (the routing, gates and d logits are exact: the y and dx
// checks prove it), so the difference is only fp32 rounding of a reordered
// sum of at most 48 terms: a few ulps of the terms' magnitudes, well under
// 1e-5 of the scale. Measured over 3 runs of every case: at most 8.6e-7 of
// the scale. A wrong layer (a rank's tokens lost, gradients scaled by P, the
// router's or the norm's share counted twice) is off by a sizeable part of
// the scale itself.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "kernels/moe_routing.h"
#include "layers/grouped_linear.h"
#include "layers/moe_mlp.h"
#include "ops/moe_ops.h"
#include "tests/layers/moe_one_rank_parity.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::expect_close;
using testing::normal_values;
using testing::read_floats;
using testing::rows;
using testing::write_floats;

constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kFfn = 32;
constexpr std::int64_t kExperts = 8;
constexpr int kTopk = 2;
constexpr std::int64_t kTokens = 12;  // a rank's
constexpr std::uint32_t kLayerSeed = 23;
constexpr int kReplays = 20;

MoEMLPConfig config(bool recompute_activation = false) {
  return {.hidden = kHidden,
          .ffn = kFfn,
          .experts = kExperts,
          .topk = kTopk,
          .dtype = DType::kFloat32,
          .recompute_activation = recompute_activation};
}

// The order of MoEMLP::parameters(): norm gamma, beta, router weight, fc1
// weight, fc1 bias, fc2 weight, fc2 bias.
enum ParamIndex { kGamma, kBeta, kRouter, kFc1Weight, kFc1Bias, kFc2Weight, kFc2Bias, kParams };
const char* const kParamNames[] = {"norm gamma", "norm beta",  "router weight", "fc1 weight",
                                   "fc1 bias",   "fc2 weight", "fc2 bias"};
// Values per expert of each expert parameter.
std::int64_t per_expert(int index) {
  switch (index) {
    case kFc1Weight: return kFfn * kHidden;
    case kFc1Bias: return kFfn;
    case kFc2Weight: return kHidden * kFfn;
    case kFc2Bias: return kHidden;
    default: return 0;
  }
}
bool is_expert_param(int index) { return per_expert(index) > 0; }

enum class Routing {
  kRandom,
  kOneRanksExperts,  // every token to the last rank's experts
  kEmptyExperts,     // experts 1 and E - 1 receive nothing
};

std::string routing_name(Routing routing) {
  switch (routing) {
    case Routing::kRandom: return "random";
    case Routing::kOneRanksExperts: return "one_ranks_experts";
    case Routing::kEmptyExperts: return "empty_experts";
  }
  return "?";
}

// Steers the router through the norm's beta and the router's weight (the same
// values on every rank and in the plain layer): beta[0] = 10 and W[e, 0] =
// push[e] / 10, so expert e's logit moves by about push[e] for every token.
void steer(Context& ctx, MoEMLP& layer, Routing routing, int ranks) {
  if (routing == Routing::kRandom) return;
  std::vector<float> push(kExperts, 0.0f);
  const std::int64_t L = kExperts / ranks;
  for (std::int64_t e = 0; e < kExperts; ++e) {
    if (routing == Routing::kOneRanksExperts) push[e] = e >= (ranks - 1) * L ? 30.0f : 0.0f;
    if (routing == Routing::kEmptyExperts) push[e] = e == 1 || e == kExperts - 1 ? -30.0f : 0.0f;
  }
  const std::vector<Parameter*> params = layer.parameters();
  std::vector<float> beta = read_floats(ctx, params[kBeta]->master);
  beta[0] = 10.0f;
  write_floats(ctx, params[kBeta]->master, beta);
  std::vector<float> w = read_floats(ctx, params[kRouter]->master);  // [E, H]
  for (std::int64_t e = 0; e < kExperts; ++e) w[e * kHidden] = push[e] / 10.0f;
  write_floats(ctx, params[kRouter]->master, w);
}

// One forward and backward: y, dx, the experts chosen and every parameter's
// gradient, in parameters()' order.
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

struct Inputs {
  std::vector<float> x, dy;  // [P * kTokens, kHidden]: every rank's tokens, in rank order
};

class ExpertParallelMoETest : public ::testing::TestWithParam<std::tuple<int, Routing, bool>> {};

TEST_P(ExpertParallelMoETest, EveryRankMatchesOneLayerOnTheGlobalBatchAndItsGraphEqualsEager) {
  const auto [ranks, routing, recompute] = GetParam();
  const testing::TestSeed seed;
  const std::int64_t global = ranks * kTokens;
  const std::int64_t L = kExperts / ranks;

  // The plain layer on the global batch, every round.
  std::vector<Inputs> inputs;
  std::vector<Result> reference;
  std::vector<std::vector<float>> reference_weights;  // initial values, parameters()' order
  {
    Context ctx(Device::kHost);
    MoEMLP layer(ctx, "moe", config(recompute), kLayerSeed);
    steer(ctx, layer, routing, ranks);
    for (const Parameter* p : layer.parameters()) reference_weights.push_back(read_floats(ctx, p->value));
    const Tensor x = ctx.persistent("x", {Shape{global, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{global, kHidden}, DType::kFloat32});
    for (int round = 0; round < kReplays; ++round) {
      inputs.push_back({normal_values(seed.value() + 2 * round, global * kHidden),
                        normal_values(seed.value() + 2 * round + 1, global * kHidden)});
      write_floats(ctx, x, inputs.back().x);
      write_floats(ctx, dy, inputs.back().dy);
      reference.push_back(run(ctx, layer, x, dy));
    }
  }
  // The routing the case is about really happened.
  for (const Result& want : reference) {
    for (const std::int32_t e : want.experts) {
      if (routing == Routing::kOneRanksExperts) {
        ASSERT_GE(e, (ranks - 1) * L) << "a token left the last rank's experts";
      }
      if (routing == Routing::kEmptyExperts) {
        ASSERT_TRUE(e != 1 && e != kExperts - 1) << "expert " << e << " chosen";
      }
    }
  }
  if (routing == Routing::kRandom) {
    ASSERT_NE(reference[0].experts, reference[1].experts) << "rounds route alike";
  }

  // got[round][rank]: each rank's eager results, summed over the ranks below.
  std::vector<std::vector<Result>> got(kReplays, std::vector<Result>(static_cast<std::size_t>(ranks)));
  HostWorld::run(ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    SCOPED_TRACE(testing::seed_note(seed.value()) + ", rank " + std::to_string(r) + " of " + std::to_string(ranks));
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    MoEMLP eager(ctx, "moe", config(recompute), kLayerSeed, nullptr, &comm);
    MoEMLP graphed(ctx, "moe", config(recompute), kLayerSeed, nullptr, &comm);
    steer(ctx, eager, routing, ranks);
    steer(ctx, graphed, routing, ranks);
    // This rank's experts are the plain layer's experts [r L, (r + 1) L); the
    // rest is whole.
    const std::vector<Parameter*> params = eager.parameters();
    ASSERT_EQ(params.size(), static_cast<std::size_t>(kParams));
    for (int i = 0; i < kParams; ++i) {
      const std::vector<float>& whole = reference_weights[i];
      EXPECT_EQ(read_floats(ctx, params[i]->value), is_expert_param(i) ? rows(whole, per_expert(i), r * L, L) : whole)
          << "initial " << kParamNames[i];
    }
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const MoEMLP::Forward f = graphed.forward(ctx, {x});
                                         const Tensor dx = graphed.backward(ctx, f.saved, {dy});
                                         return std::vector<Tensor>{f.y, dx};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    for (int round = 0; round < kReplays; ++round) {
      SCOPED_TRACE("round " + std::to_string(round));
      write_floats(ctx, x, rows(inputs[round].x, kHidden, r * kTokens, kTokens));
      write_floats(ctx, dy, rows(inputs[round].dy, kHidden, r * kTokens, kTokens));
      const Result mine = run(ctx, eager, x, dy);
      const Result& want = reference[round];
      EXPECT_EQ(mine.experts, rows(want.experts, kTopk, r * kTokens, kTokens)) << "routing";
      EXPECT_EQ(mine.y, rows(want.y, kHidden, r * kTokens, kTokens)) << "y rows";
      EXPECT_EQ(mine.dx, rows(want.dx, kHidden, r * kTokens, kTokens)) << "dx rows";
      for (int i = 0; i < kParams; ++i) {
        if (!is_expert_param(i)) continue;
        EXPECT_EQ(mine.grads[i], rows(want.grads[i], per_expert(i), r * L, L))
            << kParamNames[i] << " gradient of experts [" << r * L << ", " << (r + 1) * L << ")";
      }

      graph->replay();
      EXPECT_EQ(read_floats(ctx, graph->outputs()[0]), mine.y) << "graph y";
      EXPECT_EQ(read_floats(ctx, graph->outputs()[1]), mine.dx) << "graph dx";
      const std::vector<Parameter*> graphed_params = graphed.parameters();
      for (int i = 0; i < kParams; ++i) {
        EXPECT_EQ(read_floats(ctx, graphed_params[i]->grad), mine.grads[i])
            << "graph " << kParamNames[i] << " gradient";
      }
      graphed.check_errors(ctx);
      got[round][r] = mine;
    }
  });

  for (int round = 0; round < kReplays; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    for (int i : {kGamma, kBeta, kRouter}) {
      std::vector<float> sum = got[round][0].grads[i];
      for (int r = 1; r < ranks; ++r) {
        for (std::size_t j = 0; j < sum.size(); ++j) sum[j] += got[round][r].grads[i][j];
      }
      expect_close(sum, reference[round].grads[i], std::string(kParamNames[i]) + " gradient summed over the ranks");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ExpertParallelMoETest,
                         ::testing::Combine(::testing::Values(2, 4),
                                            ::testing::Values(Routing::kRandom, Routing::kOneRanksExperts,
                                                              Routing::kEmptyExperts),
                                            ::testing::Values(false, true)),
                         [](const auto& info) {
                           return "ep" + std::to_string(std::get<0>(info.param)) + "_" +
                                  routing_name(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_recompute_activation" : "");
                         });

TEST(ExpertParallelMoEErrorsTest, ExpertsMustDivideByTheRanks) {
  EXPECT_ERROR_CONTAINS(HostWorld::run(3,
                                       [](Communicator& comm) {
                                         Context ctx(Device::kHost);
                                         MoEMLP layer(ctx, "moe", config(), kLayerSeed, nullptr, &comm);
                                       }),
                        "MoEMLP 'moe': experts 8 must divide by the 3 expert-parallel ranks");
}

TEST(ExpertParallelMoEErrorsTest, TensorParallelExpertsAreRefused) {
  EXPECT_ERROR_CONTAINS(HostWorld::run(2,
                                       [](Communicator& comm) {
                                         Context ctx(Device::kHost);
                                         MoEMLP layer(ctx, "moe", config(), kLayerSeed, &comm, &comm);
                                       }),
                        "MoEMLP 'moe': expert parallelism with tensor-parallel experts is not built",
                        "pass either tensor_parallel or expert_parallel");
}

TEST(ExpertParallelMoEErrorsTest, Fp8ExpertsAreRefused) {
  MoEMLPConfig fp8 = config();
  fp8.dtype = DType::kBFloat16;
  fp8.fp8 = Fp8Recipe::current();
  EXPECT_ERROR_CONTAINS(HostWorld::run(2,
                                       [&](Communicator& comm) {
                                         Context ctx(Device::kHost);
                                         MoEMLP layer(ctx, "moe", fp8, kLayerSeed, nullptr, &comm);
                                       }),
                        "MoEMLP 'moe': FP8 experts under expert parallelism are not built", "config.fp8");
}

// On the GPU, one rank through real NCCL: the exchange moves nothing between
// ranks but runs its CUDA kernels (plan, pack, unpack) and the experts run
// with split_sum = kAtMostRows; captured and replayed with new inputs (so the
// routing changes), the bf16 layer equals the plain layer bit for bit, outputs
// and gradients.
TEST(ExpertParallelMoECudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainLayer) {
  SG_SKIP_WITHOUT_GPU();
  testing::expect_moe_equals_plain_at_one_nccl_rank(
      kLayerSeed, [](Context& ctx, const MoEMLPConfig& config, std::uint32_t seed, Communicator& comm) {
        return std::make_unique<MoEMLP>(ctx, "moe", config, seed, nullptr, &comm);
      });
}

// --- GroupedLinear and split_offsets with fewer rows in the splits -----------

constexpr std::int64_t kIn = 16;
constexpr std::int64_t kOut = 8;
constexpr std::int64_t kGroups = 3;

GroupedLinearConfig grouped(kernels::SplitSum sum) {
  return {.experts = kGroups,
          .in_features = kIn,
          .out_features = kOut,
          .dtype = DType::kFloat32,
          .activation = LinearActivation::kGelu,
          .split_sum = sum};
}

struct GroupedResult {
  std::vector<float> y, pre, dx, dw, db;
};

GroupedResult run_grouped(Context& ctx, const GroupedLinear& layer, GroupedLinear& params, const Tensor& x,
                          const Tensor& splits, const Tensor& dy) {
  const GroupedLinear::Forward f = layer.forward(ctx, {x, splits});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  layer.check_splits(ctx);
  return {read_floats(ctx, f.y), read_floats(ctx, f.pre), read_floats(ctx, dx),
          read_floats(ctx, params.parameters()[0]->grad), read_floats(ctx, params.parameters()[1]->grad)};
}

// Rows past the splits' sum hold NaN in x and dy: y, pre and dx are zero
// there, and every product and gradient equals the layer's on the leading
// rows alone, bit for bit.
TEST(GroupedLinearFewerRowsTest, PaddingRowsReachNothing) {
  testing::SeededRng rng;
  const std::vector<std::int32_t> split_sizes{3, 0, 4};
  constexpr std::int64_t kUsed = 7;
  constexpr std::int64_t kRowsWithPadding = 11;
  Context ctx(Device::kHost);
  GroupedLinear padded(ctx, "g", grouped(kernels::SplitSum::kAtMostRows), 5);
  GroupedLinear exact(ctx, "g", grouped(kernels::SplitSum::kEqualsRows), 5);
  const Tensor splits = ctx.persistent("splits", {Shape{kGroups}, DType::kInt32});
  testing::write_values(ctx, splits, split_sizes);
  const std::vector<float> x_used = testing::random_values(kUsed * kIn, rng, 1.0f);
  const std::vector<float> dy_used = testing::random_values(kUsed * kOut, rng, 1.0f);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x_all = x_used, dy_all = dy_used;
  x_all.resize(kRowsWithPadding * kIn, nan);
  dy_all.resize(kRowsWithPadding * kOut, nan);

  const Tensor x = ctx.persistent("x", {Shape{kUsed, kIn}, DType::kFloat32});
  const Tensor dy = ctx.persistent("dy", {Shape{kUsed, kOut}, DType::kFloat32});
  write_floats(ctx, x, x_used);
  write_floats(ctx, dy, dy_used);
  const GroupedResult want = run_grouped(ctx, exact, exact, x, splits, dy);

  const Tensor xp = ctx.persistent("xp", {Shape{kRowsWithPadding, kIn}, DType::kFloat32});
  const Tensor dyp = ctx.persistent("dyp", {Shape{kRowsWithPadding, kOut}, DType::kFloat32});
  write_floats(ctx, xp, x_all);
  write_floats(ctx, dyp, dy_all);
  const GroupedResult got = run_grouped(ctx, padded, padded, xp, splits, dyp);

  auto padded_with_zeros = [](std::vector<float> v, std::int64_t cols) {
    v.resize(kRowsWithPadding * cols, 0.0f);
    return v;
  };
  EXPECT_EQ(got.y, padded_with_zeros(want.y, kOut)) << "y";
  EXPECT_EQ(got.pre, padded_with_zeros(want.pre, kOut)) << "pre";
  EXPECT_EQ(got.dx, padded_with_zeros(want.dx, kIn)) << "dx";
  EXPECT_EQ(got.dw, want.dw) << "weight gradient";
  EXPECT_EQ(got.db, want.db) << "bias gradient";
}

// The error word: with kAtMostRows a sum below the rows is fine, one above
// them or a negative split is an error; with kEqualsRows any other sum is.
TEST(GroupedLinearFewerRowsTest, ErrorWordFlagsASumPastTheRowsOrANegativeSplit) {
  Context ctx(Device::kHost);
  const Tensor word = ctx.persistent("word", {Shape{1}, DType::kInt32});
  const Tensor splits = ctx.persistent("splits", {Shape{3}, DType::kInt32});
  auto bits = [&](std::vector<std::int32_t> sizes, kernels::SplitSum sum) {
    testing::write_values(ctx, splits, sizes);
    testing::write_values(ctx, word, std::vector<std::int32_t>{0});
    const Tensor offsets = ops::split_offsets(ctx, splits, word, 10, sum);
    EXPECT_LE(ctx.to_vector<std::int32_t>(offsets).back(), 10) << "offsets are clamped to the rows";
    return ctx.to_vector<std::int32_t>(word).at(0);
  };
  using kernels::SplitSum;
  EXPECT_EQ(bits({3, 0, 4}, SplitSum::kAtMostRows), 0);
  EXPECT_EQ(bits({3, 3, 4}, SplitSum::kAtMostRows), 0);
  EXPECT_EQ(bits({0, 0, 0}, SplitSum::kAtMostRows), 0);
  EXPECT_EQ(bits({3, 5, 4}, SplitSum::kAtMostRows), kernels::kSplitSumMismatch);
  EXPECT_EQ(bits({3, -1, 4}, SplitSum::kAtMostRows), kernels::kSplitNegative);
  EXPECT_EQ(bits({3, 0, 4}, SplitSum::kEqualsRows), kernels::kSplitSumMismatch);
  EXPECT_EQ(bits({3, 3, 4}, SplitSum::kEqualsRows), 0);

  // Through the layer: check_splits raises on a sum past the rows.
  GroupedLinear layer(ctx, "g", grouped(SplitSum::kAtMostRows), 5);
  const Tensor x = ctx.persistent("x", {Shape{4, kIn}, DType::kFloat32});
  testing::write_values(ctx, splits, std::vector<std::int32_t>{2, 2, 1});
  layer.forward(ctx, {x, splits});
  EXPECT_ERROR_CONTAINS(layer.check_splits(ctx), "GroupedLinear 'g'", "exceeded it");
  layer.check_splits(ctx);  // the word was cleared
}

// The mode is part of split_offsets' params, so a graph key sees it.
TEST(GroupedLinearFewerRowsTest, TheModeIsInTheOpParams) {
  const OpParams exact = ops::SplitOffsetsParams{.tokens = 8};
  const OpParams at_most = ops::SplitOffsetsParams{.tokens = 8, .sum = kernels::SplitSum::kAtMostRows};
  EXPECT_FALSE(exact == at_most);
  EXPECT_NE(exact.to_string(), at_most.to_string());
}

TEST(GroupedLinearFewerRowsTest, HeldExpertsAreCheckedAndRefusedWithTensorParallelismOrFp8Padding) {
  Context ctx(Device::kHost);
  GroupedLinearConfig outside = grouped(kernels::SplitSum::kEqualsRows);
  outside.first_expert = 2;
  outside.held_experts = 2;
  EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "g", outside, 1), "GroupedLinear 'g': first_expert 2 and held_experts 2",
                        "inside [0, experts = 3)");
  GroupedLinearConfig fp8{
      .experts = 2, .in_features = 16, .out_features = 16, .split_sum = kernels::SplitSum::kAtMostRows};
  fp8.fp8 = Fp8Recipe::current();
  EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "g", fp8, 1), "FP8 with split_sum = kAtMostRows is not built");
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    GroupedLinearConfig some{.experts = 4,
                             .in_features = 8,
                             .out_features = 8,
                             .dtype = DType::kFloat32,
                             .parallel = GroupedParallel::kColumn,
                             .first_expert = 2,
                             .held_experts = 2};
    EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "g", some, 1, &comm),
                          "tensor-parallel slices of some of the experts (held_experts 2 of 4) are not built");
  });
}

// The CUDA split_offsets in the fewer-rows mode against the host reference.
TEST(GroupedLinearFewerRowsCudaTest, SplitOffsetsAtMostRowsMatchesTheHost) {
  SG_SKIP_WITHOUT_GPU();
  for (const std::vector<std::int32_t>& sizes :
       {std::vector<std::int32_t>{3, 0, 4}, {3, 3, 4}, {3, 5, 4}, {3, -1, 4}, {0, 0, 0}}) {
    std::vector<std::int32_t> host_offsets, cuda_offsets;
    std::int32_t host_word = 0, cuda_word = 0;
    for (Device device : {Device::kHost, Device::kCuda}) {
      Context ctx(device);
      const Tensor word = ctx.persistent("word", {Shape{1}, DType::kInt32});
      const Tensor splits = ctx.persistent("splits", {Shape{3}, DType::kInt32});
      testing::write_values(ctx, splits, sizes);
      testing::write_values(ctx, word, std::vector<std::int32_t>{0});
      const Tensor offsets = ops::split_offsets(ctx, splits, word, 10, kernels::SplitSum::kAtMostRows);
      (device == Device::kHost ? host_offsets : cuda_offsets) = ctx.to_vector<std::int32_t>(offsets);
      (device == Device::kHost ? host_word : cuda_word) = ctx.to_vector<std::int32_t>(word).at(0);
    }
    EXPECT_EQ(cuda_offsets, host_offsets);
    EXPECT_EQ(cuda_word, host_word);
  }
}

}  // namespace
}  // namespace stepgraph
