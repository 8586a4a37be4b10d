// GroupedLinear with an FP8 recipe (Note [FP8 GroupedLinear]): one expert
// holding every token equals an FP8 Linear of the same weights (the grouped
// FP8 products against the independently tested FP8 GEMMs, for current and
// delayed scaling over steps); several experts on ragged splits with an
// empty one stay within FP8's error of the bf16 layer; a captured step equals
// eager bit for bit over replays whose splits change (host, and 100 to 1,000
// replays on a GPU), delayed scaling's state included; bad configs and
// shapes are errors naming them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "graphs/captured_step.h"
#include "layers/grouped_linear.h"
#include "layers/linear.h"
#include "layers/moe_mlp.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::random_values;
using testing::raw_bytes;
using testing::read_floats;
using testing::relative;
using testing::write_floats;
using testing::write_values;

// E split sizes adding up to `tokens`, ragged, expert 1 empty.
std::vector<std::int32_t> ragged_splits(std::int64_t tokens, std::int64_t experts, std::mt19937& rng) {
  std::uniform_int_distribution<std::int64_t> cut(0, tokens);
  std::vector<std::int64_t> cuts{0, tokens};
  for (std::int64_t e = 2; e < experts; ++e) cuts.push_back(cut(rng));
  std::sort(cuts.begin(), cuts.end());
  cuts.insert(cuts.begin() + 1, 0);  // expert 1 gets [0, 0)
  std::vector<std::int32_t> out;
  for (std::int64_t e = 0; e < experts; ++e) out.push_back(static_cast<std::int32_t>(cuts[e + 1] - cuts[e]));
  return out;
}

Tensor splits_tensor(Context& ctx, const std::vector<std::int32_t>& splits) {
  const Tensor t = ctx.persistent("splits", {Shape{static_cast<std::int64_t>(splits.size())}, DType::kInt32});
  write_values(ctx, t, splits);
  return t;
}

struct Outputs {
  std::vector<float> y, dx, dw, db;
};

template <typename Layer>
Outputs outputs_of(Context& ctx, Layer& layer, const Tensor& y, const Tensor& dx) {
  const std::vector<Parameter*> params = layer.parameters();
  return {read_floats(ctx, y), read_floats(ctx, dx), read_floats(ctx, params[0]->grad),
          read_floats(ctx, params[1]->grad)};
}

TEST(Fp8GroupedLinearTest, OneExpertEqualsAnFp8LinearOfTheSameWeights) {
  testing::SeededRng rng;
  const std::int64_t tokens = 48, in = 64, out = 32;
  for (const Fp8Recipe& recipe : {Fp8Recipe::current(), Fp8Recipe::delayed(4)}) {
    SCOPED_TRACE(recipe.to_string());
    Context ctx(Device::kHost);
    // The same seed draws the same [out, in] weight and bias for both.
    Linear linear(ctx, "linear", {.in_features = in, .out_features = out, .bias = true, .fp8 = recipe}, 11);
    GroupedLinear grouped(ctx, "grouped", {.experts = 1, .in_features = in, .out_features = out, .fp8 = recipe}, 11);
    const Tensor x = ctx.persistent("x", {Shape{tokens, in}, DType::kBFloat16});
    const Tensor dy = ctx.persistent("dy", {Shape{tokens, out}, DType::kBFloat16});
    const Tensor splits = ctx.persistent("splits", {Shape{1}, DType::kInt32});
    write_values(ctx, splits, std::vector<std::int32_t>{static_cast<std::int32_t>(tokens)});
    // Delayed scaling: three steps, so the later ones quantize with the histories the earlier ones left.
    for (int step = 0; step < 3; ++step) {
      write_floats(ctx, x, random_values(tokens * in, rng, 1.0f));
      write_floats(ctx, dy, random_values(tokens * out, rng, 0.01f));
      const Linear::Forward lf = linear.forward(ctx, {x});
      const Outputs want = outputs_of(ctx, linear, lf.y, linear.backward(ctx, lf.saved, {dy}));
      const GroupedLinear::Forward gf = grouped.forward(ctx, {x, splits});
      EXPECT_FALSE(gf.saved.x.defined()) << "the FP8 layer keeps x's FP8 copy, not x";
      const Outputs got = outputs_of(ctx, grouped, gf.y, grouped.backward(ctx, gf.saved, {dy}));
      // The same FP8 bytes and scales; only the fp32 order of the sums may
      // differ, which can move a bf16 rounding by one step.
      EXPECT_LT(relative(got.y, want.y), 1e-2) << "step " << step;
      EXPECT_LT(relative(got.dx, want.dx), 1e-2) << "step " << step;
      EXPECT_LT(relative(got.dw, want.dw), 1e-5) << "step " << step;
      EXPECT_LT(relative(got.db, want.db), 1e-6) << "step " << step;
    }
    const std::vector<StateTensor> linear_state = linear.state(), grouped_state = grouped.state();
    ASSERT_EQ(linear_state.size(), grouped_state.size());
    for (std::size_t i = 0; i < linear_state.size(); ++i) {
      EXPECT_EQ(read_floats(ctx, linear_state[i].tensor), read_floats(ctx, grouped_state[i].tensor))
          << grouped_state[i].name;
    }
  }
}

TEST(Fp8GroupedLinearTest, RaggedExpertsStayWithinFp8ErrorOfBf16) {
  testing::SeededRng rng;
  const std::int64_t tokens = 160, experts = 4, in = 48, out = 80;
  const std::vector<float> x_values = random_values(tokens * in, rng, 1.0f);
  const std::vector<float> dy_values = random_values(tokens * out, rng, 0.01f);
  const std::vector<std::int32_t> splits = ragged_splits(tokens, experts, rng);
  auto run = [&](std::optional<Fp8Recipe> fp8) {
    Context ctx(Device::kHost);
    GroupedLinear layer(ctx, "experts",
                        {.experts = experts, .in_features = in, .out_features = out, .fp8 = fp8}, 3);
    const Tensor x = ctx.persistent("x", {Shape{tokens, in}, DType::kBFloat16});
    const Tensor dy = ctx.persistent("dy", {Shape{tokens, out}, DType::kBFloat16});
    write_floats(ctx, x, x_values);
    write_floats(ctx, dy, dy_values);
    const GroupedLinear::Forward f = layer.forward(ctx, {x, splits_tensor(ctx, splits)});
    if (fp8) EXPECT_EQ(f.saved.x_fp8_t.shape(), (Shape{in, tokens}));
    return outputs_of(ctx, layer, f.y, layer.backward(ctx, f.saved, {dy}));
  };
  const Outputs bf16 = run(std::nullopt);
  for (const Fp8Recipe& recipe : {Fp8Recipe::current(), Fp8Recipe::delayed(4)}) {
    SCOPED_TRACE(recipe.to_string());
    const Outputs fp8 = run(recipe);
    // The bounds of Fp8LinearTest (E4M3 and E5M2 rounding of each factor).
    // Delayed scaling's first step quantizes with scale 1 (no history yet):
    // inside the formats' range for these values, coarser near zero.
    EXPECT_LT(relative(fp8.y, bf16.y), 0.1);
    EXPECT_LT(relative(fp8.dx, bf16.dx), 0.15);
    EXPECT_LT(relative(fp8.dw, bf16.dw), recipe.scaling == Fp8Scaling::kDelayed ? 0.3 : 0.15);
    EXPECT_GT(relative(fp8.y, bf16.y), 1e-4) << "the FP8 path ran";
    EXPECT_LT(relative(fp8.db, bf16.db), 1e-5);
  }
}

// One forward + backward captured once and replayed with new inputs and a new
// split each time, equal to an eager twin (same seed) bit for bit: y, dx,
// every gradient, and delayed scaling's state; the pool report clean.
void expect_graph_equals_eager(Device device, const Fp8Recipe& recipe, std::int64_t tokens, std::int64_t experts,
                               std::int64_t in, std::int64_t out, int replays) {
  SCOPED_TRACE(recipe.to_string());
  Context ctx(device);
  const GroupedLinearConfig config{.experts = experts, .in_features = in, .out_features = out, .fp8 = recipe};
  GroupedLinear eager_layer(ctx, "eager", config, 5);
  GroupedLinear layer(ctx, "graphed", config, 5);
  const Tensor x = ctx.persistent("x", {Shape{tokens, in}, DType::kBFloat16});
  const Tensor dy = ctx.persistent("dy", {Shape{tokens, out}, DType::kBFloat16});
  const Tensor splits = ctx.persistent("splits", {Shape{experts}, DType::kInt32});
  auto step_of = [&](const GroupedLinear& l) {
    const GroupedLinear::Forward f = l.forward(ctx, {x, splits});
    return std::vector<Tensor>{f.y, l.backward(ctx, f.saved, {dy})};
  };
  auto captured = CapturedStep::capture(ctx, [&] { return step_of(layer); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
  auto grads = [&](GroupedLinear& l) { return testing::grad_bytes(ctx, l); };
  testing::SeededRng rng;
  for (int replay = 0; replay < replays; ++replay) {
    write_floats(ctx, x, random_values(tokens * in, rng, 1.0f));
    write_floats(ctx, dy, random_values(tokens * out, rng, 0.01f));
    write_values(ctx, splits, ragged_splits(tokens, experts, rng));
    const std::vector<Tensor> eager = step_of(eager_layer);
    captured->replay();
    ASSERT_EQ(raw_bytes(ctx, eager[0]), raw_bytes(ctx, captured->outputs()[0])) << "y differs at replay " << replay;
    ASSERT_EQ(raw_bytes(ctx, eager[1]), raw_bytes(ctx, captured->outputs()[1])) << "dx differs at replay " << replay;
    ASSERT_EQ(grads(eager_layer), grads(layer)) << "gradients differ at replay " << replay;
  }
  const std::vector<StateTensor> eager_state = eager_layer.state(), graphed_state = layer.state();
  ASSERT_EQ(eager_state.size(), graphed_state.size());
  EXPECT_EQ(graphed_state.size(), recipe.scaling == Fp8Scaling::kDelayed ? 9u : 0u);
  for (std::size_t i = 0; i < eager_state.size(); ++i) {
    EXPECT_EQ(raw_bytes(ctx, eager_state[i].tensor), raw_bytes(ctx, graphed_state[i].tensor))
        << graphed_state[i].name;
  }
  EXPECT_EQ(layer.non_finite_amaxes(ctx), 0);
}

TEST(Fp8GroupedLinearTest, GraphedStepEqualsEagerOnTheHost) {
  expect_graph_equals_eager(Device::kHost, Fp8Recipe::current(), 64, 3, 32, 48, 3);
  expect_graph_equals_eager(Device::kHost, Fp8Recipe::delayed(4), 64, 3, 32, 48, 5);
}

TEST(Fp8GroupedLinearTest, GraphedStepEqualsEagerOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  // Groups of several 128-row tiles and 128-token wgrad stages, ragged ends.
  expect_graph_equals_eager(Device::kCuda, Fp8Recipe::current(), 1024, 8, 256, 512, 100);
  // Delayed scaling's histories and scales stay equal to eager's over 1,000 replays.
  expect_graph_equals_eager(Device::kCuda, Fp8Recipe::delayed(16), 512, 4, 128, 256, 1000);
}

// An MoE block whose experts run in FP8: captured once, replayed with new
// tokens (so new routings), equal to an eager twin bit for bit, delayed
// scaling's state of both expert layers included.
void expect_moe_graph_equals_eager(Device device, const Fp8Recipe& recipe, std::int64_t tokens, int replays) {
  SCOPED_TRACE(recipe.to_string());
  Context ctx(device);
  const MoEMLPConfig config{.hidden = 64, .ffn = 96, .experts = 4, .topk = 2, .fp8 = recipe};
  MoEMLP eager_block(ctx, "eager", config, 9);
  MoEMLP block(ctx, "graphed", config, 9);
  const Tensor x = ctx.persistent("x", {Shape{tokens, config.hidden}, DType::kBFloat16});
  const Tensor dy = ctx.persistent("dy", {Shape{tokens, config.hidden}, DType::kBFloat16});
  auto step_of = [&](const MoEMLP& b) {
    const MoEMLP::Forward f = b.forward(ctx, {x});
    return std::vector<Tensor>{f.y, b.backward(ctx, f.saved, {dy})};
  };
  auto captured = CapturedStep::capture(ctx, [&] { return step_of(block); },
                                        {.pool_report_policy = PoolReportPolicy::kError});
  testing::SeededRng rng;
  for (int replay = 0; replay < replays; ++replay) {
    write_floats(ctx, x, random_values(tokens * config.hidden, rng, 1.0f));
    write_floats(ctx, dy, random_values(tokens * config.hidden, rng, 0.01f));
    const std::vector<Tensor> eager = step_of(eager_block);
    captured->replay();
    ASSERT_EQ(raw_bytes(ctx, eager[0]), raw_bytes(ctx, captured->outputs()[0])) << "y differs at replay " << replay;
    ASSERT_EQ(raw_bytes(ctx, eager[1]), raw_bytes(ctx, captured->outputs()[1])) << "dx differs at replay " << replay;
    const std::vector<Parameter*> want = eager_block.parameters(), got = block.parameters();
    for (std::size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(raw_bytes(ctx, want[i]->grad), raw_bytes(ctx, got[i]->grad)) << got[i]->name << " at replay " << replay;
    }
  }
  const std::vector<GroupedLinear*> eager_experts = eager_block.fp8_experts(), experts = block.fp8_experts();
  ASSERT_EQ(experts.size(), 2u);
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const std::vector<StateTensor> want = eager_experts[e]->state(), got = experts[e]->state();
    ASSERT_EQ(want.size(), got.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(raw_bytes(ctx, want[i].tensor), raw_bytes(ctx, got[i].tensor)) << got[i].name;
    }
  }
  block.check_errors(ctx);
}

TEST(Fp8MoEMLPTest, GraphedStepEqualsEagerOnTheHost) {
  expect_moe_graph_equals_eager(Device::kHost, Fp8Recipe::current(), 32, 3);
  expect_moe_graph_equals_eager(Device::kHost, Fp8Recipe::delayed(4), 32, 4);
}

TEST(Fp8MoEMLPTest, GraphedStepEqualsEagerOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_moe_graph_equals_eager(Device::kCuda, Fp8Recipe::current(), 512, 100);
  expect_moe_graph_equals_eager(Device::kCuda, Fp8Recipe::delayed(16), 512, 100);
}

TEST(Fp8GroupedLinearTest, BadConfigsAndShapesAreErrorsNamingThem) {
  Context ctx(Device::kHost);
  const GroupedLinearConfig good{.experts = 2, .in_features = 32, .out_features = 48, .fp8 = Fp8Recipe::current()};
  GroupedLinearConfig config = good;
  config.fp8 = Fp8Recipe::block();
  EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "a", config, 1), "block scaling is not built", "current or delayed");
  config = good;
  config.dtype = DType::kFloat32;
  EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "b", config, 1), "FP8 needs a bf16 layer", "fp32");
  config = good;
  config.in_features = 24;
  EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "c", config, 1), "divisible by 16", "24 and 48");
  GroupedLinear layer(ctx, "d", good, 1);
  const Tensor x = ctx.persistent("x40", {Shape{40, 32}, DType::kBFloat16});
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {x, splits_tensor(ctx, std::vector<std::int32_t>{20, 20})}),
                        "token count divisible by 16", "40");
}

}  // namespace
}  // namespace stepgraph
