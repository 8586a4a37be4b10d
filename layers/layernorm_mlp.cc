#include "layers/layernorm_mlp.h"

#include <cmath>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/fp8_fused_ops.h"
#include "ops/gemm_ops.h"
#include "ops/row_ops.h"

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
  config.overlap.check(label_);
  if (config.fp8) {
    // Linear draws what the lines below would: uniform(1/sqrt(in)) from seed (weight) and seed + 1 (bias).
    // Tensor-parallel: fc1 column- and fc2 row-parallel, both sequence-parallel,
    // slicing the weights as the lines below do (Note [Column- and row-parallel Linear]).
    const bool split = tp_ != nullptr;
    fc1_.emplace(ctx, name + ".fc1",
                 LinearConfig{.in_features = config.hidden,
                              .out_features = config.ffn,
                              .dtype = config.dtype,
                              .tensor_parallel = split ? TensorParallelMode::kColumn : TensorParallelMode::kNone,
                              .sequence_parallel = split,
                              .fprop_overlap = config.overlap.fc1_fprop,
                              .dgrad_overlap = config.overlap.fc1_dgrad,
                              .fp8 = config.fp8},
                 seed, tp_);
    fc2_.emplace(ctx, name + ".fc2",
                 LinearConfig{.in_features = config.ffn,
                              .out_features = config.hidden,
                              .dtype = config.dtype,
                              .tensor_parallel = split ? TensorParallelMode::kRow : TensorParallelMode::kNone,
                              .sequence_parallel = split,
                              .fprop_overlap = config.overlap.fc2_fprop,
                              .dgrad_overlap = config.overlap.fc2_dgrad,
                              .fp8 = config.fp8},
                 seed + 2, tp_);
    return;
  }
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

int LayerNormMLP::tp_size() const { return tp_ != nullptr ? tp_->world_size() : 1; }

std::int64_t LayerNormMLP::local_ffn() const { return config_.ffn / tp_size(); }

std::vector<Parameter*> LayerNormMLP::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  if (config_.fp8) {
    for (Linear* fc : {&*fc1_, &*fc2_}) {
      for (Parameter* p : fc->parameters()) out.push_back(p);
    }
    return out;
  }
  for (Parameter* p : {&w1_, &b1_, &w2_, &b2_}) out.push_back(p);
  return out;
}

std::vector<Linear*> LayerNormMLP::fp8_linears() {
  if (!config_.fp8) return {};
  return {&*fc1_, &*fc2_};
}

bool LayerNormMLP::fused_fp8() const {
  return config_.fp8 && config_.fp8_fused && fc1_->takes_quantized_operands() && fc2_->takes_quantized_operands();
}

LayerNormMLP::Forward LayerNormMLP::forward_fp8(Context& ctx, const FwdArgs& args) const {
  if (!fused_fp8()) {
    const Norm::Forward normed = norm_.forward(ctx, {args.x});
    const Linear::Forward fc1 = fc1_->forward(ctx, {normed.y});
    const Tensor act = ops::gelu(ctx, fc1.y);
    Linear::Forward fc2 = fc2_->forward(ctx, {act});
    // The FP8 Linears keep their inputs' FP8 copies: the 16-bit normed and act
    // are not saved (freed after the forward); pre stays for GeLU's backward.
    return {fc2.y, Saved{normed.saved, Tensor(), fc1.y, Tensor(), fc1.saved, fc2.saved}};
  }
  // Note [Fused FP8 operands]: current scaling takes each amax in a pass of
  // its own first; delayed scaling quantizes with the state's scale at once.
  const bool current = config_.fp8->scaling == Fp8Scaling::kCurrent;
  const Fp8Format format = config_.fp8->forward_format();
  const ops::FusedFp8Params amax_only{.format = format, .amax_only = true};
  const ops::FusedFp8Params copies{.format = format, .columnwise = true};  // the Linears' wgrads read x^T
  const Linear::OperandScale s1 =
      fc1_->input_scale(ctx, current ? norm_.forward_fp8(ctx, args.x, Tensor(), amax_only).out.amax : Tensor());
  const Norm::Fp8Forward normed = norm_.forward_fp8(ctx, args.x, s1.scale, copies);
  const Linear::Forward fc1 =
      fc1_->forward_quantized(ctx, {normed.out.rowwise, normed.out.columnwise, normed.out.amax}, s1);
  const Linear::OperandScale s2 =
      fc2_->input_scale(ctx, current ? ops::gelu_fp8(ctx, fc1.y, Tensor(), amax_only).amax : Tensor());
  const ops::FusedFp8 act = ops::gelu_fp8(ctx, fc1.y, s2.scale, copies);
  Linear::Forward fc2 = fc2_->forward_quantized(ctx, {act.rowwise, act.columnwise, act.amax}, s2);
  return {fc2.y, Saved{normed.saved, Tensor(), fc1.y, Tensor(), fc1.saved, fc2.saved}};
}

Tensor LayerNormMLP::backward_fp8(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const Tensor d_act = fc2_->backward(ctx, saved.fc2, {args.dy});
  Tensor d_normed;
  if (fused_fp8()) {
    // GeLU's backward writes fc1's FP8 output gradient, and the 16-bit one its bias gradient sums.
    const bool current = config_.fp8->scaling == Fp8Scaling::kCurrent;
    const Fp8Format format = config_.fp8->gradient_format();
    const Linear::OperandScale s = fc1_->gradient_scale(
        ctx, current ? ops::dgelu_fp8(ctx, d_act, saved.pre, Tensor(), {.format = format, .amax_only = true}).amax
                     : Tensor());
    const ops::FusedFp8 d_pre =
        ops::dgelu_fp8(ctx, d_act, saved.pre, s.scale, {.format = format, .columnwise = true, .keep_16bit = true});
    d_normed = fc1_->backward_quantized(ctx, saved.fc1, {d_pre.rowwise, d_pre.columnwise, d_pre.amax, d_pre.value}, s);
  } else {
    d_normed = fc1_->backward(ctx, saved.fc1, {ops::gelu_backward(ctx, d_act, saved.pre)});
  }
  const Tensor dx = norm_.backward(ctx, saved.norm, {d_normed, args.dx_residual});
  // gamma and beta saw only this rank's tokens (Note [Sequence-parallel LayerNormMLP]).
  if (tp_ != nullptr) ops::all_reduce_many_(ctx, *tp_, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

LayerNormMLP::Forward LayerNormMLP::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", config_.hidden}, config_.dtype);
  if (config_.fp8) return forward_fp8(ctx, args);
  const Norm::Forward normed = norm_.forward(ctx, {args.x});
  Tensor pre;  // fc1's output before GeLU
  Tensor act;  // GeLU(pre)
  // fc1 over rows of its input: fresh outputs for the whole input, else rows
  // of outputs made whole first (See Note [Row windows of a GEMM]).
  auto fc1 = [&](const Tensor& rows, std::int64_t first_row) {
    const std::int64_t all = normed.y.shape().dim(0) * tp_size();
    const bool whole = first_row == 0 && rows.shape().dim(0) == all;
    ops::GemmParams params{.trans_b = true,
                           .epilogue = fused_gelu() ? GemmEpilogue::kGeluAuxBias : GemmEpilogue::kBias,
                           .out_dtype = config_.dtype};
    if (whole) {
      const ops::GemmResult fc1 = ops::gemm(ctx, rows, w1_.value, params, b1_.value);
      pre = fused_gelu() ? fc1.aux : fc1.d;
      act = fused_gelu() ? fc1.d : ops::gelu(ctx, pre);
      return;
    }
    const TensorMeta meta{Shape{all, local_ffn()}, config_.dtype};
    if (!pre.defined()) pre = ops::empty(ctx, meta);
    if (fused_gelu() && !act.defined()) act = ops::empty(ctx, meta);
    params.rows = rows.shape().dim(0);
    params.d_row = first_row;
    if (fused_gelu()) {
      ops::gemm_into_(ctx, act, rows, w1_.value, params, b1_.value, pre);
    } else {
      ops::gemm_into_(ctx, pre, rows, w1_.value, params, b1_.value);
    }
  };
  // fc1's input: every rank's normalised tokens (Note [Sequence-parallel LayerNormMLP]).
  Tensor fc1_in = normed.y;
  if (tp_ != nullptr) {
    fc1_in = all_gather_gemm(ctx, *tp_, normed.y, config_.overlap.fc1_fprop, fc1);
  } else {
    fc1(normed.y, 0);
  }
  if (!act.defined()) act = ops::gelu(ctx, pre);  // unfused GeLU after a chunked fc1
  // fc2's bias once in the sum of the ranks' partial products: rank 0 adds it.
  const bool adds_bias = tp_ == nullptr || tp_->rank() == 0;
  auto fc2 = [&](std::int64_t first_row, std::int64_t rows) {
    const bool whole = first_row == 0 && rows == act.shape().dim(0);
    return ops::gemm(ctx, act, w2_.value,
                     {.trans_b = true,
                      .epilogue = adds_bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                      .out_dtype = config_.dtype,
                      .rows = whole ? 0 : rows,
                      .a_row = first_row},
                     adds_bias ? b2_.value : Tensor())
        .d;
  };
  Forward out;
  out.y = tp_ != nullptr ? gemm_reduce_scatter(ctx, *tp_, act.shape().dim(0), config_.overlap.fc2_fprop, fc2)
                         : fc2(0, act.shape().dim(0));
  out.saved = Saved{normed.saved, fc1_in, pre, config_.recompute_activation ? Tensor() : act};
  return out;
}

Tensor LayerNormMLP::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.norm.x", saved.norm.x, {"tokens", config_.hidden}, config_.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  const std::int64_t all_tokens = tokens * tp_size();
  check_input(label_, "backward", "dy", args.dy, {tokens, config_.hidden}, config_.dtype, "the forward's output");
  if (config_.fp8) return backward_fp8(ctx, saved, args);
  if (!config_.recompute_activation) {
    check_input(label_, "backward", "saved.act", saved.act, {all_tokens, local_ffn()}, config_.dtype,
                "the forward's activation");
  }
  // The data-gradient chain (dy -> d_pre -> d_normed -> dx) stays on the
  // current stream; weight and bias gradients go to the weight-gradient
  // stream (WeightGradScope) and overlap it.
  //
  // fc2's data gradient over rows of dy (the gradient of every token this
  // rank's fc2 slice touched): d_pre = (dy W2) * gelu'(pre). Whole, bf16
  // fuses GeLU's derivative and fc1's bias gradient into the epilogue
  // (DGELU_BGRAD); by row windows the bias gradient comes from fc1's wgrad
  // instead (BGRADB), as in fp32, since the windows' sums would need adding.
  Tensor d_pre;
  Tensor d_act;  // fp32 (unfused GeLU) only
  Tensor b1_grad;
  auto fc2_dgrad = [&](const Tensor& rows, std::int64_t first_row) {
    const bool whole = first_row == 0 && rows.shape().dim(0) == all_tokens;
    ops::GemmParams params{.epilogue = fused_gelu() ? GemmEpilogue::kDGeluBGrad : GemmEpilogue::kNone,
                           .out_dtype = config_.dtype};
    if (whole) {
      const ops::GemmResult fused = ops::gemm(ctx, rows, w2_.value, params, {}, fused_gelu() ? saved.pre : Tensor());
      (fused_gelu() ? d_pre : d_act) = fused.d;
      if (fused_gelu()) b1_grad = fused.bias_grad;
      return;
    }
    Tensor& d = fused_gelu() ? d_pre : d_act;
    if (!d.defined()) d = ops::empty(ctx, {Shape{all_tokens, local_ffn()}, config_.dtype});
    params.rows = rows.shape().dim(0);
    params.d_row = first_row;
    ops::gemm_into_(ctx, d, rows, w2_.value, params, {}, fused_gelu() ? saved.pre : Tensor());
  };
  const Tensor dy = tp_ != nullptr ? all_gather_gemm(ctx, *tp_, args.dy, config_.overlap.fc2_dgrad, fc2_dgrad)
                                   : (fc2_dgrad(args.dy, 0), args.dy);
  if (!d_pre.defined()) d_pre = ops::gelu_backward(ctx, d_act, saved.pre);
  {
    WeightGradScope weight_grads(ctx);
    // Note [Recomputed activation]: GeLU(pre) again, on this stream.
    const Tensor act = config_.recompute_activation ? ops::gelu(ctx, saved.pre) : saved.act;
    // fc2: grad_W2 = dy^T act with grad_b2 fused (BGRADB), written into b2's grad.
    ops::gemm_into_(ctx, w2_.gradient_for_write(ctx), dy, act,
                    {.trans_a = true, .epilogue = GemmEpilogue::kBiasGradOfA, .out_dtype = DType::kFloat32}, {}, {},
                    b2_.gradient_for_write(ctx));
    // fc1: grad_W1 = d_pre^T normed, with grad_b1 fused unless fc2's dgrad gave it.
    if (b1_grad.defined()) {
      ops::copy_(ctx, b1_.gradient_for_write(ctx), ops::cast(ctx, b1_grad, DType::kFloat32));
      ops::gemm_into_(ctx, w1_.gradient_for_write(ctx), d_pre, saved.normed,
                      {.trans_a = true, .out_dtype = DType::kFloat32});
    } else {
      ops::gemm_into_(ctx, w1_.gradient_for_write(ctx), d_pre, saved.normed,
                      {.trans_a = true, .epilogue = GemmEpilogue::kBiasGradOfA, .out_dtype = DType::kFloat32}, {}, {},
                      b1_.gradient_for_write(ctx));
    }
  }
  // d_normed = d_pre W1: every rank's slice contributed to every token, so
  // the ranks' parts are summed and each keeps its own tokens.
  auto fc1_dgrad = [&](std::int64_t first_row, std::int64_t rows) {
    const bool whole = first_row == 0 && rows == all_tokens;
    return ops::gemm(ctx, d_pre, w1_.value,
                     {.out_dtype = config_.dtype, .rows = whole ? 0 : rows, .a_row = first_row})
        .d;
  };
  if (tp_ == nullptr) return norm_.backward(ctx, saved.norm, {fc1_dgrad(0, all_tokens), args.dx_residual});
  const Tensor d_normed = gemm_reduce_scatter(ctx, *tp_, all_tokens, config_.overlap.fc1_dgrad, fc1_dgrad);
  const Tensor dx = norm_.backward(ctx, saved.norm, {d_normed, args.dx_residual});
  // gamma and beta saw only this rank's tokens.
  ops::all_reduce_many_(ctx, *tp_, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

}  // namespace stepgraph
