// A layer given an input of the wrong shape or dtype says so in its
// own terms, before any op runs: the layer (its name, else its kind), the
// argument, the shape and dtype it expected and the ones it got. For every
// layer: a wrong-shaped and a wrong-dtype input to forward and dy to
// backward are errors naming all of that; the right ones still run (host, fp32).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/error.h"
#include "layers/embedding.h"
#include "layers/grouped_linear.h"
#include "layers/language_model.h"
#include "layers/layernorm_linear.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "layers/moe_mlp.h"
#include "layers/norm.h"
#include "layers/residual_stack.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

constexpr DType kF32 = DType::kFloat32;
constexpr DType kBF16 = DType::kBFloat16;

// What one layer expects, and the wrong arguments to give it.
struct Spec {
  std::string layer;              // "Linear 'fc1'"
  std::string input = "input";    // the forward's argument
  Shape x;                        // a right input
  DType x_dtype = kF32;
  DType wrong_x_dtype = kBF16;
  std::string x_expected;         // "[tokens, 8] fp32"
  Shape wrong_x;                  // a wrong shape, of x_dtype
  std::string dy_arg = "dy";      // the backward's argument
  Shape dy;                       // the right dy for x, fp32
  std::string dy_of = "output";   // dy is like the forward's "output" (or "logits")
  Shape wrong_dy;                 // a wrong shape, fp32
};

std::string shown(const Shape& shape, DType dtype) { return shape.to_string() + " " + std::string(dtype_name(dtype)); }

Tensor make(Context& ctx, const Shape& shape, DType dtype) {
  static int count = 0;
  return ctx.persistent("arg" + std::to_string(count++), {shape, dtype});
}

// fwd(x) returns the layer's Forward (with .saved); bwd(saved, dy) runs its backward.
template <typename Fwd, typename Bwd>
void expect_named_errors(Context& ctx, const Spec& s, Fwd fwd, Bwd bwd) {
  SCOPED_TRACE(s.layer);
  const std::string forward = s.layer + " forward: ";
  const std::string backward = s.layer + " backward: ";
  const std::string dy_expected = shown(s.dy, kF32) + " (the forward's " + s.dy_of + ")";
  EXPECT_ERROR_CONTAINS(fwd(make(ctx, s.wrong_x, s.x_dtype)), forward + s.input + " must be " + s.x_expected,
                        ", got " + shown(s.wrong_x, s.x_dtype));
  EXPECT_ERROR_CONTAINS(fwd(make(ctx, s.x, s.wrong_x_dtype)), forward + s.input + " must be " + s.x_expected,
                        ", got " + shown(s.x, s.wrong_x_dtype));

  const auto f = fwd(make(ctx, s.x, s.x_dtype));  // the right input runs
  EXPECT_ERROR_CONTAINS(bwd(f.saved, make(ctx, s.wrong_dy, kF32)), backward + s.dy_arg + " must be " + dy_expected,
                        ", got " + shown(s.wrong_dy, kF32));
  EXPECT_ERROR_CONTAINS(bwd(f.saved, make(ctx, s.dy, kBF16)), backward + s.dy_arg + " must be " + dy_expected,
                        ", got " + shown(s.dy, kBF16));
  EXPECT_ERROR_CONTAINS(bwd(f.saved, Tensor()), backward + s.dy_arg + " must be " + dy_expected,
                        "got an undefined tensor");
  EXPECT_NO_THROW(bwd(f.saved, make(ctx, s.dy, kF32)));  // the right dy runs
}

// The common case: forward(ctx, {x}) and backward(ctx, saved, {dy}).
template <typename Layer>
void expect_named_errors(Context& ctx, const Layer& layer, const Spec& s) {
  expect_named_errors(
      ctx, s, [&](const Tensor& x) { return layer.forward(ctx, {x}); },
      [&](const auto& saved, const Tensor& dy) { return layer.backward(ctx, saved, {dy}); });
}

TEST(LayerErrorsTest, Linear) {
  Context ctx(Device::kHost);
  const Linear layer(ctx, "fc1", {.in_features = 8, .out_features = 4, .dtype = kF32}, 1);
  expect_named_errors(ctx, layer,
                      {.layer = "Linear 'fc1'", .x = Shape{5, 8}, .x_expected = "[tokens, 8] fp32",
                       .wrong_x = Shape{5, 9}, .dy = Shape{5, 4}, .wrong_dy = Shape{5, 3}});
}

TEST(LayerErrorsTest, LinearBackwardChecksTheSavedInput) {
  Context ctx(Device::kHost);
  const Linear fc1(ctx, "fc1", {.in_features = 8, .out_features = 4, .dtype = kF32}, 1);
  const Linear fc2(ctx, "fc2", {.in_features = 4, .out_features = 4, .dtype = kF32}, 2);
  const Linear::Forward f = fc1.forward(ctx, {make(ctx, Shape{5, 8}, kF32)});
  EXPECT_ERROR_CONTAINS(fc2.backward(ctx, f.saved, {make(ctx, Shape{5, 4}, kF32)}),
                        "Linear 'fc2' backward: saved.x must be [tokens, 4] fp32 (the forward's input), got [5, 8] fp32");
}

TEST(LayerErrorsTest, Norm) {
  Context ctx(Device::kHost);
  const Norm layer(ctx, "ln", {kernels::NormKind::kLayerNorm, 8, 1e-5f, kF32});
  expect_named_errors(ctx, layer,
                      {.layer = "Norm 'ln'", .x = Shape{2, 5, 8}, .x_expected = "[..., 8] fp32",
                       .wrong_x = Shape{5, 9}, .dy = Shape{2, 5, 8}, .wrong_dy = Shape{10, 8}});
}

TEST(LayerErrorsTest, LayerNormLinear) {
  Context ctx(Device::kHost);
  const LayerNormLinear layer(ctx, "qkv", {.linear = {.in_features = 8, .out_features = 4, .dtype = kF32}}, 1);
  expect_named_errors(ctx, layer,
                      {.layer = "LayerNormLinear 'qkv'", .x = Shape{5, 8}, .x_expected = "[tokens, 8] fp32",
                       .wrong_x = Shape{5, 4}, .dy = Shape{5, 4}, .wrong_dy = Shape{5, 8}});
}

TEST(LayerErrorsTest, LayerNormMLP) {
  Context ctx(Device::kHost);
  const LayerNormMLP layer(ctx, "mlp", {.hidden = 8, .ffn = 16, .dtype = kF32}, 1);
  expect_named_errors(ctx, layer,
                      {.layer = "LayerNormMLP 'mlp'", .x = Shape{5, 8}, .x_expected = "[tokens, 8] fp32",
                       .wrong_x = Shape{5, 16}, .dy = Shape{5, 8}, .wrong_dy = Shape{4, 8}});
}

TEST(LayerErrorsTest, GroupedLinear) {
  Context ctx(Device::kHost);
  const GroupedLinear layer(ctx, "experts", {.experts = 2, .in_features = 8, .out_features = 4, .dtype = kF32}, 1);
  const Tensor splits = make(ctx, Shape{2}, DType::kInt32);
  const std::int32_t sizes[] = {3, 2};
  ctx.copy_from_host(splits, sizes, sizeof(sizes));
  expect_named_errors(
      ctx,
      {.layer = "GroupedLinear 'experts'", .x = Shape{5, 8}, .x_expected = "[tokens, 8] fp32", .wrong_x = Shape{5, 7},
       .dy = Shape{5, 4}, .wrong_dy = Shape{6, 4}},
      [&](const Tensor& x) { return layer.forward(ctx, {x, splits}); },
      [&](const GroupedLinear::Saved& saved, const Tensor& dy) { return layer.backward(ctx, saved, {dy}); });
  EXPECT_NO_THROW(layer.check_splits(ctx));
}

TEST(LayerErrorsTest, MoEMLP) {
  Context ctx(Device::kHost);
  const MoEMLP layer(ctx, "moe", {.hidden = 8, .ffn = 8, .experts = 4, .topk = 2, .dtype = kF32}, 1);
  expect_named_errors(ctx, layer,
                      {.layer = "MoEMLP 'moe'", .x = Shape{5, 8}, .x_expected = "[tokens, 8] fp32",
                       .wrong_x = Shape{5, 4}, .dy = Shape{5, 8}, .wrong_dy = Shape{5, 4}});
  EXPECT_NO_THROW(layer.check_errors(ctx));
}

TEST(LayerErrorsTest, Embedding) {
  Context ctx(Device::kHost);
  const Embedding layer(ctx, "embed", {.vocab = 16, .dim = 4, .dtype = kF32}, 1);
  const Tensor flag = make(ctx, Shape{1}, DType::kInt32);
  expect_named_errors(
      ctx,
      {.layer = "Embedding 'embed'", .input = "tokens", .x = Shape{3, 2}, .x_dtype = DType::kInt32,
       .wrong_x_dtype = kF32, .x_expected = "[rows, width] int32", .wrong_x = Shape{6},
       .dy = Shape{3, 8}, .wrong_dy = Shape{3, 4}},
      [&](const Tensor& tokens) { return layer.forward(ctx, {tokens, flag}); },
      [&](const Embedding::Saved& saved, const Tensor& dy) { layer.backward(ctx, saved, {dy}); });
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {make(ctx, Shape{3, 2}, DType::kInt32), Tensor()}),
                        "Embedding 'embed' forward: error_flag must be [1] int32, got an undefined tensor");
}

constexpr ResidualStackConfig kSmallStack{.hidden = 8, .ffn = 16, .layers = 2, .vocab = 12, .dtype = kF32};

TEST(LayerErrorsTest, ResidualStack) {
  Context ctx(Device::kHost);
  const ResidualStack stack(ctx, kSmallStack);
  expect_named_errors(
      ctx,
      {.layer = "ResidualStack", .x = Shape{5, 8}, .x_expected = "[tokens, 8] fp32", .wrong_x = Shape{5, 12},
       .dy_arg = "dlogits", .dy = Shape{5, 12}, .dy_of = "logits",
       .wrong_dy = Shape{5, 8}},
      [&](const Tensor& x) { return stack.forward(ctx, x); },
      [&](const ResidualStack::Saved& saved, const Tensor& dlogits) { return stack.backward(ctx, saved, dlogits); });
}

TEST(LayerErrorsTest, LanguageModel) {
  Context ctx(Device::kHost);
  const LanguageModel model(ctx, {.model = kSmallStack, .context = 2});
  const Tensor flag = make(ctx, Shape{1}, DType::kInt32);
  expect_named_errors(
      ctx,
      {.layer = "LanguageModel", .input = "tokens", .x = Shape{3, 2}, .x_dtype = DType::kInt32,
       .wrong_x_dtype = kF32, .x_expected = "[batch, 2] int32", .wrong_x = Shape{3, 4}, .dy_arg = "dlogits",
       .dy = Shape{3, 12}, .dy_of = "logits", .wrong_dy = Shape{4, 12}},
      [&](const Tensor& tokens) { return model.forward(ctx, tokens, flag); },
      [&](const LanguageModel::Saved& saved, const Tensor& dlogits) { model.backward(ctx, saved, dlogits); });
}

}  // namespace
}  // namespace stepgraph
