// FP8 ops on the host backend: the quantize op equals its host reference,
// fp8_gemm equals the GEMM host reference on the quantized bytes, and an FP8
// linear layer's forward and backward (every product TN through the
// quantize op's row-wise and column-wise copies; E4M3 activations and
// weights, E5M2 gradients) stay within FP8's error of the bf16 layer.
#include "ops/fp8_ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/fp8.h"
#include "engine/half_precision.h"
#include "kernels/fp8_quantize.h"
#include "ops/gemm_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph::ops {
namespace {

struct Bf16Matrix {
  std::int64_t rows, cols;
  std::vector<std::uint16_t> bits;
  float at(std::int64_t r, std::int64_t c) const { return bf16_to_float(bits[r * cols + c]); }
};

Bf16Matrix random_matrix(std::int64_t rows, std::int64_t cols, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> normal(0.0f, sigma);
  Bf16Matrix m{rows, cols, std::vector<std::uint16_t>(static_cast<std::size_t>(rows * cols))};
  for (auto& b : m.bits) b = float_to_bf16(normal(rng));
  return m;
}

Tensor upload(Context& ctx, const std::string& name, const Bf16Matrix& m) {
  const Tensor t = ctx.persistent(name, {Shape{m.rows, m.cols}, DType::kBFloat16});
  ctx.copy_from_host(t, m.bits.data(), m.bits.size() * 2);
  return t;
}

Tensor scalar(Context& ctx, const std::string& name, float value) {
  const Tensor t = ctx.persistent(name, {Shape{1}, DType::kFloat32});
  ctx.copy_from_host(t, &value, sizeof(value));
  return t;
}

// Current scaling by hand: amax, then scale = fp8_max / amax.
float current_scale(const Bf16Matrix& m, Fp8Format format) {
  float amax = 0.0f;
  for (const auto b : m.bits) amax = std::max(amax, std::fabs(bf16_to_float(b)));
  return kernels::fp8_scale(amax, format, 0, false);
}

std::vector<float> to_floats(Context& ctx, const Tensor& t) {
  std::vector<float> out;
  if (t.dtype() == DType::kFloat32) return ctx.to_vector<float>(t);
  for (const auto b : ctx.to_vector<std::uint16_t>(t)) out.push_back(bf16_to_float(b));
  return out;
}

// max |got - want| / max |want|
double relative(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return diff / scale;
}

TEST(Fp8OpsHostTest, QuantizeOpEqualsTheHostReference) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  Context ctx(Device::kHost);
  const Bf16Matrix x = random_matrix(40, 72, rng, 3.0f);
  const float scale = current_scale(x, Fp8Format::kE4M3);
  const Quantized q =
      quantize(ctx, upload(ctx, "x", x), scalar(ctx, "scale", scale), {Fp8Format::kE4M3, true, true});
  EXPECT_EQ(q.rowwise.dtype(), DType::kFloat8E4M3);
  EXPECT_EQ(q.columnwise.shape(), (Shape{72, 40}));
  std::vector<std::uint8_t> rows(x.bits.size()), cols(x.bits.size());
  float amax = 0.0f;
  kernels::quantize_host({DType::kBFloat16, Fp8Format::kE4M3, 40, 72, true, true}, x.bits.data(), scale, rows.data(),
                         cols.data(), &amax);
  EXPECT_EQ(ctx.to_vector<std::uint8_t>(q.rowwise), rows);
  EXPECT_EQ(ctx.to_vector<std::uint8_t>(q.columnwise), cols);
  EXPECT_EQ(ctx.to_vector<float>(q.amax), std::vector<float>{amax});
}

TEST(Fp8OpsHostTest, BadCallsAreClearErrors) {
  Context ctx(Device::kHost);
  const Tensor x3 = ctx.persistent("x3", {Shape{2, 3, 4}, DType::kBFloat16});
  const Tensor s = scalar(ctx, "s", 1.0f);
  // A 3-D x is the matrix of its last dimension's rows (a grouped weight [E, N, K] as [E * N, K]); 1-D is not.
  EXPECT_EQ(quantize(ctx, x3, s, {Fp8Format::kE4M3, true, true}).columnwise.shape(), (Shape{4, 6}));
  const Tensor x1 = ctx.persistent("x1", {Shape{8}, DType::kBFloat16});
  EXPECT_ERROR_CONTAINS(quantize(ctx, x1, s, {}), "[rows, cols]");
  const Tensor x = ctx.persistent("x", {Shape{16, 16}, DType::kBFloat16});
  const Quantized q = quantize(ctx, x, s, {Fp8Format::kE4M3, true, false});
  EXPECT_ERROR_CONTAINS(gemm(ctx, q.rowwise, q.rowwise, {.trans_b = true}), "scale_inv", "fp8_gemm");
  EXPECT_ERROR_CONTAINS(fp8_gemm(ctx, q.rowwise, s, q.rowwise, s, {.trans_b = false}), "TN");
}

// y = x W^T, dx = dy W, dW = dy^T x, each an FP8 GEMM in TN form, against the
// same products of the bf16 values in double.
TEST(Fp8OpsHostTest, Fp8LinearForwardAndBackwardStayWithinFp8Error) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  Context ctx(Device::kHost);
  const std::int64_t tokens = 64, in = 96, out = 48;
  const Bf16Matrix x = random_matrix(tokens, in, rng, 1.0f);
  const Bf16Matrix w = random_matrix(out, in, rng, 0.1f);
  const Bf16Matrix dy = random_matrix(tokens, out, rng, 0.01f);

  // Current scaling as a step does it: amax, then the scales, then the copies.
  auto quantized = [&](const std::string& name, const Bf16Matrix& m, Fp8Format format) {
    const Tensor t = upload(ctx, name, m);
    const Scales s = scale_from_amax(ctx, amax(ctx, t), {format, false});
    EXPECT_EQ(ctx.to_vector<float>(s.scale), std::vector<float>{current_scale(m, format)});
    return std::pair{quantize(ctx, t, s.scale, {format, true, true}), s.scale_inv};
  };
  const auto [xq, x_inv] = quantized("x", x, Fp8Format::kE4M3);
  const auto [wq, w_inv] = quantized("w", w, Fp8Format::kE4M3);
  const auto [dyq, dy_inv] = quantized("dy", dy, Fp8Format::kE5M2);

  const GemmParams tn{.trans_b = true, .out_dtype = DType::kFloat32};
  const Tensor y = fp8_gemm(ctx, xq.rowwise, x_inv, wq.rowwise, w_inv, tn).d;              // [T, out]
  const Tensor dx = fp8_gemm(ctx, dyq.rowwise, dy_inv, wq.columnwise, w_inv, tn).d;        // [T, in]
  const Tensor dw = fp8_gemm(ctx, dyq.columnwise, dy_inv, xq.columnwise, x_inv, tn).d;     // [out, in]

  std::vector<double> y_want(tokens * out), dx_want(tokens * in), dw_want(out * in);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t i = 0; i < in; ++i) {
        y_want[t * out + o] += static_cast<double>(x.at(t, i)) * w.at(o, i);
        dx_want[t * in + i] += static_cast<double>(dy.at(t, o)) * w.at(o, i);
        dw_want[o * in + i] += static_cast<double>(dy.at(t, o)) * x.at(t, i);
      }
  // E4M3 keeps 3 mantissa bits (relative rounding up to 1/16), E5M2 2 bits
  // (1/8); sums of many such products land well inside these bounds.
  EXPECT_LT(relative(to_floats(ctx, y), y_want), 0.06);
  EXPECT_LT(relative(to_floats(ctx, dx), dx_want), 0.10);
  EXPECT_LT(relative(to_floats(ctx, dw), dw_want), 0.10);
  // And they are not just bf16 GEMMs: the FP8 rounding shows.
  EXPECT_GT(relative(to_floats(ctx, y), y_want), 1e-4);
}

TEST(Fp8OpsHostTest, ScaleFromAmaxFollowsTheRuleAndFlagsNonFiniteAmax) {
  Context ctx(Device::kHost);
  const Scales s = scale_from_amax(ctx, scalar(ctx, "amax", 2.0f), {Fp8Format::kE4M3, false});
  EXPECT_EQ(ctx.to_vector<float>(s.scale), std::vector<float>{224.0f});
  EXPECT_EQ(ctx.to_vector<float>(s.scale_inv), std::vector<float>{1.0f / 224.0f});
  EXPECT_EQ(ctx.to_vector<std::int32_t>(s.non_finite), std::vector<std::int32_t>{0});
  const Scales p = scale_from_amax(ctx, scalar(ctx, "amax2", 2.0f), {Fp8Format::kE4M3, true});
  EXPECT_EQ(ctx.to_vector<float>(p.scale), std::vector<float>{128.0f});
  const Scales bad = scale_from_amax(ctx, scalar(ctx, "nan", NAN), {Fp8Format::kE5M2, false});
  EXPECT_EQ(ctx.to_vector<float>(bad.scale), std::vector<float>{1.0f});
  EXPECT_EQ(ctx.to_vector<std::int32_t>(bad.non_finite), std::vector<std::int32_t>{1});
}

TEST(Fp8OpsHostTest, DelayedScalingUpdateRollsTheHistoryInPlace) {
  Context ctx(Device::kHost);
  const DelayedScalingParams params{Fp8Recipe::delayed(3, AmaxReduction::kMax, 0), Fp8Format::kE4M3};
  const Tensor history = ctx.persistent("history", {Shape{3}, DType::kFloat32});
  const std::vector<float> zeros(3, 0.0f);
  ctx.copy_from_host(history, zeros.data(), 12);
  const Tensor scale = scalar(ctx, "scale", 1.0f);
  const Tensor scale_inv = scalar(ctx, "scale_inv", 1.0f);
  for (const float amax : {4.0f, 1.0f, 2.0f, 1.0f}) {
    const Tensor flag = delayed_scaling_update_(ctx, params, scalar(ctx, "amax" + std::to_string(amax), amax),
                                                history, scale, scale_inv);
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag), std::vector<std::int32_t>{0});
  }
  EXPECT_EQ(ctx.to_vector<float>(history), (std::vector<float>{1.0f, 2.0f, 1.0f}));
  EXPECT_EQ(ctx.to_vector<float>(scale), std::vector<float>{224.0f});  // 4 rolled out: 448 / 2
  const Tensor flag = delayed_scaling_update_(ctx, params, scalar(ctx, "inf", INFINITY), history, scale, scale_inv);
  EXPECT_EQ(ctx.to_vector<std::int32_t>(flag), std::vector<std::int32_t>{1});
  EXPECT_EQ(ctx.to_vector<float>(history), (std::vector<float>{1.0f, 2.0f, 1.0f}));
  const Tensor wrong = ctx.persistent("wrong", {Shape{4}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(delayed_scaling_update_(ctx, params, scale, wrong, scale, scale_inv), "history must be [3]");
  EXPECT_ERROR_CONTAINS(delayed_scaling_update_(ctx, {Fp8Recipe::current(), Fp8Format::kE4M3}, scale, history, scale,
                                                scale_inv),
                        "not delayed");
}

}  // namespace
}  // namespace stepgraph::ops
