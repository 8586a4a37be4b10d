#include "layers/layernorm_mlp.h"

#include <cmath>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"

namespace stepgraph {

using kernels::GemmEpilogue;

LayerNormMLP::LayerNormMLP(Context& ctx, const std::string& name, const LayerNormMLPConfig& config, std::uint32_t seed)
    : label_(layer_label("LayerNormMLP", name)),
      config_(config),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.hidden, config.eps, config.dtype}) {
  SG_CHECK(config.hidden > 0 && config.ffn > 0, "LayerNormMLP '", name, "': hidden and ffn must be > 0, got ",
           config.hidden, " and ", config.ffn);
  const float scale1 = 1.0f / std::sqrt(static_cast<float>(config.hidden));
  const float scale2 = 1.0f / std::sqrt(static_cast<float>(config.ffn));
  const Shape fc1{config.ffn, config.hidden};
  const Shape fc2{config.hidden, config.ffn};
  w1_ = make_parameter(ctx, name + ".fc1.weight", fc1, config.dtype, ParameterInit::uniform(scale1, seed));
  b1_ = make_parameter(ctx, name + ".fc1.bias", Shape{config.ffn}, config.dtype,
                       ParameterInit::uniform(scale1, seed + 1));
  w2_ = make_parameter(ctx, name + ".fc2.weight", fc2, config.dtype, ParameterInit::uniform(scale2, seed + 2));
  b2_ = make_parameter(ctx, name + ".fc2.bias", Shape{config.hidden}, config.dtype,
                       ParameterInit::uniform(scale2, seed + 3));
}

std::vector<Parameter*> LayerNormMLP::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Parameter* p : {&w1_, &b1_, &w2_, &b2_}) out.push_back(p);
  return out;
}

LayerNormMLP::Forward LayerNormMLP::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", config_.hidden}, config_.dtype);
  const Norm::Forward normed = norm_.forward(ctx, {args.x});
  Tensor pre;
  Tensor act;
  if (fused_gelu()) {
    const ops::GemmResult fc1 =
        ops::gemm(ctx, normed.y, w1_.value,
                  {.trans_b = true, .epilogue = GemmEpilogue::kGeluAuxBias, .out_dtype = config_.dtype}, b1_.value);
    pre = fc1.aux;
    act = fc1.d;
  } else {
    pre = ops::gemm(ctx, normed.y, w1_.value,
                    {.trans_b = true, .epilogue = GemmEpilogue::kBias, .out_dtype = config_.dtype}, b1_.value)
              .d;
    act = ops::gelu(ctx, pre);
  }
  Forward out;
  out.y = ops::gemm(ctx, act, w2_.value, {.trans_b = true, .epilogue = GemmEpilogue::kBias, .out_dtype = config_.dtype},
                    b2_.value)
              .d;
  out.saved = Saved{normed.saved, normed.y, pre, act};
  return out;
}

Tensor LayerNormMLP::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.norm.x", saved.norm.x, {"tokens", config_.hidden}, config_.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  check_input(label_, "backward", "saved.act", saved.act, {tokens, config_.ffn}, config_.dtype,
              "the forward's activation");
  check_input(label_, "backward", "dy", args.dy, {tokens, config_.hidden}, config_.dtype, "the forward's output");
  // The data-gradient chain (dy -> d_pre -> d_normed -> dx) stays on the
  // current stream; weight and bias gradients go to the weight-gradient
  // stream (WeightGradScope) and overlap it.
  {  // fc2: grad_W2 = dy^T act with grad_b2 fused (BGRADB).
    WeightGradScope weight_grads(ctx);
    const Tensor b2_grad =
        ops::gemm_into_(ctx, w2_.grad, args.dy, saved.act,
                        {.trans_a = true, .epilogue = GemmEpilogue::kBiasGradOfA, .out_dtype = DType::kFloat32});
    ops::copy_(ctx, b2_.grad, b2_grad);
  }
  // d_pre = (dy W2) * gelu'(pre); then fc1: grad_W1 = d_pre^T normed, d_normed = d_pre W1.
  Tensor d_pre;
  if (fused_gelu()) {
    const ops::GemmResult fused = ops::gemm(
        ctx, args.dy, w2_.value, {.epilogue = GemmEpilogue::kDGeluBGrad, .out_dtype = config_.dtype}, {}, saved.pre);
    d_pre = fused.d;
    WeightGradScope weight_grads(ctx);
    ops::copy_(ctx, b1_.grad, ops::cast(ctx, fused.bias_grad, DType::kFloat32));
    ops::gemm_into_(ctx, w1_.grad, d_pre, saved.normed, {.trans_a = true, .out_dtype = DType::kFloat32});
  } else {
    const Tensor d_act = ops::gemm(ctx, args.dy, w2_.value, {.out_dtype = config_.dtype}).d;
    d_pre = ops::gelu_backward(ctx, d_act, saved.pre);
    WeightGradScope weight_grads(ctx);
    const Tensor b1_grad =
        ops::gemm_into_(ctx, w1_.grad, d_pre, saved.normed,
                        {.trans_a = true, .epilogue = GemmEpilogue::kBiasGradOfA, .out_dtype = DType::kFloat32});
    ops::copy_(ctx, b1_.grad, b1_grad);
  }
  const Tensor d_normed = ops::gemm(ctx, d_pre, w1_.value, {.out_dtype = config_.dtype}).d;
  return norm_.backward(ctx, saved.norm, {d_normed});
}

}  // namespace stepgraph
