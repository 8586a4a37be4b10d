// A Linear's epilogue fields (Note [Linear epilogues] in layers/linear.h) on
// the host backend: the activation (GeLU with its pre-activation), the input
// activation (GeLU's derivative on dx with the Linear before's bias
// gradient), the input made again from input_pre, the errors that name what
// does not fit, and the LayerNormMLP built from two such Linears recording
// the fused GEMMs of a hand-written block.
//
// Exactness: in fp32 cuBLASLt has no GeLU epilogues, so the fields run GeLU
// and its derivative as ops after the GEMMs: bit for bit what a caller gets
// from the plain Linear and the ops. In bf16 the epilogues apply GeLU and
// its derivative to the fp32 accumulator where the ops read the rounded
// 16-bit product, so those values differ by bf16 rounding (allowed 2e-2 of
// the largest value); the pre-activation itself is the BIAS GEMM's, bit for bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "graphs/program.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "ops/activation_ops.h"
#include "ops/elementwise_ops.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using testing::bits;
using testing::random_values;
using testing::read_floats;
using testing::relative;
using testing::write_floats;

constexpr std::int64_t kTokens = 16;
constexpr std::int64_t kIn = 32;
constexpr std::int64_t kOut = 48;

Tensor random_tensor(Context& ctx, const std::string& name, const Shape& shape, DType dtype, std::uint32_t seed,
                     float sigma) {
  const Tensor t = ctx.persistent(name, {shape, dtype});
  std::mt19937 rng(seed);
  write_floats(ctx, t, random_values(shape.numel(), rng, sigma));
  return t;
}

// "stream op epilogue-or-params" of each instruction `step` records.
std::vector<std::string> recorded(Context& ctx, const std::function<std::vector<Tensor>()>& step) {
  auto captured = CapturedStep::capture(ctx, step, {.pool_report_policy = PoolReportPolicy::kError});
  std::vector<std::string> out;
  for (const Instruction& i : captured->program().instructions()) {
    out.push_back("s" + std::to_string(i.stream) + " " + std::string(i.op->name) + " " + i.params.to_string());
  }
  return out;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(LinearEpilogueTest, GeluActivationInFp32IsTheBiasGemmThenGeluBitForBit) {
  Context ctx(Device::kHost);
  const LinearConfig plain_config{.in_features = kIn, .out_features = kOut, .dtype = DType::kFloat32};
  LinearConfig gelu_config = plain_config;
  gelu_config.activation = LinearActivation::kGelu;
  const Linear plain(ctx, "plain", plain_config, 3);
  const Linear gelu(ctx, "gelu", gelu_config, 3);  // the same seed: the same weights
  const Tensor x = random_tensor(ctx, "x", Shape{kTokens, kIn}, DType::kFloat32, 1, 1.0f);
  const Linear::Forward want = plain.forward(ctx, {x});
  const Linear::Forward got = gelu.forward(ctx, {x});
  EXPECT_FALSE(want.pre.defined()) << "no activation, no pre";
  EXPECT_EQ(bits(read_floats(ctx, got.pre)), bits(read_floats(ctx, want.y)));
  EXPECT_EQ(bits(read_floats(ctx, got.y)), bits(read_floats(ctx, ops::gelu(ctx, want.y))));
}

TEST(LinearEpilogueTest, GeluActivationInBf16IsOneGemmWithTheGeluAuxBiasEpilogue) {
  Context ctx(Device::kHost);
  const Linear plain(ctx, "plain", {.in_features = kIn, .out_features = kOut}, 3);
  const Linear gelu(ctx, "gelu", {.in_features = kIn, .out_features = kOut, .activation = LinearActivation::kGelu},
                    3);
  const Tensor x = random_tensor(ctx, "x", Shape{kTokens, kIn}, DType::kBFloat16, 1, 1.0f);
  const std::vector<std::string> ops = recorded(ctx, [&] {
    const Linear::Forward f = gelu.forward(ctx, {x});
    return std::vector<Tensor>{f.y, f.pre};
  });
  ASSERT_EQ(ops.size(), 1u) << "GeLU rides the GEMM";
  EXPECT_TRUE(contains(ops[0], "gemm B^T gelu_aux_bias")) << ops[0];

  const Linear::Forward want = plain.forward(ctx, {x});
  const Linear::Forward got = gelu.forward(ctx, {x});
  EXPECT_EQ(bits(read_floats(ctx, got.pre)), bits(read_floats(ctx, want.y))) << "pre is the BIAS GEMM's output";
  EXPECT_LT(relative(read_floats(ctx, got.y), read_floats(ctx, ops::gelu(ctx, want.y))), 2e-2);
}

// fc1 (GeLU) -> fc2 (input GeLU): fc2's backward returns the gradient of
// fc1's pre-activation and, where the epilogue makes it, fc1's bias gradient.
struct Chain {
  Chain(Context& ctx, DType dtype)
      : fc1(ctx, "fc1", {.in_features = kIn, .out_features = kOut, .dtype = dtype,
                         .activation = LinearActivation::kGelu}, 5),
        fc2(ctx, "fc2", {.in_features = kOut, .out_features = kIn, .dtype = dtype,
                         .input_activation = LinearActivation::kGelu}, 7),
        fc2_plain(ctx, "fc2_plain", {.in_features = kOut, .out_features = kIn, .dtype = dtype}, 7),
        x(random_tensor(ctx, "x", Shape{kTokens, kIn}, dtype, 1, 1.0f)),
        dy(random_tensor(ctx, "dy", Shape{kTokens, kIn}, dtype, 2, 0.1f)) {}
  Linear fc1, fc2, fc2_plain;
  Tensor x, dy;
};

TEST(LinearEpilogueTest, InputGeluInFp32IsThePlainDataGradientThenGeluBackwardBitForBit) {
  Context ctx(Device::kHost);
  Chain c(ctx, DType::kFloat32);
  const Linear::Forward f1 = c.fc1.forward(ctx, {c.x});
  const Linear::Forward f2 = c.fc2.forward(ctx, {f1.y});
  const Linear::Backward got = c.fc2.backward_fused(ctx, f2.saved, {.dy = c.dy, .input_pre = f1.pre});
  EXPECT_FALSE(got.input_bias_grad.defined()) << "fp32 has no DGELU_BGRAD: fc1 sums its own bias gradient";
  const Linear::Forward plain = c.fc2_plain.forward(ctx, {f1.y});
  const Tensor d_act = c.fc2_plain.backward(ctx, plain.saved, {c.dy});
  EXPECT_EQ(bits(read_floats(ctx, got.dx)), bits(read_floats(ctx, ops::gelu_backward(ctx, d_act, f1.pre))));
  EXPECT_EQ(bits(read_floats(ctx, c.fc2.weight().grad)), bits(read_floats(ctx, c.fc2_plain.weight().grad)));
}

TEST(LinearEpilogueTest, InputGeluInBf16FusesTheDerivativeAndTheBiasGradientOfTheLinearBefore) {
  Context ctx(Device::kHost, 2);
  Chain c(ctx, DType::kBFloat16);
  const std::vector<std::string> ops = recorded(ctx, [&] {
    const Linear::Forward f1 = c.fc1.forward(ctx, {c.x});
    const Linear::Forward f2 = c.fc2.forward(ctx, {f1.y});
    const Linear::Backward d = c.fc2.backward_fused(ctx, f2.saved, {.dy = c.dy, .input_pre = f1.pre});
    return std::vector<Tensor>{f2.y, d.dx, d.input_bias_grad};
  });
  // The data gradient first (the Linear before goes on from it), then the
  // weight gradient on the weight-gradient stream.
  ASSERT_EQ(ops.size(), 4u) << ::testing::PrintToString(ops);
  EXPECT_TRUE(contains(ops[0], "s0 gemm B^T gelu_aux_bias")) << ops[0];
  EXPECT_TRUE(contains(ops[1], "s0 gemm B^T bias")) << ops[1];
  EXPECT_TRUE(contains(ops[2], "s0 gemm dgelu_bgrad")) << ops[2];
  EXPECT_TRUE(contains(ops[3], "s1 gemm_into_ A^T bias_grad_of_a")) << ops[3];

  const Linear::Forward f1 = c.fc1.forward(ctx, {c.x});
  const Linear::Forward f2 = c.fc2.forward(ctx, {f1.y});
  const Linear::Backward got = c.fc2.backward_fused(ctx, f2.saved, {.dy = c.dy, .input_pre = f1.pre});
  ASSERT_TRUE(got.input_bias_grad.defined());
  const Linear::Forward plain = c.fc2_plain.forward(ctx, {f1.y});
  const Tensor d_pre = ops::gelu_backward(ctx, c.fc2_plain.backward(ctx, plain.saved, {c.dy}), f1.pre);
  EXPECT_LT(relative(read_floats(ctx, got.dx), read_floats(ctx, d_pre)), 2e-2);

  // fc1's bias gradient handed over equals the one fc1 sums itself (BGRADB), up to bf16 rounding.
  const Parameter& fc1_bias = *c.fc1.parameters()[1];
  c.fc1.backward(ctx, f1.saved, {.dy = d_pre});
  const std::vector<float> summed = read_floats(ctx, fc1_bias.grad);
  c.fc1.backward(ctx, f1.saved, {.dy = got.dx, .bias_grad = got.input_bias_grad});
  const std::vector<float> handed_over = read_floats(ctx, fc1_bias.grad);
  EXPECT_LT(relative(handed_over, summed), 2e-2);
  EXPECT_EQ(bits(handed_over), bits(read_floats(ctx, ops::cast(ctx, got.input_bias_grad, DType::kFloat32))))
      << "the handed-over bias gradient, in fp32";
}

// Note [Recomputed activation]: a saved input left undefined is GeLU(input_pre) again.
TEST(LinearEpilogueTest, AnUndefinedSavedInputIsMadeAgainFromInputPre) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Context ctx(Device::kHost);
    Chain c(ctx, dtype);
    const Linear::Forward f1 = c.fc1.forward(ctx, {c.x});
    Linear::Forward f2 = c.fc2.forward(ctx, {f1.y});
    c.fc2.backward(ctx, f2.saved, {.dy = c.dy, .input_pre = f1.pre});
    const std::vector<float> saved_grad = read_floats(ctx, c.fc2.weight().grad);
    f2.saved.x = Tensor();
    c.fc2.backward(ctx, f2.saved, {.dy = c.dy, .input_pre = f1.pre});
    const std::vector<float> remade_grad = read_floats(ctx, c.fc2.weight().grad);
    if (dtype == DType::kFloat32) {
      EXPECT_EQ(bits(remade_grad), bits(saved_grad)) << "fp32: GeLU was an op in the forward too";
    } else {
      EXPECT_LT(relative(remade_grad, saved_grad), 2e-2) << "GeLU of the 16-bit pre against the epilogue's";
    }
  }
}

TEST(LinearEpilogueTest, ErrorsNameWhatDoesNotFit) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(Linear(ctx, "row", {.in_features = 8, .out_features = 8,
                                              .tensor_parallel = TensorParallelMode::kRow,
                                              .activation = LinearActivation::kGelu}, 1, &comm),
                          "Linear 'row': activation gelu on a row-parallel layer would act on each rank's partial sum");
    EXPECT_ERROR_CONTAINS(Linear(ctx, "column", {.in_features = 8, .out_features = 8,
                                                 .tensor_parallel = TensorParallelMode::kColumn,
                                                 .input_activation = LinearActivation::kGelu}, 1, &comm),
                          "Linear 'column': input_activation gelu on a column-parallel layer");
  });
  Context ctx(Device::kHost);
  const Linear fc2(ctx, "fc2", {.in_features = 8, .out_features = 4, .dtype = DType::kFloat32,
                                .input_activation = LinearActivation::kGelu}, 1);
  const Tensor x = random_tensor(ctx, "x", Shape{5, 8}, DType::kFloat32, 1, 1.0f);
  const Tensor dy = random_tensor(ctx, "dy", Shape{5, 4}, DType::kFloat32, 2, 1.0f);
  const Linear::Forward f = fc2.forward(ctx, {x});
  EXPECT_ERROR_CONTAINS(fc2.backward(ctx, f.saved, {.dy = dy}),
                        "Linear 'fc2' backward: input_pre must be [5, 8] fp32 (the pre-activation of the forward's "
                        "input");
  const Linear no_bias(ctx, "no_bias", {.in_features = 8, .out_features = 4, .bias = false,
                                        .dtype = DType::kFloat32}, 1);
  const Linear::Forward g = no_bias.forward(ctx, {x});
  EXPECT_ERROR_CONTAINS(no_bias.backward(ctx, g.saved, {.dy = dy, .bias_grad = dy}),
                        "Linear 'no_bias' backward: got a bias_grad but the layer has no bias");
}

// The MLP of two Linears records what the hand-written block did: GeLU in
// fc1's epilogue, GeLU's derivative and fc1's bias gradient in fc2's data
// gradient, fc2's bias gradient in its weight gradient; the weight gradients
// on the weight-gradient stream.
TEST(LinearEpilogueTest, Bf16LayerNormMLPRecordsTheFusedGemms) {
  Context ctx(Device::kHost, 2);
  const LayerNormMLP mlp(ctx, "mlp", {.hidden = kIn, .ffn = kOut}, 11);
  const Tensor x = random_tensor(ctx, "x", Shape{kTokens, kIn}, DType::kBFloat16, 1, 1.0f);
  const Tensor dy = random_tensor(ctx, "dy", Shape{kTokens, kIn}, DType::kBFloat16, 2, 0.1f);
  const std::vector<std::string> ops = recorded(ctx, [&] {
    const LayerNormMLP::Forward f = mlp.forward(ctx, {x});
    return std::vector<Tensor>{f.y, mlp.backward(ctx, f.saved, {dy})};
  });
  const std::vector<std::string> want = {
      "s0 norm_forward",       "s0 gemm B^T gelu_aux_bias", "s0 gemm B^T bias",     "s0 gemm dgelu_bgrad",
      "s1 gemm_into_ A^T bias_grad_of_a", "s1 cast",      "s1 copy_",             "s1 gemm_into_ A^T none",
      "s0 gemm none",          "s0 norm_backward_into_"};
  ASSERT_EQ(ops.size(), want.size()) << ::testing::PrintToString(ops);
  for (std::size_t i = 0; i < ops.size(); ++i) EXPECT_TRUE(contains(ops[i], want[i])) << ops[i] << " vs " << want[i];
}

}  // namespace
}  // namespace stepgraph
