// MoEMLP. Host: the forward against a per-token reference written from the
// parameters (norm, router softmax/top-k, each chosen expert's MLP, gates),
// every gradient against central finite differences (fp32, k = 1 and 2;
// perturbations that change the expert choice are drawn again), a captured
// fwd+bwd step replayed with new inputs each replay (so the routing and the
// splits change) equal to eager, bit for bit, and build-time errors. GPU: the
// same graphed-vs-eager check over 100 replays, and cuda against host.
#include "layers/moe_mlp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "graphs/captured_step.h"
#include "tests/layers/gradient_check.h"
#include "tests/layers/tensor_io.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using testing::GradientCheck;
using testing::read_floats;
using testing::write_floats;

MoEMLPConfig small_config(int topk, DType dtype) {
  return {.hidden = 8, .ffn = 12, .experts = 4, .topk = topk, .dtype = dtype};
}

// y for one layer from its parameters (fp32 master values), token by token.
std::vector<double> reference_forward(Context& ctx, MoEMLP& layer, const std::vector<float>& x, std::int64_t tokens) {
  const MoEMLPConfig& c = layer.config();
  const std::int64_t H = c.hidden, F = c.ffn, E = c.experts;
  std::vector<std::vector<float>> p;  // gamma, beta, router, w1, b1, w2, b2
  for (Parameter* param : layer.parameters()) p.push_back(read_floats(ctx, param->master));
  const auto &gamma = p[0], &beta = p[1], &router = p[2], &w1 = p[3], &b1 = p[4], &w2 = p[5], &b2 = p[6];
  std::vector<double> y(static_cast<std::size_t>(tokens * H), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    double mean = 0, var = 0;
    for (std::int64_t h = 0; h < H; ++h) mean += x[t * H + h];
    mean /= H;
    for (std::int64_t h = 0; h < H; ++h) var += (x[t * H + h] - mean) * (x[t * H + h] - mean);
    const double rstd = 1.0 / std::sqrt(var / H + c.eps);
    std::vector<double> n(H), logits(E, 0.0);
    for (std::int64_t h = 0; h < H; ++h) n[h] = (x[t * H + h] - mean) * rstd * gamma[h] + beta[h];
    for (std::int64_t e = 0; e < E; ++e) {
      for (std::int64_t h = 0; h < H; ++h) logits[e] += n[h] * router[e * H + h];
    }
    std::vector<std::int64_t> order(E);
    for (std::int64_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return logits[a] > logits[b]; });
    double sum_all = 0, sum_chosen = 0;
    for (std::int64_t e = 0; e < E; ++e) sum_all += std::exp(logits[e] - logits[order[0]]);
    for (int j = 0; j < c.topk; ++j) sum_chosen += std::exp(logits[order[j]] - logits[order[0]]);
    for (int j = 0; j < c.topk; ++j) {
      const std::int64_t e = order[j];
      const double gate = std::exp(logits[e] - logits[order[0]]) / (c.topk == 1 ? sum_all : sum_chosen);
      std::vector<double> act(F);
      for (std::int64_t f = 0; f < F; ++f) {
        double pre = b1[e * F + f];
        for (std::int64_t h = 0; h < H; ++h) pre += n[h] * w1[(e * F + f) * H + h];
        act[f] = testing::gelu_double(pre);
      }
      for (std::int64_t h = 0; h < H; ++h) {
        double out = b2[e * H + h];
        for (std::int64_t f = 0; f < F; ++f) out += act[f] * w2[(e * H + h) * F + f];
        y[t * H + h] += gate * out;
      }
    }
  }
  return y;
}

TEST(MoEMLPHostTest, ForwardMatchesAPerTokenReference) {
  for (const int topk : {1, 2}) {
    SCOPED_TRACE("k=" + std::to_string(topk));
    Context ctx(Device::kHost);
    GradientCheck check(ctx);
    MoEMLP layer(ctx, "moe", small_config(topk, DType::kFloat32), 7);
    constexpr std::int64_t kTokens = 9;
    const Tensor x = check.random_tensor("x", Shape{kTokens, 8});
    const std::vector<float> got = read_floats(ctx, layer.forward(ctx, {x}).y);
    const std::vector<double> want = reference_forward(ctx, layer, read_floats(ctx, x), kTokens);
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-4) << "y[" << i << "]";
  }
}

void check_gradients(int topk) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  MoEMLP layer(ctx, "moe", small_config(topk, DType::kFloat32), 5);
  constexpr std::int64_t kTokens = 6, kHidden = 8;
  const Tensor x = check.random_tensor("x", Shape{kTokens, kHidden});
  const std::vector<float> r = check.random_values(kTokens * kHidden);
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
  testing::write_values(ctx, dy, r);
  const MoEMLP::Forward f = layer.forward(ctx, {x});
  const std::vector<std::int32_t> routing = ctx.to_vector<std::int32_t>(f.saved.routed.experts);
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  std::vector<std::int32_t> last_routing;
  auto forward = [&] {
    const MoEMLP::Forward g = layer.forward(ctx, {x});
    last_routing = ctx.to_vector<std::int32_t>(g.saved.routed.experts);
    return g.y;
  };
  auto same_routing = [&] { return last_routing == routing; };
  check.expect_matches("dx", x, read_floats(ctx, dx), forward, r, same_routing, 1e-3f);
  for (Parameter* p : layer.parameters()) {
    check.expect_matches(p->name, p->master, read_floats(ctx, p->grad), forward, r, same_routing, 1e-3f);
  }
  layer.check_errors(ctx);
}

TEST(MoEMLPHostTest, GradientsMatchFiniteDifferencesTop1Fp32) { check_gradients(1); }
TEST(MoEMLPHostTest, GradientsMatchFiniteDifferencesTop2Fp32) { check_gradients(2); }

// A fwd+bwd step of one layer captured once and replayed `replays` times,
// each replay with new inputs (so the routing and the splits change), against
// the same step run eagerly on the same inputs: outputs and gradients equal
// bit for bit after every replay.
void expect_graph_equals_eager(Device device, DType dtype, int replays) {
  Context ctx(device);
  constexpr std::int64_t kTokens = 96, kHidden = 64;
  MoEMLP layer(ctx, "moe", {.hidden = kHidden, .ffn = 32, .experts = 8, .topk = 2, .dtype = dtype}, 3);
  const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, dtype});
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, dtype});
  auto step = [&] {
    const MoEMLP::Forward f = layer.forward(ctx, {x});
    const Tensor dx = layer.backward(ctx, f.saved, {dy});
    return std::vector<Tensor>{f.y, dx, f.saved.plan.splits};
  };
  auto captured = CapturedStep::capture(ctx, step, {.pool_report_policy = PoolReportPolicy::kError});
  auto bytes_of = [&](const Tensor& t) { return testing::raw_bytes(ctx, t); };
  auto grads = [&] { return testing::grad_bytes(ctx, layer); };
  testing::SeededRng rng;
  std::set<std::vector<std::int32_t>> distinct_splits;
  for (int replay = 0; replay < replays; ++replay) {
    const std::vector<float> xs = testing::uniform_values(kTokens * kHidden, rng, -2.0f, 2.0f);
    const std::vector<float> dys = testing::uniform_values(kTokens * kHidden, rng, -2.0f, 2.0f);
    write_floats(ctx, x, xs);
    write_floats(ctx, dy, dys);
    const std::vector<Tensor> eager = step();
    const std::vector<std::vector<std::uint8_t>> eager_grads = grads();
    captured->replay();
    const std::vector<Tensor>& graph = captured->outputs();
    const char* names[] = {"y", "dx", "splits"};
    for (std::size_t i = 0; i < eager.size(); ++i) {
      ASSERT_EQ(bytes_of(eager[i]), bytes_of(graph[i])) << names[i] << " differs at replay " << replay;
    }
    ASSERT_EQ(eager_grads, grads()) << "parameter gradients differ at replay " << replay;
    const std::vector<std::int32_t> splits = ctx.to_vector<std::int32_t>(graph[2]);
    std::int64_t total = 0;
    for (std::int32_t s : splits) total += s;
    ASSERT_EQ(total, 2 * kTokens) << "replay " << replay;
    distinct_splits.insert(splits);
    layer.check_errors(ctx);
  }
  EXPECT_GE(static_cast<int>(distinct_splits.size()), replays * 9 / 10)
      << "the splits did not change from replay to replay; the test did not exercise changing routing";
}

TEST(MoEMLPHostTest, GraphedStepEqualsEagerAcrossChangingRouting) {
  expect_graph_equals_eager(Device::kHost, DType::kFloat32, 6);
}

TEST(MoEMLPHostTest, GraphedStepEqualsEagerBf16) { expect_graph_equals_eager(Device::kHost, DType::kBFloat16, 3); }

TEST(MoEMLPHostTest, BadConfigsAreErrorsAtBuildTime) {
  Context ctx(Device::kHost);
  EXPECT_ERROR_CONTAINS(MoEMLP(ctx, "k3", {.hidden = 8, .ffn = 8, .experts = 4, .topk = 3}, 1),
                        "MoEMLP 'k3': topk must be in [1, 2], got 3");
  EXPECT_ERROR_CONTAINS(MoEMLP(ctx, "k_over_e", {.hidden = 8, .ffn = 8, .experts = 1, .topk = 2}, 1),
                        "MoEMLP 'k_over_e': experts must be in [topk = 2, 1024], got 1");
  EXPECT_ERROR_CONTAINS(MoEMLP(ctx, "none", {.hidden = 8, .ffn = 8, .experts = 0, .topk = 1}, 1),
                        "MoEMLP 'none': experts must be in [topk = 1, 1024], got 0");
  EXPECT_ERROR_CONTAINS(MoEMLP(ctx, "too_many", {.hidden = 8, .ffn = 8, .experts = 4096, .topk = 1}, 1),
                        "MoEMLP 'too_many': experts must be in [topk = 1, 1024], got 4096");
  MoEMLP layer(ctx, "moe", small_config(2, DType::kFloat32), 1);
  const Tensor wrong = ctx.persistent("wrong", {Shape{3, 7}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {wrong}), "MoEMLP 'moe' forward: input must be [tokens, ", "got [3, 7] fp32");
}

TEST(MoERoutingOpsTest, BadInputsAreClearErrors) {
  Context ctx(Device::kHost);
  auto t = [&](const char* name, Shape shape, DType dtype) { return ctx.persistent(name, {std::move(shape), dtype}); };
  const Tensor logits = t("logits", Shape{4, 4}, DType::kFloat32);
  const Tensor word = t("word", Shape{1}, DType::kInt32);
  EXPECT_ERROR_CONTAINS(ops::router_topk(ctx, t("int_logits", Shape{4, 4}, DType::kInt32), 1),
                        "router_topk: logits must be bf16, fp16 or fp32, got int32");
  EXPECT_ERROR_CONTAINS(ops::router_topk(ctx, logits, 3), "router_topk: topk must be in [1, 2], got 3");
  EXPECT_ERROR_CONTAINS(ops::router_topk(ctx, t("vector", Shape{16}, DType::kFloat32), 1),
                        "op router_topk: logits must be a matrix, got [16]");
  EXPECT_ERROR_CONTAINS(ops::moe_plan(ctx, t("float_experts", Shape{4, 2}, DType::kFloat32), word, 4),
                        "op moe_plan: experts must be int32, got fp32");
  EXPECT_ERROR_CONTAINS(
      ops::moe_plan(ctx, t("experts", Shape{4, 2}, DType::kInt32), t("long_word", Shape{2}, DType::kInt32), 4),
      "op moe_plan: the error word must be [1] int32, got [2] int32");
  EXPECT_ERROR_CONTAINS(ops::moe_plan(ctx, t("experts3", Shape{4, 3}, DType::kInt32), word, 4),
                        "moe_plan: topk must be in [1, 2], got 3");
  EXPECT_ERROR_CONTAINS(ops::split_offsets(ctx, t("float_splits", Shape{3}, DType::kFloat32), word, 8),
                        "op split_offsets: splits must be int32 [E]", "got [3] fp32");
  EXPECT_ERROR_CONTAINS(ops::moe_permute(ctx, t("x", Shape{4, 8}, DType::kFloat32), t("sources", Shape{12}, DType::kInt32)),
                        "op moe_permute: sources must be int32 [tokens * k] with k 1 or 2 (tokens = 4), got [12] int32");
  const Tensor positions = t("positions", Shape{4, 2}, DType::kInt32);
  EXPECT_ERROR_CONTAINS(ops::moe_unpermute(ctx, t("rows", Shape{7, 8}, DType::kFloat32), positions),
                        "op moe_unpermute: the expert-ordered rows [7, 8] must have one row per (token, slot) of "
                        "positions [4, 2]");
  const Tensor rows = t("rows8", Shape{8, 8}, DType::kFloat32);
  EXPECT_ERROR_CONTAINS(ops::moe_unpermute(ctx, rows, positions, t("gates", Shape{4, 1}, DType::kFloat32)),
                        "op moe_unpermute: gates must be [4, 2] fp32, got [4, 1] fp32");
  EXPECT_ERROR_CONTAINS(ops::moe_unpermute_backward(ctx, t("dy", Shape{4, 7}, DType::kFloat32), rows, positions,
                                                    t("gates2", Shape{4, 2}, DType::kFloat32)),
                        "op moe_unpermute_backward: dy must be [4, 8] fp32, got [4, 7] fp32");
}

// ---- GPU ----

TEST(MoEMLPCudaTest, GraphedStepEqualsEagerForHundredReplaysOfChangingRouting) {
  SG_SKIP_WITHOUT_GPU();
  expect_graph_equals_eager(Device::kCuda, DType::kBFloat16, 100);
}

TEST(MoEMLPCudaTest, CudaMatchesHost) {
  SG_SKIP_WITHOUT_GPU();
  for (const int topk : {1, 2}) {
    SCOPED_TRACE("k=" + std::to_string(topk));
    constexpr std::int64_t kTokens = 200, kHidden = 64;
    testing::SeededRng rng;
    const std::vector<float> xs = testing::uniform_values(kTokens * kHidden, rng, -2.0f, 2.0f);
    const std::vector<float> dys = testing::uniform_values(kTokens * kHidden, rng, -2.0f, 2.0f);
    struct Result {
      std::vector<float> y, dx;
      std::vector<std::int32_t> experts;
    };
    auto run = [&](Device device) {
      Context ctx(device);
      MoEMLP layer(ctx, "moe", {.hidden = kHidden, .ffn = 64, .experts = 8, .topk = topk, .dtype = DType::kBFloat16},
                   9);
      const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kBFloat16});
      const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kBFloat16});
      write_floats(ctx, x, xs);
      write_floats(ctx, dy, dys);
      const MoEMLP::Forward f = layer.forward(ctx, {x});
      Result out{read_floats(ctx, f.y), read_floats(ctx, layer.backward(ctx, f.saved, {dy})),
                 ctx.to_vector<std::int32_t>(f.saved.routed.experts)};
      layer.check_errors(ctx);
      return out;
    };
    const Result cuda = run(Device::kCuda);
    const Result host = run(Device::kHost);
    // bf16 router logits can round differently on the two sides (cuBLASLt vs
    // the host GEMM) and flip a near tie. Every row of y and dx depends only
    // on its own token's routing: compare the rows of the tokens routed alike.
    std::vector<float> cuda_y, host_y, cuda_dx, host_dx;
    std::int64_t agree = 0;
    for (std::int64_t t = 0; t < kTokens; ++t) {
      bool same = true;
      for (int j = 0; j < topk; ++j) same = same && cuda.experts[t * topk + j] == host.experts[t * topk + j];
      if (!same) continue;
      ++agree;
      for (std::int64_t h = 0; h < kHidden; ++h) {
        cuda_y.push_back(cuda.y[t * kHidden + h]);
        host_y.push_back(host.y[t * kHidden + h]);
        cuda_dx.push_back(cuda.dx[t * kHidden + h]);
        host_dx.push_back(host.dx[t * kHidden + h]);
      }
    }
    EXPECT_GE(agree, kTokens * 95 / 100) << "cuda and host routed too many tokens differently";
    EXPECT_LE(testing::relative_error(cuda_y, host_y), 2e-2);
    EXPECT_LE(testing::relative_error(cuda_dx, host_dx), 3e-2);
  }
}

}  // namespace
}  // namespace stepgraph
