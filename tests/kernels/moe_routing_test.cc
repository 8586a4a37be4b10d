// MoE routing kernels. CPU: the host references against hand-computed cases
// (ties, NaN, empty experts, all tokens to one expert, k = 1 and 2, bad splits,
// out-of-range experts), the router backward against finite differences, and
// the argument checks. GPU: every kernel against the host reference on fresh
// random inputs (integers bit-identical, floats within tolerance), ragged
// sizes (more entries than one plan chunk, hidden not a multiple of the
// vector width), many experts and forced ties.
#include "kernels/moe_routing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::floats;
using testing::HostArray;
using testing::relative_error;
using testing::tolerance_for;

using Ints = std::vector<std::int32_t>;

struct Routed {
  Ints experts;
  std::vector<float> gates;
};

Routed route_host(const std::vector<float>& logits, std::int64_t tokens, std::int64_t experts, int topk) {
  Routed out{Ints(tokens * topk), std::vector<float>(tokens * topk)};
  host::router_topk({DType::kFloat32, tokens, experts, topk}, logits.data(), out.experts.data(), out.gates.data());
  return out;
}

struct Plan {
  Ints splits, offsets, positions, sources;
  std::int32_t error = 0;
};

Plan plan_host(const Ints& experts, std::int64_t tokens, std::int64_t num_experts, int topk) {
  Plan p{Ints(num_experts), Ints(num_experts + 1), Ints(tokens * topk), Ints(tokens * topk)};
  host::moe_plan({tokens, num_experts, topk}, experts.data(), p.splits.data(), p.offsets.data(), p.positions.data(),
                 p.sources.data(), &p.error);
  return p;
}

TEST(MoERoutingHostTest, Top1PicksTheLargestLogitAndTiesGoToTheLowerExpert) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {1,   3,  3, 0,  //
                                     0,   0,  0, 0,  //
                                     nan, -1, 5, 2};
  const Routed r = route_host(logits, 3, 4, 1);
  EXPECT_EQ(r.experts, (Ints{1, 0, 2}));
  const double e = std::exp(1.0);
  EXPECT_NEAR(r.gates[0], std::exp(3.0) / (e + 2 * std::exp(3.0) + 1.0), 1e-6);
  EXPECT_NEAR(r.gates[1], 0.25, 1e-7);
  EXPECT_TRUE(std::isnan(r.gates[2])) << "a NaN logit poisons the softmax, it is not hidden";
}

TEST(MoERoutingHostTest, Top2RenormalizesOverTheTwoChosen) {
  const std::vector<float> logits = {1, 3,  3, 0,  //
                                     0, 0,  0, 0,  //
                                     2, -1, 5, 2};
  const Routed r = route_host(logits, 3, 4, 2);
  EXPECT_EQ(r.experts, (Ints{1, 2, 0, 1, 2, 0}));
  EXPECT_NEAR(r.gates[0], 0.5, 1e-7);
  EXPECT_NEAR(r.gates[1], 0.5, 1e-7);
  EXPECT_NEAR(r.gates[2], 0.5, 1e-7);
  EXPECT_NEAR(r.gates[4], 1.0 / (1.0 + std::exp(-3.0)), 1e-6);
  EXPECT_NEAR(r.gates[4] + r.gates[5], 1.0, 1e-6);
}

TEST(MoERoutingHostTest, PlanIsStableAndKeepsEmptyExperts) {
  // (token, slot) entries: 0:1 1:2 | 2:0 3:1 | 4:2 5:1 | 6:1 7:0; expert 3 gets nothing.
  const Plan p = plan_host({1, 2, 0, 1, 2, 1, 1, 0}, 4, 4, 2);
  EXPECT_EQ(p.splits, (Ints{2, 4, 2, 0}));
  EXPECT_EQ(p.offsets, (Ints{0, 2, 6, 8, 8}));
  EXPECT_EQ(p.positions, (Ints{2, 6, 0, 3, 7, 4, 5, 1}));
  EXPECT_EQ(p.sources, (Ints{1, 3, 0, 1, 2, 3, 0, 2}));
  EXPECT_EQ(p.error, 0);
}

TEST(MoERoutingHostTest, PlanWithEveryTokenOnOneExpert) {
  const Plan p = plan_host({2, 2, 2, 2, 2}, 5, 3, 1);
  EXPECT_EQ(p.splits, (Ints{0, 0, 5}));
  EXPECT_EQ(p.offsets, (Ints{0, 0, 0, 5}));
  EXPECT_EQ(p.positions, (Ints{0, 1, 2, 3, 4}));
  EXPECT_EQ(p.sources, (Ints{0, 1, 2, 3, 4}));
}

TEST(MoERoutingHostTest, OutOfRangeExpertSetsTheWordAndStaysInBounds) {
  const Plan p = plan_host({1, 7, -1, 0}, 4, 2, 1);
  EXPECT_EQ(p.error, kExpertOutOfRange);
  EXPECT_EQ(p.splits, (Ints{3, 1}));  // the bad ones counted as expert 0
  EXPECT_EQ(p.offsets, (Ints{0, 3, 4}));
}

struct Offsets {
  Ints offsets;
  std::int32_t error = 0;
};

Offsets offsets_host(const Ints& splits, std::int64_t tokens) {
  Offsets o{Ints(splits.size() + 1)};
  host::split_offsets(static_cast<std::int64_t>(splits.size()), tokens, splits.data(), o.offsets.data(), &o.error);
  return o;
}

TEST(MoERoutingHostTest, SplitOffsetsValidateAndClamp) {
  Offsets good = offsets_host({2, 0, 3}, 5);
  EXPECT_EQ(good.offsets, (Ints{0, 2, 2, 5}));
  EXPECT_EQ(good.error, 0);
  Offsets negative = offsets_host({3, -1, 3}, 5);  // sums to 5, but one is negative
  EXPECT_EQ(negative.error, kSplitNegative);
  EXPECT_EQ(negative.offsets, (Ints{0, 3, 3, 5}));
  Offsets short_sum = offsets_host({1, 1, 1}, 5);
  EXPECT_EQ(short_sum.error, kSplitSumMismatch);
  EXPECT_EQ(short_sum.offsets, (Ints{0, 1, 2, 3}));
  Offsets long_sum = offsets_host({4, 4}, 5);
  EXPECT_EQ(long_sum.error, kSplitSumMismatch);
  EXPECT_EQ(long_sum.offsets, (Ints{0, 4, 5}));
}

TEST(MoERoutingHostTest, PermuteUnpermuteAndBackwardByHand) {
  // experts [[1, 0], [0, 1]], E = 2: rows are entries 1, 2 (expert 0) then 0, 3.
  const Plan p = plan_host({1, 0, 0, 1}, 2, 2, 2);
  ASSERT_EQ(p.positions, (Ints{2, 0, 1, 3}));
  ASSERT_EQ(p.sources, (Ints{0, 1, 0, 1}));
  const PermuteDesc desc{DType::kFloat32, 2, 2, 2};
  const std::vector<float> x = {1, 2, 3, 4};
  std::vector<float> x_perm(8);
  host::moe_permute(desc, x.data(), p.sources.data(), x_perm.data());
  EXPECT_EQ(x_perm, (std::vector<float>{1, 2, 3, 4, 1, 2, 3, 4}));

  const std::vector<float> y_perm = {10, 20, 30, 40, 50, 60, 70, 80};
  const std::vector<float> gates = {0.25f, 0.75f, 0.5f, 0.5f};
  std::vector<float> y(4);
  host::moe_unpermute(desc, y_perm.data(), p.positions.data(), gates.data(), y.data());
  EXPECT_EQ(y, (std::vector<float>{20, 30, 50, 60}));
  host::moe_unpermute(desc, y_perm.data(), p.positions.data(), nullptr, y.data());
  EXPECT_EQ(y, (std::vector<float>{60, 80, 100, 120}));

  const std::vector<float> dy = {1, 0, 0, 2};
  std::vector<float> dy_perm(8), dgates(4);
  host::moe_unpermute_backward(desc, dy.data(), y_perm.data(), p.positions.data(), gates.data(), dy_perm.data(),
                               dgates.data());
  EXPECT_EQ(dy_perm, (std::vector<float>{0.75f, 0, 0, 1, 0.25f, 0, 0, 1}));
  EXPECT_EQ(dgates, (std::vector<float>{50, 10, 80, 160}));
}

// L = sum(dg * gates) against central differences of the logits.
void check_router_backward(int topk) {
  testing::SeededRng rng;
  constexpr std::int64_t kTokens = 5, kExperts = 6;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> logits(kTokens * kExperts);
  // Logits 0.5 apart (shuffled) keep the top-k choice fixed under the step.
  for (std::int64_t t = 0; t < kTokens; ++t) {
    std::vector<float> row;
    for (std::int64_t e = 0; e < kExperts; ++e) row.push_back(0.5f * static_cast<float>(e) + 0.1f * uniform(rng));
    std::shuffle(row.begin(), row.end(), rng);
    std::copy(row.begin(), row.end(), logits.begin() + t * kExperts);
  }
  std::vector<float> dg(kTokens * topk);
  for (float& v : dg) v = uniform(rng);
  const RouterDesc desc{DType::kFloat32, kTokens, kExperts, topk};
  const Routed r = route_host(logits, kTokens, kExperts, topk);
  std::vector<float> dlogits(logits.size());
  host::router_backward(desc, dg.data(), logits.data(), r.experts.data(), r.gates.data(), dlogits.data());
  auto loss = [&](const std::vector<float>& l) {
    const Routed routed = route_host(l, kTokens, kExperts, topk);
    EXPECT_EQ(routed.experts, r.experts);
    double total = 0;
    for (std::size_t i = 0; i < dg.size(); ++i) total += static_cast<double>(dg[i]) * routed.gates[i];
    return total;
  };
  constexpr float kStep = 1e-2f;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    std::vector<float> up = logits, down = logits;
    up[i] += kStep;
    down[i] -= kStep;
    const double numeric = (loss(up) - loss(down)) / (2.0 * kStep);
    EXPECT_NEAR(dlogits[i], numeric, 2e-3) << "k=" << topk << " dlogits[" << i << "]";
  }
}

TEST(MoERoutingHostTest, RouterBackwardMatchesFiniteDifferencesTop1) { check_router_backward(1); }
TEST(MoERoutingHostTest, RouterBackwardMatchesFiniteDifferencesTop2) { check_router_backward(2); }

TEST(MoERoutingHostTest, BadArgumentsAreErrors) {
  using testing::expect_invalid_argument;
  expect_invalid_argument([] { check_router({DType::kFloat32, 4, 4, 3}); }, "router_topk: topk must be in [1, 2], got 3");
  expect_invalid_argument([] { check_router({DType::kFloat32, 4, 1, 2}); }, "experts must be in [topk = 2, ");
  expect_invalid_argument([] { check_router({DType::kInt32, 4, 4, 1}); }, "logits must be bf16, fp16 or fp32, got int32");
  expect_invalid_argument([] { check_router({DType::kFloat32, 4, kMaxExperts + 1, 1}); },
                          "], got " + std::to_string(kMaxExperts + 1));
  expect_invalid_argument([] { check_plan({0, 4, 1}); }, "moe_plan: tokens * topk must be in [1, 2^31), got 0 tokens");
  expect_invalid_argument([] { check_permute({DType::kFloat32, 4, 0, 1}); }, "moe_permute: hidden must be in [1, 2^31), got 0");
}

// ---- GPU: every kernel against the host reference ----

template <typename T>
void upload(DeviceArray& out, const std::vector<T>& values) {
  SG_CUDA_CHECK(cudaMemcpy(out.get(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
std::vector<T> host_of(const DeviceArray& array, std::size_t n) {
  SG_CUDA_CHECK(cudaDeviceSynchronize());  // our kernels run on a non-blocking stream
  std::vector<T> out(n);
  SG_CUDA_CHECK(cudaMemcpy(out.data(), array.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

void zero(DeviceArray& array) {
  SG_CUDA_CHECK(cudaMemset(array.get(), 0, array.bytes()));
  SG_CUDA_CHECK(cudaDeviceSynchronize());
}

// Logits from a small set of values, so ties are frequent (and exact in bf16).
HostArray tied_logits(DType dtype, std::int64_t n, std::mt19937& rng) {
  HostArray out(dtype, n);
  std::uniform_int_distribution<int> level(-4, 4);
  for (std::int64_t i = 0; i < n; ++i) out.set(i, 0.25f * static_cast<float>(level(rng)));
  return out;
}

struct Case {
  DType dtype;
  std::int64_t tokens;
  std::int64_t experts;
  int topk;
  std::int64_t hidden;
};

std::string name(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.experts) +
         " k=" + std::to_string(c.topk) + " H=" + std::to_string(c.hidden);
}

void check_case_on_gpu(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(name(c));
  Stream stream;
  const std::int64_t T = c.tokens, E = c.experts, n = T * c.topk, H = c.hidden;
  const RouterDesc rdesc{c.dtype, T, E, c.topk};
  const HostArray logits = tied_logits(c.dtype, T * E, rng);

  // Router forward: experts bit-identical, gates close.
  Ints want_experts(n);
  std::vector<float> want_gates(n);
  host::router_topk(rdesc, logits.data(), want_experts.data(), want_gates.data());
  DeviceArray d_logits(logits), d_experts(n * 4), d_gates(n * 4);
  d_experts.poison();
  d_gates.poison();
  launch_router_topk(rdesc, d_logits.get(), d_experts.as<std::int32_t>(), d_gates.as<float>(), stream.get());
  ASSERT_EQ(host_of<std::int32_t>(d_experts, n), want_experts);
  EXPECT_LE(relative_error(host_of<float>(d_gates, n), want_gates), 1e-4);

  // Router backward.
  const HostArray dg = testing::random_array(DType::kFloat32, n, rng);
  HostArray want_dlogits(c.dtype, T * E);
  host::router_backward(rdesc, static_cast<const float*>(dg.data()), logits.data(), want_experts.data(),
                        want_gates.data(), want_dlogits.data());
  DeviceArray d_dg(dg), d_dlogits(want_dlogits.bytes.size());
  d_dlogits.poison();
  launch_router_backward(rdesc, d_dg.as<float>(), d_logits.get(), d_experts.as<std::int32_t>(), d_gates.as<float>(),
                         d_dlogits.get(), stream.get());
  EXPECT_LE(relative_error(d_dlogits.download(c.dtype, T * E).to_floats(), want_dlogits.to_floats()),
            std::max(1e-5, tolerance_for(c.dtype)));

  // Plan: bit-identical, error word untouched.
  const PlanDesc pdesc{T, E, c.topk};
  const Plan want = plan_host(want_experts, T, E, c.topk);
  DeviceArray d_splits(E * 4), d_offsets((E + 1) * 4), d_positions(n * 4), d_sources(n * 4), d_word(4),
      d_workspace(moe_plan_workspace_bytes(pdesc));
  for (DeviceArray* a : {&d_splits, &d_offsets, &d_positions, &d_sources, &d_workspace}) a->poison();
  zero(d_word);
  launch_moe_plan(pdesc, d_experts.as<std::int32_t>(), d_splits.as<std::int32_t>(), d_offsets.as<std::int32_t>(),
                  d_positions.as<std::int32_t>(), d_sources.as<std::int32_t>(), d_workspace.get(),
                  d_word.as<std::int32_t>(), stream.get());
  EXPECT_EQ(host_of<std::int32_t>(d_splits, E), want.splits);
  EXPECT_EQ(host_of<std::int32_t>(d_offsets, E + 1), want.offsets);
  EXPECT_EQ(host_of<std::int32_t>(d_positions, n), want.positions);
  EXPECT_EQ(host_of<std::int32_t>(d_sources, n), want.sources);
  EXPECT_EQ(host_of<std::int32_t>(d_word, 1)[0], 0);

  // Permute (exact), unpermute with and without gates, unpermute backward.
  const PermuteDesc mdesc{c.dtype, T, H, c.topk};
  const HostArray x = testing::random_array(c.dtype, T * H, rng);
  HostArray want_perm(c.dtype, n * H);
  host::moe_permute(mdesc, x.data(), want.sources.data(), want_perm.data());
  DeviceArray d_x(x), d_perm(want_perm.bytes.size());
  d_perm.poison();
  launch_moe_permute(mdesc, d_x.get(), d_sources.as<std::int32_t>(), d_perm.get(), stream.get());
  EXPECT_EQ(d_perm.download(c.dtype, n * H).bytes, want_perm.bytes);

  const HostArray y_perm = testing::random_array(c.dtype, n * H, rng);
  DeviceArray d_y_perm(y_perm), d_y(T * H * dtype_size(c.dtype));
  for (const float* gates : {static_cast<const float*>(want_gates.data()), static_cast<const float*>(nullptr)}) {
    HostArray want_y(c.dtype, T * H);
    host::moe_unpermute(mdesc, y_perm.data(), want.positions.data(), gates, want_y.data());
    d_y.poison();
    launch_moe_unpermute(mdesc, d_y_perm.get(), d_positions.as<std::int32_t>(),
                         gates != nullptr ? d_gates.as<float>() : nullptr, d_y.get(), stream.get());
    EXPECT_LE(relative_error(d_y.download(c.dtype, T * H).to_floats(), want_y.to_floats()), tolerance_for(c.dtype))
        << (gates != nullptr ? "gated" : "ungated");
  }

  const HostArray dy = testing::random_array(c.dtype, T * H, rng);
  HostArray want_dy_perm(c.dtype, n * H);
  std::vector<float> want_dgates(n);
  host::moe_unpermute_backward(mdesc, dy.data(), y_perm.data(), want.positions.data(), want_gates.data(),
                               want_dy_perm.data(), want_dgates.data());
  DeviceArray d_dy(dy), d_dy_perm(want_dy_perm.bytes.size()), d_dgates(n * 4);
  d_dy_perm.poison();
  d_dgates.poison();
  launch_moe_unpermute_backward(mdesc, d_dy.get(), d_y_perm.get(), d_positions.as<std::int32_t>(), d_gates.as<float>(),
                                d_dy_perm.get(), d_dgates.as<float>(), stream.get());
  EXPECT_LE(relative_error(d_dy_perm.download(c.dtype, n * H).to_floats(), want_dy_perm.to_floats()),
            tolerance_for(c.dtype));
  EXPECT_LE(relative_error(host_of<float>(d_dgates, n), want_dgates), 1e-4);
}

TEST(MoERoutingCudaTest, EveryKernelMatchesTheHostReference) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const std::vector<Case> cases = {
      {DType::kFloat32, 7, 4, 1, 13},        // scalar rows, fewer tokens than a warp
      {DType::kBFloat16, 300, 8, 2, 64},     // vector rows
      {DType::kBFloat16, 4099, 8, 2, 24},    // 8198 entries: several plan chunks, a partial one
      {DType::kFloat16, 2049, 128, 1, 40},   // many experts, many of them empty
      {DType::kBFloat16, 1500, 1000, 2, 8},  // near kMaxExperts
      {DType::kFloat32, 33, 2, 2, 4},        // k = E
  };
  for (const Case& c : cases) check_case_on_gpu(c, rng);
}

TEST(MoERoutingCudaTest, AllTokensToOneExpertAndOutOfRangeExperts) {
  SG_SKIP_WITHOUT_GPU();
  Stream stream;
  constexpr std::int64_t kTokens = 3000, kExperts = 16;
  for (const std::int32_t bad : {-1, 0, 16}) {
    Ints chosen(kTokens, 5);
    chosen[1234] = bad;  // 0: in range, moves one token to expert 0
    const Plan want = plan_host(chosen, kTokens, kExperts, 1);
    const PlanDesc desc{kTokens, kExperts, 1};
    DeviceArray d_chosen(kTokens * 4);
    upload(d_chosen, chosen);
    DeviceArray d_splits(kExperts * 4), d_offsets((kExperts + 1) * 4), d_positions(kTokens * 4), d_sources(kTokens * 4),
        d_word(4), d_workspace(moe_plan_workspace_bytes(desc));
    zero(d_word);
    launch_moe_plan(desc, d_chosen.as<std::int32_t>(), d_splits.as<std::int32_t>(), d_offsets.as<std::int32_t>(),
                    d_positions.as<std::int32_t>(), d_sources.as<std::int32_t>(), d_workspace.get(),
                    d_word.as<std::int32_t>(), stream.get());
    EXPECT_EQ(host_of<std::int32_t>(d_splits, kExperts), want.splits) << "bad=" << bad;
    EXPECT_EQ(host_of<std::int32_t>(d_positions, kTokens), want.positions) << "bad=" << bad;
    EXPECT_EQ(host_of<std::int32_t>(d_sources, kTokens), want.sources) << "bad=" << bad;
    EXPECT_EQ(host_of<std::int32_t>(d_word, 1)[0], want.error) << "bad=" << bad;
    EXPECT_EQ(want.error, bad == 0 ? 0 : kExpertOutOfRange);
  }
}

TEST(MoERoutingCudaTest, SplitOffsetsMatchTheHostOnGoodAndBadSplits) {
  SG_SKIP_WITHOUT_GPU();
  Stream stream;
  testing::SeededRng rng;
  for (const std::int64_t experts : {1, 3, 128, 1000, 1024}) {
    for (int variant = 0; variant < 4; ++variant) {
      std::uniform_int_distribution<int> size(0, 50);
      Ints splits(experts);
      std::int64_t tokens = 0;
      for (auto& s : splits) tokens += (s = size(rng));
      if (variant == 1) splits[experts / 2] = -3;  // negative
      if (variant == 2) tokens += 1;               // sum short of the tokens
      if (variant == 3) tokens = tokens / 2;       // sum beyond: clamped
      const Offsets want = offsets_host(splits, tokens);
      DeviceArray d_splits(experts * 4), d_offsets((experts + 1) * 4), d_word(4);
      upload(d_splits, splits);
      d_offsets.poison();
      zero(d_word);
      launch_split_offsets(experts, tokens, d_splits.as<std::int32_t>(), d_offsets.as<std::int32_t>(),
                           d_word.as<std::int32_t>(), stream.get());
      EXPECT_EQ(host_of<std::int32_t>(d_offsets, experts + 1), want.offsets) << "E=" << experts << " v=" << variant;
      EXPECT_EQ(host_of<std::int32_t>(d_word, 1)[0], want.error) << "E=" << experts << " v=" << variant;
    }
  }
}

}  // namespace
}  // namespace stepgraph::kernels
