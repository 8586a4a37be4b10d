// Every layer's gradients against central finite differences, on the host in
// fp32 (the unfused path of LayerNormMLP), with fresh random inputs each run.
// The loss is L = sum(y * r) for a random r, so dL/dy = r.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "layers/layernorm_linear.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "tests/layers/gradient_check.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kTokens = 3;

using testing::GradientCheck;

// For a layer with forward(ctx, {x}).y and backward(ctx, saved, {dy}) -> dx:
// x and r random, dy = r; dx and every parameter gradient against finite differences.
template <typename Layer>
void expect_gradients_match(Context& ctx, GradientCheck& check, Layer& layer, std::int64_t in_features,
                            std::int64_t out_features) {
  const Tensor x = check.random_tensor("x", Shape{kTokens, in_features});
  const std::vector<float> r = check.random_values(kTokens * out_features);
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, out_features}, DType::kFloat32});
  ctx.copy_from_host(dy, r.data(), r.size() * sizeof(float));
  auto forward = [&] { return layer.forward(ctx, {x}).y; };
  const auto f = layer.forward(ctx, {x});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  check.expect_matches("dx", x, ctx.to_vector<float>(dx), forward, r);
  for (Parameter* p : layer.parameters()) {
    check.expect_matches(p->name, p->master, ctx.to_vector<float>(p->grad), forward, r);
  }
}

TEST(LayerGradientsTest, LinearWithBiasFp32) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  Linear layer(ctx, "fc", {.in_features = 5, .out_features = 4, .bias = true, .dtype = DType::kFloat32}, 3);
  expect_gradients_match(ctx, check, layer, 5, 4);
}

void check_norm(kernels::NormKind kind) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  Norm layer(ctx, "norm", {kind, 8, 1e-5f, DType::kFloat32});
  // Non-trivial gamma/beta so their gradients are exercised.
  for (Parameter* p : layer.parameters()) {
    const std::vector<float> values = check.random_values(8);
    ctx.copy_from_host(p->master, values.data(), 32);
  }
  expect_gradients_match(ctx, check, layer, 8, 8);
}

TEST(LayerGradientsTest, LayerNormFp32) { check_norm(kernels::NormKind::kLayerNorm); }
TEST(LayerGradientsTest, RMSNormFp32) { check_norm(kernels::NormKind::kRMSNorm); }

TEST(LayerGradientsTest, LayerNormLinearFp32) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  LayerNormLinear layer(ctx, "lnl",
                        {.linear = {.in_features = 8, .out_features = 4, .bias = true, .dtype = DType::kFloat32}}, 5);
  expect_gradients_match(ctx, check, layer, 8, 4);
}

TEST(LayerGradientsTest, LayerNormMLPFp32) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  LayerNormMLP layer(ctx, "mlp", {.hidden = 8, .ffn = 16, .dtype = DType::kFloat32}, 7);
  expect_gradients_match(ctx, check, layer, 8, 8);
}

TEST(LayerGradientsTest, SavedInputIsAReferenceNotACopy) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  Linear layer(ctx, "fc", {.in_features = 4, .out_features = 4, .bias = false, .dtype = DType::kFloat32}, 1);
  const Tensor x = check.random_tensor("x", Shape{kTokens, 4});
  const Linear::Forward f = layer.forward(ctx, {x});
  EXPECT_EQ(f.saved.x.impl(), x.impl());
}

TEST(LayerGradientsTest, BadInputShapesAreErrors) {
  Context ctx(Device::kHost);
  Linear layer(ctx, "fc", {.in_features = 4, .out_features = 2, .dtype = DType::kFloat32}, 1);
  const Tensor wrong = ctx.persistent("wrong", {Shape{3, 5}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {wrong}), "input must be [tokens, 4] fp32, got [3, 5] fp32");
  EXPECT_ERROR_CONTAINS(Linear(ctx, "bad", {.in_features = 0, .out_features = 2}, 1),
                        "Linear 'bad': in_features and out_features must be > 0, got 0 and 2");
}

}  // namespace
}  // namespace stepgraph
