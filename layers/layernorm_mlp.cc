#include "layers/layernorm_mlp.h"

#include <cmath>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"

namespace stepgraph {

using kernels::GemmEpilogue;

LayerNormMLP::LayerNormMLP(Context& ctx, const std::string& name, const LayerNormMLPConfig& config, std::uint32_t seed,
                           Communicator* tensor_parallel)
    : label_(layer_label("LayerNormMLP", name)),
      config_(config),
      tp_(tensor_parallel),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.hidden, config.eps, config.dtype}) {
  SG_CHECK(config.hidden > 0 && config.ffn > 0, "LayerNormMLP '", name, "': hidden and ffn must be > 0, got ",
           config.hidden, " and ", config.ffn);
  const int ranks = tp_ != nullptr ? tp_->world_size() : 1;
  SG_CHECK(config.ffn % ranks == 0, "LayerNormMLP '", name, "': ffn ", config.ffn, " must divide by the ", ranks,
           " tensor-parallel ranks");
  if (tp_ != nullptr) tp_->check_device(ctx.device(), label_);
  const float scale1 = 1.0f / std::sqrt(static_cast<float>(config.hidden));
  const float scale2 = 1.0f / std::sqrt(static_cast<float>(config.ffn));
  // This rank's slices of the weights one rank draws from `seed` (Note
  // [Sequence-parallel LayerNormMLP]); the whole weights with one rank.
  const std::int64_t f = local_ffn();
  const std::int64_t first = (tp_ != nullptr ? tp_->rank() : 0) * f;
  const std::int64_t h = config.hidden;
  w1_ = make_parameter(ctx, name + ".fc1.weight", Shape{f, h}, config.dtype,
                       ParameterInit::uniform(scale1, seed).rows_from(config.ffn, h, first));
  b1_ = make_parameter(ctx, name + ".fc1.bias", Shape{f}, config.dtype,
                       ParameterInit::uniform(scale1, seed + 1).rows_from(config.ffn, 1, first));
  w2_ = make_parameter(ctx, name + ".fc2.weight", Shape{h, f}, config.dtype,
                       ParameterInit::uniform(scale2, seed + 2).columns_from(h, config.ffn, first));
  b2_ = make_parameter(ctx, name + ".fc2.bias", Shape{h}, config.dtype, ParameterInit::uniform(scale2, seed + 3));
}

std::int64_t LayerNormMLP::local_ffn() const { return config_.ffn / (tp_ != nullptr ? tp_->world_size() : 1); }

std::vector<Parameter*> LayerNormMLP::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Parameter* p : {&w1_, &b1_, &w2_, &b2_}) out.push_back(p);
  return out;
}

LayerNormMLP::Forward LayerNormMLP::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", config_.hidden}, config_.dtype);
  const Norm::Forward normed = norm_.forward(ctx, {args.x});
  // fc1's input: every rank's normalised tokens (Note [Sequence-parallel LayerNormMLP]).
  const Tensor fc1_in = tp_ != nullptr ? ops::all_gather(ctx, *tp_, normed.y) : normed.y;
  Tensor pre;
  Tensor act;
  if (fused_gelu()) {
    const ops::GemmResult fc1 =
        ops::gemm(ctx, fc1_in, w1_.value,
                  {.trans_b = true, .epilogue = GemmEpilogue::kGeluAuxBias, .out_dtype = config_.dtype}, b1_.value);
    pre = fc1.aux;
    act = fc1.d;
  } else {
    pre = ops::gemm(ctx, fc1_in, w1_.value,
                    {.trans_b = true, .epilogue = GemmEpilogue::kBias, .out_dtype = config_.dtype}, b1_.value)
              .d;
    act = ops::gelu(ctx, pre);
  }
  Forward out;
  // fc2's bias once in the sum of the ranks' partial products: rank 0 adds it.
  const bool adds_bias = tp_ == nullptr || tp_->rank() == 0;
  out.y = ops::gemm(ctx, act, w2_.value,
                    {.trans_b = true,
                     .epilogue = adds_bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                     .out_dtype = config_.dtype},
                    adds_bias ? b2_.value : Tensor())
              .d;
  if (tp_ != nullptr) out.y = ops::reduce_scatter(ctx, *tp_, out.y, ReduceOp::kSum);
  out.saved = Saved{normed.saved, fc1_in, pre, act};
  return out;
}

Tensor LayerNormMLP::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.norm.x", saved.norm.x, {"tokens", config_.hidden}, config_.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  const std::int64_t all_tokens = tokens * (tp_ != nullptr ? tp_->world_size() : 1);
  check_input(label_, "backward", "saved.act", saved.act, {all_tokens, local_ffn()}, config_.dtype,
              "the forward's activation");
  check_input(label_, "backward", "dy", args.dy, {tokens, config_.hidden}, config_.dtype, "the forward's output");
  // The gradient of every token this rank's fc2 slice touched.
  const Tensor dy = tp_ != nullptr ? ops::all_gather(ctx, *tp_, args.dy) : args.dy;
  // The data-gradient chain (dy -> d_pre -> d_normed -> dx) stays on the
  // current stream; weight and bias gradients go to the weight-gradient
  // stream (WeightGradScope) and overlap it.
  {  // fc2: grad_W2 = dy^T act with grad_b2 fused (BGRADB).
    WeightGradScope weight_grads(ctx);
    const Tensor b2_grad =
        ops::gemm_into_(ctx, w2_.grad, dy, saved.act,
                        {.trans_a = true, .epilogue = GemmEpilogue::kBiasGradOfA, .out_dtype = DType::kFloat32});
    ops::copy_(ctx, b2_.grad, b2_grad);
  }
  // d_pre = (dy W2) * gelu'(pre); then fc1: grad_W1 = d_pre^T normed, d_normed = d_pre W1.
  Tensor d_pre;
  if (fused_gelu()) {
    const ops::GemmResult fused = ops::gemm(
        ctx, dy, w2_.value, {.epilogue = GemmEpilogue::kDGeluBGrad, .out_dtype = config_.dtype}, {}, saved.pre);
    d_pre = fused.d;
    WeightGradScope weight_grads(ctx);
    ops::copy_(ctx, b1_.grad, ops::cast(ctx, fused.bias_grad, DType::kFloat32));
    ops::gemm_into_(ctx, w1_.grad, d_pre, saved.normed, {.trans_a = true, .out_dtype = DType::kFloat32});
  } else {
    const Tensor d_act = ops::gemm(ctx, dy, w2_.value, {.out_dtype = config_.dtype}).d;
    d_pre = ops::gelu_backward(ctx, d_act, saved.pre);
    WeightGradScope weight_grads(ctx);
    const Tensor b1_grad =
        ops::gemm_into_(ctx, w1_.grad, d_pre, saved.normed,
                        {.trans_a = true, .epilogue = GemmEpilogue::kBiasGradOfA, .out_dtype = DType::kFloat32});
    ops::copy_(ctx, b1_.grad, b1_grad);
  }
  Tensor d_normed = ops::gemm(ctx, d_pre, w1_.value, {.out_dtype = config_.dtype}).d;
  if (tp_ == nullptr) return norm_.backward(ctx, saved.norm, {d_normed});
  // Every rank's slice contributed to every token: sum them, keep this rank's tokens.
  d_normed = ops::reduce_scatter(ctx, *tp_, d_normed, ReduceOp::kSum);
  const Tensor dx = norm_.backward(ctx, saved.norm, {d_normed});
  // gamma and beta saw only this rank's tokens.
  ops::all_reduce_many_(ctx, *tp_, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

}  // namespace stepgraph
