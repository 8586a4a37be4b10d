// Linear's FP8 GEMMs (Note [FP8 Linear] in layers/linear.h): quantized
// operands, their scales and delayed-scaling state, the operands a maker
// quantized (Note [Fused FP8 operands]), and FP8 tensor parallelism.
#include "layers/linear.h"

#include <optional>
#include <string>
#include <vector>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/fp8_ops.h"
#include "ops/gemm_ops.h"
#include "ops/row_ops.h"

namespace stepgraph {

using kernels::GemmEpilogue;

void Linear::share_non_finite_counter(const Tensor& counter) {
  detail::check_non_finite_counter(label_, counter);
  non_finite_ = counter;
  if (w_cache_) weight_.after_update = {weight_cache_hook()};  // the hook counts into the shared counter now
}

std::function<void(Context&)> Linear::weight_cache_hook() const {
  // W is a slice under tensor parallelism: its amax is the largest over the group.
  return detail::weight_cache_hook(*config_.fp8, weight_.value, w_state_, tp_, *w_cache_, non_finite_);
}

std::int64_t Linear::non_finite_amaxes(Context& ctx) const { return detail::read_non_finite_counter(ctx, non_finite_); }

void Linear::check_errors(Context& ctx) const {
  if (!config_.fp8) return;
  check_non_finite_amaxes(non_finite_amaxes(ctx), *config_.fp8, label_);
}

void check_non_finite_amaxes(std::int64_t count, const Fp8Recipe& recipe, std::string_view where) {
  SG_CHECK(count == 0 || recipe.on_non_finite != NonFiniteAmax::kStop, where, ": ", count,
           " FP8 quantization(s) met a non-finite amax (NaN or infinity in an activation, weight or gradient), and "
           "the recipe's on_non_finite is stop; find the step that made it, or set on_non_finite skip_step to "
           "keep the scales and go on");
}

using detail::defined;
using detail::quantize_for_gemm;

namespace {

// The GEMM params of FP8 operands a and b, block-scaled or not.
ops::GemmParams fp8_params(std::optional<kernels::BlockShape> a_blocks, std::optional<kernels::BlockShape> b_blocks,
                           DType out_dtype, bool fast_accumulation) {
  return {.trans_b = true,
          .out_dtype = out_dtype,
          .fast_accumulation = fast_accumulation,
          .a_blocks = a_blocks,
          .b_blocks = b_blocks};
}

}  // namespace

Tensor Linear::gather_tokens(Context& ctx, const Tensor& shard, CommOverlap mode) const {
  return all_gather_gemm(ctx, *tp_, shard, mode, [](const Tensor&, std::int64_t) {});
}

Tensor Linear::sum_partials(Context& ctx, const Tensor& partial, CommOverlap mode) const {
  if (sequence_parallel()) {
    const std::int64_t rows = partial.shape().dim(0);
    SG_CHECK(rows % ranks() == 0, label_, ": a sequence-parallel layer reduce-scatters its ", rows,
             " tokens over the ", ranks(), " ranks of ", tp_->describe(), "; give it a multiple of ", ranks(),
             " tokens");
    return gemm_reduce_scatter(ctx, *tp_, rows, mode, [&](std::int64_t, std::int64_t) { return partial; });
  }
  std::optional<InlineCollectives> serial;
  if (mode == CommOverlap::kNone) serial.emplace(ctx);
  return ops::all_reduce(ctx, *tp_, partial, ReduceOp::kSum);
}

Communicator* Linear::slices_of(bool sharded) const { return sharded ? tp_ : nullptr; }

Linear::Forward Linear::forward_fp8(Context& ctx, const FwdArgs& args) const {
  const Fp8Recipe& recipe = *config_.fp8;
  // A sequence-parallel column layer quantizes every rank's tokens, gathered in 16 bits first.
  const Tensor x_all = column() && sequence_parallel() ? gather_tokens(ctx, args.x, config_.fprop_overlap) : args.x;
  const bool blocks = recipe.scaling == Fp8Scaling::kBlock;
  const std::int64_t tokens = x_all.shape().dim(0);
  SG_CHECK(tokens % (blocks ? 128 : 16) == 0, label_, " forward: FP8 GEMMs", blocks ? " with block scaling" : "",
           " need a token count divisible by ", blocks ? 128 : 16, ", got ", tokens);
  // A row-parallel x holds in / N of the features.
  return forward_fp8_from(ctx, quantize_for_gemm(ctx, recipe, x_all, recipe.forward_format(), true, config_.wgrad,
                                                 x_state_, kernels::BlockShape::k1x128,
                                                 slices_of(row())));
}

Linear::Forward Linear::forward_fp8_from(Context& ctx, const detail::Fp8Copies& x) const {
  const Fp8Recipe& recipe = *config_.fp8;
  detail::Fp8Copies w;
  if (w_cache_) {
    w = detail::cached_copies(*w_cache_);  // made after the last update (Note [FP8 weight cache])
  } else {
    // W's copy does not wait for the activations: it is made on the weight-
    // gradient stream (idle in the forward) beside the work before this GEMM.
    // W is always a slice under tensor parallelism.
    WeightGradScope side(ctx);
    w = quantize_for_gemm(ctx, recipe, weight_.value, recipe.forward_format(), true, false, w_state_,
                          kernels::BlockShape::k128x128, slices_of(true));
  }
  ops::count_flags_(ctx, non_finite_, defined({x.non_finite, w.non_finite}));
  // Row-parallel: the bias once in the sum of the ranks' partial products.
  const bool adds_bias = config_.bias && (!row() || tp_->rank() == 0);
  ops::GemmParams fprop = fp8_params(x.blocks, w.blocks, config_.dtype, recipe.fast_accumulation_forward);
  fprop.epilogue = adds_bias ? GemmEpilogue::kBias : GemmEpilogue::kNone;
  Forward out;
  out.y = ops::fp8_gemm(ctx, x.rowwise, x.rowwise_scale_inv, w.rowwise, w.rowwise_scale_inv, fprop,
                        adds_bias ? bias_.value : Tensor())
              .d;
  if (row()) out.y = sum_partials(ctx, out.y, config_.fprop_overlap);
  if (config_.activation == LinearActivation::kGelu) {
    // FP8 GEMMs have no GeLU epilogue (Note [Linear epilogues]).
    out.pre = out.y;
    out.y = ops::gelu(ctx, out.pre);
  }
  out.saved = Saved{.dgrad = config_.dgrad,
                    .wgrad = config_.wgrad,
                    .x_fp8_t = x.columnwise,
                    .x_scale_inv = x.columnwise_scale_inv,
                    .w_scale = recipe.scaling == Fp8Scaling::kCurrent ? w.scale : Tensor(),
                    .w_scale_inv = recipe.scaling == Fp8Scaling::kCurrent ? w.rowwise_scale_inv : Tensor(),
                    .x_amax = x.amax,
                    .w_amax = w.amax};
  return out;
}

Tensor Linear::backward_fp8(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  // A sequence-parallel row layer's dy holds this rank's tokens: the GEMMs take every rank's.
  const bool gathers_dy = row() && sequence_parallel();
  check_input(label_, "backward", "dy", args.dy, {"tokens", local_out_features()}, config_.dtype,
              "the forward's output");
  if (!saved.dgrad && !saved.wgrad) return {};
  const Tensor dy_all = gathers_dy ? gather_tokens(ctx, args.dy, config_.dgrad_overlap) : args.dy;
  const Fp8Recipe& recipe = *config_.fp8;
  // A column-parallel dy holds out / N of the features.
  const detail::Fp8Copies dy =
      quantize_for_gemm(ctx, recipe, dy_all, recipe.gradient_format(), saved.dgrad, saved.wgrad, dy_state_,
                        kernels::BlockShape::k1x128, slices_of(column()));
  return backward_fp8_from(ctx, saved, dy, dy_all, dy_all.shape().dim(0));
}

Tensor Linear::backward_fp8_from(Context& ctx, const Saved& saved, const detail::Fp8Copies& dy,
                                 const Tensor& dy_value, std::int64_t tokens) const {
  if (saved.wgrad) {
    check_input(label_, "backward", "saved.x_fp8_t", saved.x_fp8_t, {local_in_features(), tokens},
                fp8_dtype(config_.fp8->forward_format()), "the forward's input, transposed, in FP8");
  }
  const Fp8Recipe& recipe = *config_.fp8;
  // How x's saved transposed copy was quantized, and how W's is below.
  const std::optional<kernels::BlockShape> x_blocks =
      recipe.scaling == Fp8Scaling::kBlock ? std::optional(kernels::BlockShape::k1x128) : std::nullopt;
  const std::optional<kernels::BlockShape> w_blocks =
      recipe.scaling == Fp8Scaling::kBlock ? std::optional(kernels::BlockShape::k128x128) : std::nullopt;
  if (saved.wgrad) {
    // grad_W[out, in] = dy^T x, both as their transposed copies, on the weight-gradient stream.
    WeightGradScope weight_grads(ctx);
    ops::GemmParams wgrad = fp8_params(dy.blocks, x_blocks, DType::kFloat32, recipe.fast_accumulation_backward);
    ops::fp8_gemm_into_(ctx, weight_.gradient_for_write(ctx), dy.columnwise, dy.columnwise_scale_inv,
                        saved.x_fp8_t, saved.x_scale_inv, wgrad);
    // The bias's gradient from the 16-bit dy: no FP8 epilogue reduces it.
    if (config_.bias) ops::copy_(ctx, bias_.gradient_for_write(ctx), ops::column_sum(ctx, dy_value));
  }
  Tensor dx;
  if (saved.dgrad) {
    // W's transposed copy, quantized again as the forward quantized W (Note [FP8 Linear]).
    detail::Fp8Copies w;
    if (w_cache_) {
      w = detail::cached_copies(*w_cache_);
    } else if (recipe.scaling == Fp8Scaling::kBlock) {
      w = quantize_for_gemm(ctx, recipe, weight_.value, recipe.forward_format(), false, true, {},
                            kernels::BlockShape::k128x128, nullptr);
    } else {
      const bool delayed = recipe.scaling == Fp8Scaling::kDelayed;
      const Tensor scale = delayed ? w_state_.scale : saved.w_scale;
      const Tensor scale_inv = delayed ? w_state_.scale_inv : saved.w_scale_inv;
      w = {.columnwise = ops::quantize(ctx, weight_.value, scale, {recipe.forward_format(), false, true}).columnwise,
           .columnwise_scale_inv = scale_inv};
    }
    if (w.non_finite.defined()) ops::count_flags_(ctx, non_finite_, {w.non_finite});
    const ops::GemmParams dgrad = fp8_params(dy.blocks, w_blocks, config_.dtype, recipe.fast_accumulation_backward);
    dx = ops::fp8_gemm(ctx, dy.rowwise, dy.rowwise_scale_inv, w.columnwise, w.columnwise_scale_inv, dgrad).d;
    // Column-parallel: every rank's slice of out contributed to every input feature.
    if (column()) dx = sum_partials(ctx, dx, config_.dgrad_overlap);
  }
  if (recipe.scaling == Fp8Scaling::kDelayed) {
    // This step's amaxes into the histories, the scales for the next step:
    // written after the GEMMs above read the old ones (Note [FP8 Linear]);
    // the largest over the slices, then over the data-parallel ranks
    // (set_amax_group).
    detail::update_delayed_scaling(ctx, recipe,
                                   {{saved.x_amax, x_state_, recipe.forward_format(), row(), true},
                                    {saved.w_amax, w_state_, recipe.forward_format(), true, false},
                                    {dy.amax, dy_state_, recipe.gradient_format(), column(), true}},
                                   tp_, amax_group_, non_finite_);
  } else if (dy.non_finite.defined()) {
    ops::count_flags_(ctx, non_finite_, {dy.non_finite});
  }
  return dx;
}

bool takes_quantized_operands(const LinearConfig& config, bool tensor_parallel) {
  // The fused kernels that make the operands read 16-bit tensors.
  const bool sixteen_bit = config.dtype == DType::kBFloat16 || config.dtype == DType::kFloat16;
  return config.fp8 && config.fp8->scaling != Fp8Scaling::kBlock && !tensor_parallel && sixteen_bit;
}

bool Linear::takes_quantized_operands() const { return stepgraph::takes_quantized_operands(config_, tp_ != nullptr); }

Linear::OperandScale Linear::operand_scale(Context& ctx, const Tensor& amax, const DelayedState& state,
                                           Fp8Format format) const {
  SG_CHECK(takes_quantized_operands(), label_,
           ": quantized operands need an FP8 recipe with tensor-wise scaling, no tensor parallelism and a bf16 "
           "or fp16 layer (Note [Fused FP8 operands])");
  if (config_.fp8->scaling == Fp8Scaling::kDelayed) return {state.scale, state.scale_inv, Tensor()};
  SG_CHECK(amax.defined(), label_, ": current scaling makes the scale from the operand's amax; pass it");
  const ops::Scales s = ops::scale_from_amax(ctx, amax, {format, false});
  return {s.scale, s.scale_inv, s.non_finite};
}

Linear::OperandScale Linear::input_scale(Context& ctx, const Tensor& amax) const {
  return operand_scale(ctx, amax, x_state_, config_.fp8 ? config_.fp8->forward_format() : Fp8Format::kE4M3);
}

Linear::OperandScale Linear::gradient_scale(Context& ctx, const Tensor& amax) const {
  return operand_scale(ctx, amax, dy_state_, config_.fp8 ? config_.fp8->gradient_format() : Fp8Format::kE5M2);
}

Linear::Forward Linear::forward_quantized(Context& ctx, const QuantizedOperand& x, const OperandScale& scale) const {
  SG_CHECK(takes_quantized_operands(), label_, ": forward_quantized needs takes_quantized_operands()");
  check_input(label_, "forward_quantized", "x.rowwise", x.rowwise, {"tokens", local_in_features()},
              fp8_dtype(config_.fp8->forward_format()), "the input in FP8");
  const std::int64_t tokens = x.rowwise.shape().dim(0);
  SG_CHECK(tokens % 16 == 0, label_, " forward: FP8 GEMMs need a token count divisible by 16, got ", tokens);
  if (config_.wgrad) {
    check_input(label_, "forward_quantized", "x.columnwise", x.columnwise, {local_in_features(), tokens},
                fp8_dtype(config_.fp8->forward_format()), "the input, transposed, in FP8");
  }
  if (config_.fp8->scaling == Fp8Scaling::kDelayed) {
    check_input(label_, "forward_quantized", "x.amax", x.amax, {1}, DType::kFloat32,
                "the input's amax, which delayed scaling's history takes");
  }
  return forward_fp8_from(ctx, {.rowwise = x.rowwise,
                                .rowwise_scale_inv = scale.scale_inv,
                                .columnwise = x.columnwise,
                                .columnwise_scale_inv = scale.scale_inv,
                                .amax = x.amax,
                                .scale = scale.scale,
                                .non_finite = scale.non_finite});
}

Tensor Linear::backward_quantized(Context& ctx, const Saved& saved, const QuantizedOperand& dy,
                                  const OperandScale& scale) const {
  SG_CHECK(takes_quantized_operands(), label_, ": backward_quantized needs takes_quantized_operands()");
  SG_CHECK(config_.input_activation == LinearActivation::kNone, label_,
           ": backward_quantized takes dy as its maker quantized it, with no input_pre for input_activation ",
           linear_activation_name(config_.input_activation), "; let the maker of dy apply the activation's "
           "derivative (Note [Fused FP8 operands]), or call backward");
  if (!saved.dgrad && !saved.wgrad) return {};
  const Tensor& shaped = saved.dgrad ? dy.rowwise : dy.columnwise;
  SG_CHECK(shaped.defined(), label_, " backward_quantized: dy.", saved.dgrad ? "rowwise" : "columnwise",
           " is undefined; the ", saved.dgrad ? "data" : "weight", " gradient reads it");
  const DType q = fp8_dtype(config_.fp8->gradient_format());
  const std::int64_t tokens = shaped.shape().dim(saved.dgrad ? 0 : 1);
  if (saved.dgrad) {
    check_input(label_, "backward_quantized", "dy.rowwise", dy.rowwise, {tokens, local_out_features()}, q,
                "dy in FP8");
  }
  if (saved.wgrad) {
    check_input(label_, "backward_quantized", "dy.columnwise", dy.columnwise, {local_out_features(), tokens}, q,
                "dy, transposed, in FP8");
  }
  if (saved.wgrad && config_.bias) {
    check_input(label_, "backward_quantized", "dy.value", dy.value, {tokens, local_out_features()}, config_.dtype,
                "the 16-bit dy the bias gradient sums");
  }
  if (config_.fp8->scaling == Fp8Scaling::kDelayed) {
    check_input(label_, "backward_quantized", "dy.amax", dy.amax, {1}, DType::kFloat32,
                "dy's amax, which delayed scaling's history takes");
  }
  return backward_fp8_from(ctx, saved,
                           {.rowwise = dy.rowwise,
                            .rowwise_scale_inv = scale.scale_inv,
                            .columnwise = dy.columnwise,
                            .columnwise_scale_inv = scale.scale_inv,
                            .amax = dy.amax,
                            .scale = scale.scale,
                            .non_finite = scale.non_finite},
                           dy.value, tokens);
}

}  // namespace stepgraph
