// MoE load balancing in MoEMLP (Note [MoE load balancing] in
// layers/moe_mlp.h), host, fp32, tiny sizes; seeds printed on failure:
//  - the aux loss the forward returns against the formula from the layer's
//    own logits and splits; its gradient (the layer's gradients with the aux
//    loss minus those without) against central differences of the aux value,
//    times the loss factor, for the router weight and the input;
//  - expert-parallel (2 ranks, a thread world): every rank's aux value and
//    gradients equal one layer's on that rank's tokens (f and P per rank), and
//    the bias moves by the loads of both ranks, alike on both;
//  - the bias: it steers the choice but not the gates, and after a step with
//    skewed routing the overloaded experts' bias falls by the rate and the
//    underloaded ones' rises;
//  - eager == graph bit for bit over several steps with both on (the bias
//    moving every step).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/moe_mlp.h"
#include "layers/residual_stack.h"
#include "tests/layers/gradient_check.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::read_floats;
using testing::write_floats;

constexpr std::int64_t kHidden = 8, kFfn = 12, kExperts = 4;

MoEMLPConfig config(int topk, float coef, float rate) {
  return {.hidden = kHidden,
          .ffn = kFfn,
          .experts = kExperts,
          .topk = topk,
          .dtype = DType::kFloat32,
          .aux_loss_coef = coef,
          .bias_update_rate = rate};
}

// coef E sum_e f_e P_e from logits [T, E] and splits, in double.
double aux_formula(const std::vector<float>& logits, const std::vector<std::int32_t>& splits, std::int64_t T,
                   int topk, double coef) {
  const std::int64_t E = static_cast<std::int64_t>(splits.size());
  double aux = 0.0;
  for (std::int64_t t = 0; t < T; ++t) {
    double max = -INFINITY, sum = 0.0;
    for (std::int64_t e = 0; e < E; ++e) max = std::max<double>(max, logits[t * E + e]);
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(logits[t * E + e] - max);
    for (std::int64_t e = 0; e < E; ++e) {
      aux += splits[e] / static_cast<double>(T * topk) * std::exp(logits[t * E + e] - max) / sum / T;
    }
  }
  return coef * E * aux;
}

std::vector<float> minus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] - b[i];
  return out;
}

constexpr int kRouter = 2;  // parameters(): gamma, beta, router, fc1 w, fc1 b, fc2 w, fc2 b

void check_aux_loss(int topk) {
  SCOPED_TRACE("k=" + std::to_string(topk));
  constexpr std::int64_t kTokens = 10;
  // A large coefficient, so the aux gradient stands well above the check's tolerance.
  constexpr float kCoef = 20.0f, kFactor = 0.5f;
  Context ctx(Device::kHost);
  testing::GradientCheck check(ctx);
  MoEMLP with(ctx, "with", config(topk, kCoef, 0.0f), 5);
  MoEMLP without(ctx, "without", config(topk, 0.0f, 0.0f), 5);
  with.set_balance({.loss_factor = kFactor});
  const Tensor x = check.random_tensor("x", Shape{kTokens, kHidden});
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
  write_floats(ctx, dy, check.random_values(kTokens * kHidden));

  const MoEMLP::Forward f = with.forward(ctx, {x});
  ASSERT_TRUE(f.aux_loss.defined());
  const std::vector<std::int32_t> splits = ctx.to_vector<std::int32_t>(f.saved.plan.splits);
  const double want = aux_formula(read_floats(ctx, f.saved.logits), splits, kTokens, topk, kCoef);
  EXPECT_NEAR(read_floats(ctx, f.aux_loss).at(0), want, 1e-6 * want);
  const std::vector<float> dx_with = read_floats(ctx, with.backward(ctx, f.saved, {dy}));
  const std::vector<float> router_with = read_floats(ctx, with.parameters()[kRouter]->grad);
  const MoEMLP::Forward g = without.forward(ctx, {x});
  EXPECT_FALSE(g.aux_loss.defined());
  const std::vector<float> dx_without = read_floats(ctx, without.backward(ctx, g.saved, {dy}));
  const std::vector<float> router_without = read_floats(ctx, without.parameters()[kRouter]->grad);
  EXPECT_EQ(read_floats(ctx, g.y), read_floats(ctx, f.y)) << "the aux loss changed the output";

  // The difference is kFactor d aux: finite differences of kFactor aux (routing held).
  const std::vector<std::int32_t> routing = ctx.to_vector<std::int32_t>(f.saved.routed.experts);
  std::vector<std::int32_t> last;
  auto aux_value = [&] {
    const MoEMLP::Forward h = with.forward(ctx, {x});
    last = ctx.to_vector<std::int32_t>(h.saved.routed.experts);
    return h.aux_loss;
  };
  auto same_routing = [&] { return last == routing; };
  check.expect_matches("d aux / d router weight", with.parameters()[kRouter]->master,
                       minus(router_with, router_without), aux_value, {kFactor}, same_routing, 1e-2f);
  check.expect_matches("d aux / d x", x, minus(dx_with, dx_without), aux_value, {kFactor}, same_routing, 1e-2f);
  with.check_errors(ctx);
}

// The aux part of the router's gradient carries the dynamic loss scale S as
// the loss's gradient does (AdamW divides every gradient by S).
TEST(MoEBalanceLayerTest, AuxGradientCarriesTheDynamicLossScale) {
  constexpr std::int64_t kTokens = 10;
  Context ctx(Device::kHost);
  testing::GradientCheck check(ctx);
  const Tensor x = check.random_tensor("x", Shape{kTokens, kHidden});
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
  write_floats(ctx, dy, std::vector<float>(kTokens * kHidden, 0.0f));  // only the aux loss's gradient remains
  const Tensor state = ctx.persistent("loss_scale", {Shape{3}, DType::kFloat32});
  write_floats(ctx, state, {8.0f, 0.125f, 0.0f});
  std::vector<std::vector<float>> grads;
  for (const bool scaled : {false, true}) {
    MoEMLP layer(ctx, scaled ? "scaled" : "plain", config(2, 1.0f, 0.0f), 5);
    layer.set_balance({.loss_factor = 0.5f, .loss_scale = scaled ? state : Tensor()});
    const MoEMLP::Forward f = layer.forward(ctx, {x});
    layer.backward(ctx, f.saved, {dy});
    grads.push_back(read_floats(ctx, layer.parameters()[kRouter]->grad));
  }
  float largest = 0.0f;
  for (std::size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_EQ(grads[1][i], 8.0f * grads[0][i]) << "router weight gradient " << i;  // a power of two: exact
    largest = std::max(largest, std::fabs(grads[0][i]));
  }
  EXPECT_GT(largest, 1e-4f) << "the aux loss gave the router no gradient";
}

TEST(MoEBalanceLayerTest, AuxLossValueAndGradientTop1) { check_aux_loss(1); }
TEST(MoEBalanceLayerTest, AuxLossValueAndGradientTop2) { check_aux_loss(2); }

// Pushes every token's logit of expert `favourite` up by about 30 (through
// the norm's beta and the router's weight), so the routing is skewed.
void skew(Context& ctx, MoEMLP& layer, std::int64_t favourite) {
  const std::vector<Parameter*> params = layer.parameters();
  std::vector<float> beta = read_floats(ctx, params[1]->master);
  beta[0] = 10.0f;
  write_floats(ctx, params[1]->master, beta);
  std::vector<float> w = read_floats(ctx, params[kRouter]->master);  // [E, H]
  for (std::int64_t e = 0; e < kExperts; ++e) w[e * kHidden] = e == favourite ? 3.0f : 0.0f;
  write_floats(ctx, params[kRouter]->master, w);
}

TEST(MoEBalanceLayerTest, BiasSteersTheChoiceNotTheGatesAndFollowsTheLoad) {
  for (const int topk : {1, 2}) {
    SCOPED_TRACE("k=" + std::to_string(topk));
    constexpr std::int64_t kTokens = 16;
    constexpr float kRate = 0.25f;
    Context ctx(Device::kHost);
    testing::GradientCheck check(ctx);
    MoEMLP layer(ctx, "moe", config(topk, 0.0f, kRate), 9);
    MoEMLP plain(ctx, "plain", config(topk, 0.0f, 0.0f), 9);
    skew(ctx, layer, 0);
    skew(ctx, plain, 0);
    const Tensor x = check.random_tensor("x", Shape{kTokens, kHidden});
    const Tensor dy = check.random_tensor("dy", Shape{kTokens, kHidden});
    ASSERT_EQ(read_floats(ctx, layer.expert_bias()), std::vector<float>(kExperts, 0.0f)) << "the bias starts at 0";

    // A bias of 100 on expert 3 makes it every token's first choice; the
    // gates stay those of the unbiased logits.
    std::vector<float> bias{0.0f, 0.0f, 0.0f, 100.0f};
    write_floats(ctx, layer.expert_bias(), bias);
    const MoEMLP::Forward f = layer.forward(ctx, {x});
    const MoEMLP::Forward p = plain.forward(ctx, {x});
    const std::vector<std::int32_t> chosen = ctx.to_vector<std::int32_t>(f.saved.routed.experts);
    const std::vector<std::int32_t> unbiased = ctx.to_vector<std::int32_t>(p.saved.routed.experts);
    const std::vector<float> logits = read_floats(ctx, f.saved.logits);
    ASSERT_EQ(logits, read_floats(ctx, p.saved.logits));
    const std::vector<float> gates = read_floats(ctx, f.saved.routed.gates);
    for (std::int64_t t = 0; t < kTokens; ++t) {
      EXPECT_EQ(unbiased[t * topk], 0) << "without the bias token " << t << " goes to the favourite";
      EXPECT_EQ(chosen[t * topk], 3) << "token " << t;
      if (topk == 2) {
        EXPECT_EQ(chosen[t * topk + 1], 0) << "token " << t << ": the favourite comes second";
      }
      const float* l = logits.data() + t * kExperts;
      double z = 0.0;
      if (topk == 1) {
        for (std::int64_t e = 0; e < kExperts; ++e) z += std::exp(static_cast<double>(l[e]));
      } else {
        z = std::exp(static_cast<double>(l[3])) + std::exp(static_cast<double>(l[0]));
      }
      EXPECT_NEAR(gates[t * topk], std::exp(static_cast<double>(l[3])) / z, 1e-5) << "token " << t;
      if (topk == 2) {
        EXPECT_NEAR(gates[t * topk + 1], std::exp(static_cast<double>(l[0])) / z, 1e-5) << "token " << t;
      }
    }
    // After the step the bias moves by the step's loads: expert 3 (every
    // token) falls, the unchosen experts rise.
    const std::vector<std::int32_t> splits = ctx.to_vector<std::int32_t>(f.saved.plan.splits);
    layer.backward(ctx, f.saved, {dy});
    const std::vector<float> after = read_floats(ctx, layer.expert_bias());
    std::int64_t total = 0;
    for (std::int32_t s : splits) total += s;
    for (std::int64_t e = 0; e < kExperts; ++e) {
      const float want = splits[e] * kExperts > total ? bias[e] - kRate
                         : splits[e] * kExperts < total ? bias[e] + kRate
                                                        : bias[e];
      EXPECT_EQ(after[e], want) << "expert " << e << " load " << splits[e] << " of " << total;
    }
    EXPECT_EQ(after[3], 100.0f - kRate) << "the overloaded expert's bias falls";
    EXPECT_EQ(after[1], kRate) << "an unchosen expert's bias rises";
    layer.check_errors(ctx);
  }
}

// One fwd+bwd: y, dx, aux, every gradient, the bias after.
struct Step {
  std::vector<float> y, dx, aux, bias;
  std::vector<std::vector<float>> grads;
};

Step run(Context& ctx, MoEMLP& layer, const Tensor& x, const Tensor& dy) {
  const MoEMLP::Forward f = layer.forward(ctx, {x});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  Step s{read_floats(ctx, f.y), read_floats(ctx, dx), {}, {}, {}};
  if (f.aux_loss.defined()) s.aux = read_floats(ctx, f.aux_loss);
  if (layer.expert_bias().defined()) s.bias = read_floats(ctx, layer.expert_bias());
  for (const Parameter* p : layer.parameters()) s.grads.push_back(read_floats(ctx, p->grad));
  layer.check_errors(ctx);
  return s;
}

TEST(MoEBalanceLayerTest, ExpertParallelRanksEqualOneLayerOnTheirTokens) {
  constexpr int kRanks = 2;
  constexpr std::int64_t kTokens = 12;  // a rank's
  constexpr float kCoef = 0.1f, kRate = 0.125f;
  const testing::TestSeed seed;
  const std::vector<float> xs = testing::normal_values(seed.value(), kRanks * kTokens * kHidden);
  const std::vector<float> dys = testing::normal_values(seed.value() + 1, kRanks * kTokens * kHidden);
  auto rank_rows = [&](const std::vector<float>& all, int r) {
    return std::vector<float>(all.begin() + r * kTokens * kHidden, all.begin() + (r + 1) * kTokens * kHidden);
  };
  // One layer per rank's tokens (aux and its gradient per rank, factor 1/2),
  // and the global loads: the bias the ranks must share.
  std::vector<Step> want(kRanks);
  std::vector<std::int32_t> loads(kExperts, 0);
  for (int r = 0; r < kRanks; ++r) {
    Context ctx(Device::kHost);
    MoEMLP layer(ctx, "moe", config(2, kCoef, 0.0f), 31);
    layer.set_balance({.loss_factor = 1.0f / kRanks});
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
    write_floats(ctx, x, rank_rows(xs, r));
    write_floats(ctx, dy, rank_rows(dys, r));
    const MoEMLP::Forward f = layer.forward(ctx, {x});
    const std::vector<std::int32_t> splits = ctx.to_vector<std::int32_t>(f.saved.plan.splits);
    for (std::int64_t e = 0; e < kExperts; ++e) loads[e] += splits[e];
    want[r] = run(ctx, layer, x, dy);
  }
  std::vector<float> want_bias(kExperts, 0.0f);
  std::int64_t total = 0;
  for (std::int32_t l : loads) total += l;
  for (std::int64_t e = 0; e < kExperts; ++e) {
    want_bias[e] = loads[e] * kExperts > total ? -kRate : (loads[e] * kExperts < total ? kRate : 0.0f);
  }
  ASSERT_NE(want_bias, std::vector<float>(kExperts, 0.0f)) << "the loads came out balanced; the test checks little";

  std::vector<Step> got(kRanks);
  HostWorld::run(kRanks, [&](Communicator& comm) {
    const int r = comm.rank();
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    MoEMLP layer(ctx, "moe", config(2, kCoef, kRate), 31, nullptr, &comm);
    layer.set_balance({.load_group = &comm, .loss_factor = 1.0f / kRanks});
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
    write_floats(ctx, x, rank_rows(xs, r));
    write_floats(ctx, dy, rank_rows(dys, r));
    got[r] = run(ctx, layer, x, dy);
  });
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(got[r].aux, want[r].aux) << "f and P are the rank's own tokens'";
    testing::expect_close(got[r].y, want[r].y, "y");
    testing::expect_close(got[r].dx, want[r].dx, "dx");
    for (int i : {0, 1, kRouter}) {  // the replicated parameters: this rank's tokens' share
      testing::expect_close(got[r].grads[i], want[r].grads[i], "gradient " + std::to_string(i));
    }
    EXPECT_EQ(got[r].bias, want_bias) << "the bias follows both ranks' loads";
  }
}

TEST(MoEBalanceLayerTest, GraphedStepsEqualEagerBitForBitWithTheBiasMoving) {
  constexpr std::int64_t kTokens = 24;
  constexpr int kSteps = 5;
  Context eager_ctx(Device::kHost), graph_ctx(Device::kHost);
  const MoEMLPConfig c = config(2, 0.05f, 0.5f);  // a large rate: the routing shifts from step to step
  MoEMLP eager(eager_ctx, "moe", c, 3), graphed(graph_ctx, "moe", c, 3);
  eager.set_balance({.loss_factor = 0.5f});
  graphed.set_balance({.loss_factor = 0.5f});
  auto inputs = [&](Context& ctx) {
    return std::pair{ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32}),
                     ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32})};
  };
  const auto [ex, edy] = inputs(eager_ctx);
  const auto [gx, gdy] = inputs(graph_ctx);
  auto captured = CapturedStep::capture(
      graph_ctx,
      [&] {
        const MoEMLP::Forward f = graphed.forward(graph_ctx, {gx});
        const Tensor dx = graphed.backward(graph_ctx, f.saved, {gdy});
        return std::vector<Tensor>{f.y, dx, f.aux_loss};
      },
      {.pool_report_policy = PoolReportPolicy::kError});
  testing::SeededRng rng;
  std::vector<std::vector<float>> biases;
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::vector<float> xs = testing::uniform_values(kTokens * kHidden, rng, -2.0f, 2.0f);
    const std::vector<float> dys = testing::uniform_values(kTokens * kHidden, rng, -2.0f, 2.0f);
    write_floats(eager_ctx, ex, xs);
    write_floats(eager_ctx, edy, dys);
    write_floats(graph_ctx, gx, xs);
    write_floats(graph_ctx, gdy, dys);
    const Step e = run(eager_ctx, eager, ex, edy);
    captured->replay();
    const std::vector<Tensor>& out = captured->outputs();
    ASSERT_EQ(read_floats(graph_ctx, out[0]), e.y);
    ASSERT_EQ(read_floats(graph_ctx, out[1]), e.dx);
    ASSERT_EQ(read_floats(graph_ctx, out[2]), e.aux);
    ASSERT_EQ(read_floats(graph_ctx, graphed.expert_bias()), e.bias);
    ASSERT_EQ(testing::grad_bytes(graph_ctx, graphed), testing::grad_bytes(eager_ctx, eager));
    biases.push_back(e.bias);
    graphed.check_errors(graph_ctx);
  }
  EXPECT_NE(biases.front(), biases.back()) << "the bias never moved";
}

TEST(MoEBalanceLayerTest, BadSettingsAreErrorsNamingTheirField) {
  Context ctx(Device::kHost);
  EXPECT_ERROR_CONTAINS(MoEMLP(ctx, "moe", config(2, -1.0f, 0.0f), 1),
                        "MoEMLP 'moe': aux_loss_coef must be finite and >= 0 (0: no auxiliary loss), got -1");
  EXPECT_ERROR_CONTAINS(MoEMLP(ctx, "moe", config(2, 0.0f, NAN), 1),
                        "MoEMLP 'moe': bias_update_rate must be finite and >= 0 (0: no expert bias), got nan");
  const ResidualStackConfig dense{.hidden = 8, .ffn = 8, .layers = 1, .vocab = 16, .dtype = DType::kFloat32,
                                  .moe_aux_loss_coef = 0.01f};
  EXPECT_ERROR_CONTAINS(ResidualStack(ctx, dense),
                        "ResidualStack: moe_aux_loss_coef (0.01) balances the MoE blocks' experts, but experts is 0");
  ResidualStackConfig moe = dense;
  moe.moe_aux_loss_coef = 0.0f;
  moe.experts = 4;
  moe.moe_every = 1;
  moe.moe_bias_update_rate = -0.5f;
  EXPECT_ERROR_CONTAINS(ResidualStack(ctx, moe), "ResidualStack: moe_bias_update_rate must be finite and >= 0");
}

}  // namespace
}  // namespace stepgraph
