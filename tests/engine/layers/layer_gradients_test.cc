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
#include "engine/layers/layernorm_linear.h"
#include "engine/layers/layernorm_mlp.h"
#include "engine/layers/linear.h"
#include "engine/layers/norm.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kTokens = 3;

class GradientCheck {
 public:
  explicit GradientCheck(Context& ctx) : ctx_(ctx), rng_(std::random_device{}()) {}

  Tensor random_tensor(const std::string& name, const Shape& shape) {
    Tensor t = ctx_.persistent(name, {shape, DType::kFloat32});
    std::vector<float> values = random_values(shape.numel());
    ctx_.copy_from_host(t, values.data(), values.size() * sizeof(float));
    return t;
  }

  std::vector<float> random_values(std::int64_t n) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> out(static_cast<std::size_t>(n));
    for (float& v : out) v = uniform(rng_);
    return out;
  }

  // The loss of forward(), which returns y; r is fixed per check.
  double loss(const std::function<Tensor()>& forward, const std::vector<float>& r) {
    const std::vector<float> y = ctx_.to_vector<float>(forward());
    double total = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) total += static_cast<double>(y[i]) * r[i];
    return total;
  }

  // Compares `analytic` (the gradient w.r.t. `tensor`) with central
  // differences of loss() at a few random elements of `tensor`.
  void expect_matches(const std::string& what, const Tensor& tensor, const std::vector<float>& analytic,
                      const std::function<Tensor()>& forward, const std::vector<float>& r) {
    std::vector<float> values = ctx_.to_vector<float>(tensor);
    ASSERT_EQ(values.size(), analytic.size()) << what;
    std::uniform_int_distribution<std::size_t> pick(0, values.size() - 1);
    constexpr float kStep = 1e-2f;
    for (int trial = 0; trial < 6; ++trial) {
      const std::size_t i = pick(rng_);
      const float saved = values[i];
      values[i] = saved + kStep;
      ctx_.copy_from_host(tensor, values.data(), values.size() * sizeof(float));
      const double up = loss(forward, r);
      values[i] = saved - kStep;
      ctx_.copy_from_host(tensor, values.data(), values.size() * sizeof(float));
      const double down = loss(forward, r);
      values[i] = saved;
      ctx_.copy_from_host(tensor, values.data(), values.size() * sizeof(float));
      const double numeric = (up - down) / (2.0 * kStep);
      EXPECT_NEAR(analytic[i], numeric, 2e-2 * std::max(1.0, std::fabs(numeric)))
          << what << "[" << i << "]: analytic " << analytic[i] << ", finite difference " << numeric;
    }
  }

  Context& ctx() { return ctx_; }

 private:
  Context& ctx_;
  std::mt19937 rng_;
};

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
  EXPECT_THROW(layer.forward(ctx, {wrong}), Error);
  EXPECT_THROW(Linear(ctx, "bad", {.in_features = 0, .out_features = 2}, 1), Error);
}

}  // namespace
}  // namespace stepgraph
