// GroupedLinear. Host: the forward against per-expert dense math, every
// gradient against central finite differences (fp32, an empty expert
// included), the bad-split error path eager and graphed, bad shapes and
// configs. GPU: cuda against host for the forward and every gradient (bf16),
// and the bad-split error path in a captured step.
#include "layers/grouped_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "ops/activation_ops.h"
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
using testing::write_values;

using Ints = std::vector<std::int32_t>;

Tensor splits_tensor(Context& ctx, const Ints& splits) {
  Tensor t = ctx.persistent("splits", {Shape{static_cast<std::int64_t>(splits.size())}, DType::kInt32});
  write_values(ctx, t, splits);
  return t;
}

TEST(GroupedLinearHostTest, ForwardIsEachExpertsLinearOnItsRows) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  constexpr std::int64_t kIn = 5, kOut = 4, kTokens = 7;
  GroupedLinear layer(ctx, "experts",
                      {.experts = 3, .in_features = kIn, .out_features = kOut, .dtype = DType::kFloat32}, 11);
  const Ints splits = {3, 0, 4};
  const Tensor x = check.random_tensor("x", Shape{kTokens, kIn});
  const std::vector<float> y = read_floats(ctx, layer.forward(ctx, {x, splits_tensor(ctx, splits)}).y);
  const std::vector<float> xs = read_floats(ctx, x);
  const std::vector<Parameter*> params = layer.parameters();
  const std::vector<float> w = read_floats(ctx, params[0]->master);
  const std::vector<float> b = read_floats(ctx, params[1]->master);
  std::int64_t row = 0;
  for (std::int64_t e = 0; e < 3; ++e) {
    for (std::int32_t r = 0; r < splits[e]; ++r, ++row) {
      for (std::int64_t o = 0; o < kOut; ++o) {
        double want = b[e * kOut + o];
        for (std::int64_t i = 0; i < kIn; ++i)
          want += static_cast<double>(xs[row * kIn + i]) * w[(e * kOut + o) * kIn + i];
        EXPECT_NEAR(y[row * kOut + o], want, 1e-5) << "row " << row << " expert " << e << " out " << o;
      }
    }
  }
}

TEST(GroupedLinearHostTest, GradientsMatchFiniteDifferencesFp32) {
  for (const bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    Context ctx(Device::kHost);
    GradientCheck check(ctx);
    constexpr std::int64_t kIn = 5, kOut = 4, kTokens = 7;
    GroupedLinear layer(
        ctx, "experts",
        {.experts = 3, .in_features = kIn, .out_features = kOut, .bias = bias, .dtype = DType::kFloat32}, 13);
    const Tensor splits = splits_tensor(ctx, {3, 0, 4});  // expert 1 is empty
    const Tensor x = check.random_tensor("x", Shape{kTokens, kIn});
    const std::vector<float> r = check.random_values(kTokens * kOut);
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kOut}, DType::kFloat32});
    write_values(ctx, dy, r);
    auto forward = [&] { return layer.forward(ctx, {x, splits}).y; };
    const GroupedLinear::Forward f = layer.forward(ctx, {x, splits});
    const Tensor dx = layer.backward(ctx, f.saved, {dy});
    check.expect_matches("dx", x, read_floats(ctx, dx), forward, r);
    for (Parameter* p : layer.parameters()) {
      const std::vector<float> grad = read_floats(ctx, p->grad);
      check.expect_matches(p->name, p->master, grad, forward, r);
      // The empty expert's slice of every gradient is exactly zero.
      const std::int64_t per_expert = p->grad.numel() / 3;
      for (std::int64_t i = per_expert; i < 2 * per_expert; ++i) ASSERT_EQ(grad[i], 0.0f) << p->name << "[" << i << "]";
    }
    layer.check_splits(ctx);  // good splits: no error
  }
}

// Runs forward with `splits` and expects check_splits to raise mentioning `needle`, then to pass (cleared).
void expect_split_error(Context& ctx, const GroupedLinear& layer, const std::function<void()>& step,
                        const std::string& needle) {
  step();
  try {
    layer.check_splits(ctx);
    ADD_FAILURE() << "bad splits raised nothing; expected an Error mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find(needle), std::string::npos) << error.what();
  }
  EXPECT_NO_THROW(layer.check_splits(ctx)) << "the error word was not cleared by the check";
}

void check_bad_splits(Device device, bool graphed) {
  Context ctx(device);
  const DType dtype = device == Device::kCuda ? DType::kBFloat16 : DType::kFloat32;
  constexpr std::int64_t kTokens = 8;
  GroupedLinear layer(ctx, "experts", {.experts = 3, .in_features = 16, .out_features = 8, .dtype = dtype}, 3);
  const Tensor x = ctx.persistent("x", {Shape{kTokens, 16}, dtype});
  const Tensor splits = splits_tensor(ctx, {3, 2, 3});
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, 8}, dtype});
  auto step_fn = [&] {
    const GroupedLinear::Forward f = layer.forward(ctx, {x, splits});
    return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
  };
  std::shared_ptr<CapturedStep> captured;
  if (graphed) captured = CapturedStep::capture(ctx, step_fn, {.pool_report_policy = PoolReportPolicy::kError});
  auto run = [&] {
    if (graphed) {
      captured->replay();
    } else {
      step_fn();
    }
  };
  run();
  EXPECT_NO_THROW(layer.check_splits(ctx));
  write_values(ctx, splits, Ints{3, -1, 6});
  expect_split_error(ctx, layer, run, "negative");
  write_values(ctx, splits, Ints{1, 1, 1});
  expect_split_error(ctx, layer, run, "did not add up");
  write_values(ctx, splits, Ints{8, 8, 8});  // far beyond: clamped, still in bounds
  expect_split_error(ctx, layer, run, "did not add up");
  write_values(ctx, splits, Ints{0, 8, 0});
  run();
  EXPECT_NO_THROW(layer.check_splits(ctx));
}

TEST(GroupedLinearHostTest, BadSplitsRaiseAfterTheStepEager) { check_bad_splits(Device::kHost, false); }
TEST(GroupedLinearHostTest, BadSplitsRaiseAfterTheStepGraphed) { check_bad_splits(Device::kHost, true); }

// The activation fields (as a Linear's, Note [Linear epilogues] in
// layers/linear.h) run GeLU and its derivative as ops after the grouped
// products: bit for bit what a caller gets from the plain layer and the ops,
// in fp32 and bf16; an input left unsaved is made again from input_pre with
// the same bits, since the forward's GeLU read the same pre.
TEST(GroupedLinearHostTest, ActivationFieldsAreGeluAndItsDerivativeAroundThePlainLayer) {
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Context ctx(Device::kHost);
    constexpr std::int64_t kIn = 8, kFfn = 16, kTokens = 7;
    const GroupedLinearConfig fc1_config{.experts = 3, .in_features = kIn, .out_features = kFfn, .dtype = dtype};
    const GroupedLinearConfig fc2_config{.experts = 3, .in_features = kFfn, .out_features = kIn, .dtype = dtype};
    GroupedLinearConfig gelu_config = fc1_config;
    gelu_config.activation = LinearActivation::kGelu;
    GroupedLinearConfig input_gelu_config = fc2_config;
    input_gelu_config.input_activation = LinearActivation::kGelu;
    GroupedLinear fc1(ctx, "fc1", fc1_config, 3), fc1_gelu(ctx, "fc1_gelu", gelu_config, 3);
    GroupedLinear fc2(ctx, "fc2", fc2_config, 5), fc2_input_gelu(ctx, "fc2_input_gelu", input_gelu_config, 5);
    const Tensor splits = splits_tensor(ctx, {3, 0, 4});
    testing::SeededRng rng;
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kIn}, dtype});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kIn}, dtype});
    write_floats(ctx, x, testing::random_values(kTokens * kIn, rng, 1.0f));
    write_floats(ctx, dy, testing::random_values(kTokens * kIn, rng, 0.1f));
    auto bits_of = [&](const Tensor& t) { return testing::bits(read_floats(ctx, t)); };

    const GroupedLinear::Forward plain1 = fc1.forward(ctx, {x, splits});
    const GroupedLinear::Forward got1 = fc1_gelu.forward(ctx, {x, splits});
    EXPECT_EQ(bits_of(got1.pre), bits_of(plain1.y));
    EXPECT_EQ(bits_of(got1.y), bits_of(ops::gelu(ctx, plain1.y)));

    const GroupedLinear::Forward plain2 = fc2.forward(ctx, {got1.y, splits});
    GroupedLinear::Forward got2 = fc2_input_gelu.forward(ctx, {got1.y, splits});
    const Tensor d_pre = fc2_input_gelu.backward(ctx, got2.saved, {.dy = dy, .input_pre = got1.pre});
    const Tensor d_act = fc2.backward(ctx, plain2.saved, {dy});
    EXPECT_EQ(bits_of(d_pre), bits_of(ops::gelu_backward(ctx, d_act, got1.pre)));
    const std::vector<std::uint32_t> saved_grad = bits_of(fc2_input_gelu.parameters()[0]->grad);
    EXPECT_EQ(saved_grad, bits_of(fc2.parameters()[0]->grad));

    got2.saved.x = Tensor();  // recompute_activation
    const Tensor remade = fc2_input_gelu.backward(ctx, got2.saved, {.dy = dy, .input_pre = got1.pre});
    EXPECT_EQ(bits_of(remade), bits_of(d_pre));
    EXPECT_EQ(bits_of(fc2_input_gelu.parameters()[0]->grad), saved_grad);
    EXPECT_ERROR_CONTAINS(fc2_input_gelu.backward(ctx, got2.saved, {.dy = dy}),
                          "GroupedLinear 'fc2_input_gelu' backward: input_pre must be [tokens, 16]");
  }
}

TEST(GroupedLinearHostTest, AnActivationOfAPartialSumIsAnError) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "row", {.experts = 2, .in_features = 8, .out_features = 8,
                                                     .parallel = GroupedParallel::kRow,
                                                     .activation = LinearActivation::kGelu}, 1, &comm),
                          "GroupedLinear 'row': activation gelu on a row-parallel layer");
    EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "column", {.experts = 2, .in_features = 8, .out_features = 8,
                                                        .parallel = GroupedParallel::kColumn,
                                                        .input_activation = LinearActivation::kGelu}, 1, &comm),
                          "GroupedLinear 'column': input_activation gelu on a column-parallel layer");
  });
}

TEST(GroupedLinearHostTest, BadShapesAndConfigsAreErrors) {
  Context ctx(Device::kHost);
  GroupedLinear layer(ctx, "experts", {.experts = 3, .in_features = 4, .out_features = 2, .dtype = DType::kFloat32}, 1);
  const Tensor x = ctx.persistent("x", {Shape{5, 4}, DType::kFloat32});
  const Tensor wrong_x = ctx.persistent("wrong_x", {Shape{5, 3}, DType::kFloat32});
  const Tensor splits = ctx.persistent("splits", {Shape{3}, DType::kInt32});
  const Tensor wrong_count = ctx.persistent("wrong_count", {Shape{4}, DType::kInt32});
  const Tensor wrong_dtype = ctx.persistent("wrong_dtype", {Shape{3}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {wrong_x, splits}), "GroupedLinear 'experts' forward: input must be [tokens, 4] fp32, got [5, 3] fp32");
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {x, wrong_count}), "splits must be [3] int32 (one size per expert), got [4] int32");
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {x, wrong_dtype}), "splits must be [3] int32", "got [3] fp32");
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {x, Tensor()}), "splits must be [3] int32", "undefined");
  EXPECT_ERROR_CONTAINS(GroupedLinear(ctx, "none", {.experts = 0, .in_features = 4, .out_features = 2}, 1),
                        "GroupedLinear 'none': experts must be in [1, 1024], got 0");
  EXPECT_ERROR_CONTAINS(
      GroupedLinear(ctx, "fp16", {.experts = 2, .in_features = 4, .out_features = 2, .dtype = DType::kFloat16}, 1),
      "GroupedLinear 'fp16': dtype fp16 is not supported");
}

// ---- GPU ----

TEST(GroupedLinearCudaTest, CudaMatchesHostForwardAndEveryGradient) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  constexpr std::int64_t kIn = 64, kOut = 48, kTokens = 300, kExperts = 8;
  Ints splits(kExperts, 0);  // random, with empty experts
  std::uniform_int_distribution<int> pick(0, kExperts - 1);
  for (std::int64_t t = 0; t < kTokens; ++t) ++splits[pick(rng) % 5 == 0 ? 7 : pick(rng) / 2];
  const std::vector<float> x_values = testing::uniform_values(kTokens * kIn, rng, -1.0f, 1.0f);
  const std::vector<float> dy_values = testing::uniform_values(kTokens * kOut, rng, -1.0f, 1.0f);

  struct Result {
    std::vector<float> y, dx;
    std::vector<std::vector<float>> grads;
  };
  auto run = [&](Device device) {
    Context ctx(device);
    GroupedLinear layer(ctx, "experts",
                        {.experts = kExperts, .in_features = kIn, .out_features = kOut, .dtype = DType::kBFloat16}, 21);
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kIn}, DType::kBFloat16});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kOut}, DType::kBFloat16});
    write_floats(ctx, x, x_values);
    write_floats(ctx, dy, dy_values);
    const GroupedLinear::Forward f = layer.forward(ctx, {x, splits_tensor(ctx, splits)});
    Result out;
    out.dx = read_floats(ctx, layer.backward(ctx, f.saved, {dy}));
    out.y = read_floats(ctx, f.y);
    for (Parameter* p : layer.parameters()) out.grads.push_back(read_floats(ctx, p->grad));
    layer.check_splits(ctx);
    return out;
  };
  const Result cuda = run(Device::kCuda);
  const Result host = run(Device::kHost);
  EXPECT_LE(testing::relative_error(cuda.y, host.y), 1e-2);
  EXPECT_LE(testing::relative_error(cuda.dx, host.dx), 1e-2);
  ASSERT_EQ(cuda.grads.size(), host.grads.size());
  for (std::size_t i = 0; i < cuda.grads.size(); ++i) {
    EXPECT_LE(testing::relative_error(cuda.grads[i], host.grads[i]), 1e-3) << "gradient " << i;  // fp32 grads
  }
}

TEST(GroupedLinearCudaTest, BadSplitsRaiseAfterTheStepGraphed) {
  SG_SKIP_WITHOUT_GPU();
  check_bad_splits(Device::kCuda, true);
}

TEST(GroupedLinearCudaTest, BadSplitsRaiseAfterTheStepEager) {
  SG_SKIP_WITHOUT_GPU();
  check_bad_splits(Device::kCuda, false);
}

}  // namespace
}  // namespace stepgraph
