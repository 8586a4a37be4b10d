// The inputs each op writes in place (what the planner and the stream order
// see), now derived from the named operands' use: pinned here against the
// lists the ops held by hand, so a field marked read or write by mistake fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kernels/gemm.h"
#include "ops/attention_ops.h"
#include "ops/embedding_ops.h"
#include "ops/fp8_ops.h"
#include "ops/gemm_ops.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/loss_ops.h"
#include "ops/moe_ops.h"
#include "ops/norm_ops.h"
#include "ops/registry.h"

namespace stepgraph {
namespace {

std::vector<int> written(const char* op, const OpParams& params, std::size_t inputs) {
  std::vector<int> out = ops::find_op(op).written_inputs(params, inputs);
  std::sort(out.begin(), out.end());
  return out;
}

using Indices = std::vector<int>;

TEST(WrittenInputsTest, GemmIntoWritesDAuxAndTheBiasGradientInPlace) {
  using kernels::GemmEpilogue;
  // a, b, bias, aux (written by the epilogue), d
  EXPECT_EQ(written("gemm_into_", ops::GemmParams{.epilogue = GemmEpilogue::kGeluAuxBias}, 5), (Indices{3, 4}));
  // a, b, aux (read), d, bias_grad
  ops::GemmParams dgelu{.epilogue = GemmEpilogue::kDGeluBGrad};
  dgelu.bias_grad_into = true;
  EXPECT_EQ(written("gemm_into_", dgelu, 5), (Indices{3, 4}));
  // a, b, a_scale_inv, b_scale_inv, d
  ops::GemmParams fp8;
  fp8.fp8_scales = true;
  EXPECT_EQ(written("gemm_into_", fp8, 5), (Indices{4}));
  EXPECT_EQ(written("gemm", ops::GemmParams{.epilogue = GemmEpilogue::kGeluAuxBias}, 3), Indices{});
}

TEST(WrittenInputsTest, NormBackwardIntoWritesItsParameterGradients) {
  ops::NormParams layernorm;
  EXPECT_EQ(written("norm_backward_into_", layernorm, 7), (Indices{5, 6}));  // dy, x, mean, rstd, gamma, dgamma, dbeta
  ops::NormParams rmsnorm{.kind = kernels::NormKind::kRMSNorm, .dx_residual = true};
  EXPECT_EQ(written("norm_backward_into_", rmsnorm, 6), (Indices{4}));  // dy, x, rstd, gamma, dgamma, dx_residual
  EXPECT_EQ(written("norm_backward", layernorm, 5), Indices{});
}

TEST(WrittenInputsTest, Fp8OpsWriteTheirDestinationsAndState) {
  EXPECT_EQ(written("quantize_into_", ops::QuantizeParams{.rowwise = true, .columnwise = true}, 5), (Indices{2, 3, 4}));
  EXPECT_EQ(written("quantize_into_", ops::QuantizeParams{.rowwise = false, .columnwise = true}, 4), (Indices{2, 3}));
  EXPECT_EQ(written("delayed_scaling_update_", ops::DelayedScalingParams{}, 4), (Indices{1, 2, 3}));
  EXPECT_EQ(written("count_flags_", NoParams{}, 3), (Indices{0}));
}

TEST(WrittenInputsTest, ErrorWordsGradientsAndBucketsAreWritten) {
  EXPECT_EQ(written("cross_entropy", ops::CrossEntropyParams{}, 3), (Indices{2}));
  EXPECT_EQ(written("embedding", ops::EmbeddingParams{}, 3), (Indices{2}));
  EXPECT_EQ(written("embedding_backward", ops::EmbeddingParams{}, 3), (Indices{0}));
  EXPECT_EQ(written("moe_plan", ops::MoEPlanParams{.experts = 4}, 2), (Indices{1}));
  EXPECT_EQ(written("split_offsets", ops::SplitOffsetsParams{.tokens = 8}, 2), (Indices{1}));
  EXPECT_EQ(written("grouped_linear_wgrad_", ops::GroupedGemmParams{}, 4), (Indices{0}));
  EXPECT_EQ(written("grouped_bias_grad_", ops::GroupedGemmParams{}, 3), (Indices{0}));
  EXPECT_EQ(written("grouped_fp8_wgrad_", ops::GroupedGemmParams{}, 6), (Indices{0}));
  EXPECT_EQ(written("unpack_", NoParams{}, 4), (Indices{1, 2, 3}));
  EXPECT_EQ(written("copy_", NoParams{}, 2), (Indices{0}));
  EXPECT_EQ(written("attention_backward", ops::AttentionParams{}, 7), Indices{});
}

}  // namespace
}  // namespace stepgraph
