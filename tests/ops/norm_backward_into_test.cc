// norm_backward_into_ (the layers' norm backward, writing the parameter
// gradients in place) against norm_backward's outputs: the same bits for
// LayerNorm and RMSNorm, eager and captured, on the host and the GPU; bad
// gradient tensors are clear errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engine/context.h"
#include "engine/half_precision.h"
#include "graphs/captured_step.h"
#include "ops/elementwise_ops.h"
#include "ops/norm_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

Tensor bf16_tensor(Context& ctx, const std::string& name, Shape shape, std::mt19937& rng) {
  Tensor t = ctx.persistent(name, {shape, DType::kBFloat16});
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(shape.numel()));
  for (auto& b : bits) b = float_to_bf16(uniform(rng));
  ctx.copy_from_host(t, bits.data(), bits.size() * sizeof(std::uint16_t));
  return t;
}

void expect_into_equals_outputs(Device device) {
  testing::SeededRng seeds;
  std::mt19937 rng(seeds() % 100000);
  Context ctx(device);
  constexpr std::int64_t kRows = 67, kHidden = 320;
  const Tensor x = bf16_tensor(ctx, "x", Shape{kRows, kHidden}, rng);
  const Tensor dy = bf16_tensor(ctx, "dy", Shape{kRows, kHidden}, rng);
  const Tensor gamma = bf16_tensor(ctx, "gamma", Shape{kHidden}, rng);
  const Tensor beta = bf16_tensor(ctx, "beta", Shape{kHidden}, rng);
  for (kernels::NormKind kind : {kernels::NormKind::kLayerNorm, kernels::NormKind::kRMSNorm}) {
    const bool layernorm = kind == kernels::NormKind::kLayerNorm;
    SCOPED_TRACE(layernorm ? "layernorm" : "rmsnorm");
    const ops::NormParams params{kind, 1e-5f};
    const ops::NormForward f = ops::norm_forward(ctx, params, x, gamma, layernorm ? beta : Tensor());
    const ops::NormBackward want = ops::norm_backward(ctx, params, dy, x, f.mean, f.rstd, gamma);
    const Tensor dgamma = ctx.persistent("dgamma", {Shape{kHidden}, DType::kFloat32});
    const Tensor dbeta = ctx.persistent("dbeta", {Shape{kHidden}, DType::kFloat32});
    const Tensor dx =
        ops::norm_backward_into_(ctx, params, dy, x, f.mean, f.rstd, gamma, dgamma, layernorm ? dbeta : Tensor());
    EXPECT_EQ(ctx.to_vector<std::uint16_t>(dx), ctx.to_vector<std::uint16_t>(want.dx));
    EXPECT_EQ(ctx.to_vector<float>(dgamma), ctx.to_vector<float>(want.dgamma));
    if (layernorm) EXPECT_EQ(ctx.to_vector<float>(dbeta), ctx.to_vector<float>(want.dbeta));

    // Captured: the gradients land in the same persistent tensors at every replay.
    const Tensor rstd = ctx.persistent("rstd", f.rstd.meta());  // a captured step reads persistent tensors
    ops::copy_(ctx, rstd, f.rstd);
    Tensor mean;
    if (layernorm) {
      mean = ctx.persistent("mean", f.mean.meta());
      ops::copy_(ctx, mean, f.mean);
    }
    const Tensor graph_dgamma = ctx.persistent("graph.dgamma", {Shape{kHidden}, DType::kFloat32});
    const Tensor graph_dbeta = ctx.persistent("graph.dbeta", {Shape{kHidden}, DType::kFloat32});
    auto step = CapturedStep::capture(ctx, [&] {
      return std::vector<Tensor>{ops::norm_backward_into_(ctx, params, dy, x, mean, rstd, gamma, graph_dgamma,
                                                          layernorm ? graph_dbeta : Tensor())};
    });
    step->replay();
    EXPECT_EQ(ctx.to_vector<std::uint16_t>(step->outputs()[0]), ctx.to_vector<std::uint16_t>(want.dx));
    EXPECT_EQ(ctx.to_vector<float>(graph_dgamma), ctx.to_vector<float>(want.dgamma));
    if (layernorm) EXPECT_EQ(ctx.to_vector<float>(graph_dbeta), ctx.to_vector<float>(want.dbeta));
  }
  const ops::NormParams params{kernels::NormKind::kLayerNorm, 1e-5f};
  const ops::NormForward f = ops::norm_forward(ctx, params, x, gamma, beta);
  const Tensor wrong = ctx.persistent("wrong", {Shape{kHidden + 1}, DType::kFloat32});
  const Tensor dbeta = ctx.persistent("dbeta.ok", {Shape{kHidden}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(ops::norm_backward_into_(ctx, params, dy, x, f.mean, f.rstd, gamma, wrong, dbeta),
                        "norm_backward_into_", "dgamma must be [320] fp32");
}

TEST(NormBackwardIntoTest, WritesTheGradientsNormBackwardOutputsOnTheHost) {
  expect_into_equals_outputs(Device::kHost);
}

TEST(NormBackwardIntoTest, WritesTheGradientsNormBackwardOutputsOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_into_equals_outputs(Device::kCuda);
}

}  // namespace
}  // namespace stepgraph
