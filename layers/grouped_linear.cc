#include "layers/grouped_linear.h"

#include <cmath>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/activation_ops.h"
#include "ops/fp8_ops.h"
#include "ops/grouped_fp8_ops.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/moe_ops.h"

namespace stepgraph {

GroupedLinear::GroupedLinear(Context& ctx, const std::string& name, const GroupedLinearConfig& config,
                             std::uint32_t seed, Communicator* tensor_parallel)
    : name_(name), label_(layer_label("GroupedLinear", name)), config_(config), tp_(tensor_parallel) {
  SG_CHECK(config.experts >= 1 && config.experts <= kernels::kMaxExperts, "GroupedLinear '", name,
           "': experts must be in [1, ", kernels::kMaxExperts, "], got ", config.experts);
  SG_CHECK(config.in_features > 0 && config.out_features > 0, "GroupedLinear '", name,
           "': in_features and out_features must be > 0, got ", config.in_features, " and ", config.out_features);
  SG_CHECK_CODE(config.dtype == DType::kBFloat16 || config.dtype == DType::kFloat32, ErrorCode::kUnsupported,
                "GroupedLinear '", name, "': dtype ", dtype_name(config.dtype),
                " is not supported (the grouped GEMM takes bf16 or fp32)");
  SG_CHECK(config.first_expert >= 0 && config.held_experts >= 0 &&
               config.first_expert + config.held_experts <= config.experts &&
               (config.held_experts > 0 || config.first_expert == 0),
           "GroupedLinear '", name, "': first_expert ", config.first_expert, " and held_experts ",
           config.held_experts, " must pick experts inside [0, experts = ", config.experts,
           ") (held_experts 0 holds them all, from first_expert 0)");
  const bool some_experts = config.held_experts > 0 && config.held_experts < config.experts;
  SG_CHECK_CODE(!some_experts || tensor_parallel == nullptr, ErrorCode::kUnsupported, "GroupedLinear '", name,
                "': tensor-parallel slices of some of the experts (held_experts ", config.held_experts, " of ",
                config.experts, ") are not built; hold every expert with a tensor-parallel communicator, or pass "
                "none for whole experts");
  SG_CHECK_CODE(!config.fp8 || config.split_sum == kernels::SplitSum::kEqualsRows, ErrorCode::kUnsupported,
                "GroupedLinear '", name, "': FP8 with split_sum = kAtMostRows is not built (the padding rows would "
                "enter the tensor-wise amaxes); use SplitSum::kEqualsRows or a 16-bit layer");
  if (tensor_parallel != nullptr) {
    SG_CHECK(config.parallel != GroupedParallel::kNone, "GroupedLinear '", name,
             "': a tensor-parallel communicator needs config.parallel = GroupedParallel::kColumn or kRow (which "
             "side of the weights to shard); pass no communicator for the whole layer");
    tensor_parallel->check_device(ctx.device(), layer_label("GroupedLinear", name));
    ranks_ = tensor_parallel->world_size();
    rank_ = tensor_parallel->rank();
    const bool column = config.parallel == GroupedParallel::kColumn;
    // An activation of a partial sum is not the sum's (Note [Linear epilogues] in layers/linear.h).
    SG_CHECK(column || config.activation == LinearActivation::kNone, label_, ": activation ",
             linear_activation_name(config.activation),
             " on a row-parallel layer would act on each rank's partial sum; put it on a column-parallel layer");
    SG_CHECK(!column || config.input_activation == LinearActivation::kNone, label_, ": input_activation ",
             linear_activation_name(config.input_activation),
             " on a column-parallel layer would differentiate each rank's partial dx; use it on a row-parallel "
             "layer");
    const std::int64_t sharded = column ? config.out_features : config.in_features;
    SG_CHECK(sharded % ranks_ == 0, "GroupedLinear '", name, "': ", column ? "out_features " : "in_features ",
             sharded, " must divide by the ", ranks_, " tensor-parallel ranks (", column ? "column" : "row",
             "-parallel); pick a size that is a multiple of the tensor-parallel world size");
  }
  const std::int64_t e = config.experts, in = config.in_features, out = config.out_features;
  const std::int64_t lin = local_in(), lout = local_out(), held = local_experts();
  const float scale = 1.0f / std::sqrt(static_cast<float>(in));
  // This rank's slices of the weights one rank draws from `seed`: as a
  // [experts, out * in] matrix, kColumn's slice is the columns from
  // r lout in; as [experts * out, in], kRow's is the columns from r lin.
  ParameterInit weight_init = ParameterInit::uniform(scale, seed);
  ParameterInit bias_init = ParameterInit::uniform(scale, seed + 1);
  if (ranks_ > 1 && config.parallel == GroupedParallel::kColumn) {
    weight_init = weight_init.columns_from(e, out * in, rank_ * lout * in);
    bias_init = bias_init.columns_from(e, out, rank_ * lout);
  } else if (ranks_ > 1 && config.parallel == GroupedParallel::kRow) {
    weight_init = weight_init.columns_from(e * out, in, rank_ * lin);
  } else if (held < e) {
    // Whole experts: rows [first, first + held) of W as [experts, out * in].
    weight_init = weight_init.rows_from(e, out * in, config.first_expert);
    bias_init = bias_init.rows_from(e, out, config.first_expert);
  }
  weight_ = make_parameter(ctx, name + ".weight", Shape{held, lout, lin}, config.dtype, weight_init);
  if (config.bias) {
    bias_ = make_parameter(ctx, name + ".bias", Shape{held, lout}, config.dtype, bias_init);
  }
  error_word_ = ctx.persistent(name + ".split_error", {Shape{1}, DType::kInt32});
  if (config.fp8) {
    // See Note [FP8 GroupedLinear].
    config.fp8->check();
    ctx.backend().check_fp8_supported();
    SG_CHECK_CODE(config.fp8->scaling != Fp8Scaling::kBlock, ErrorCode::kUnsupported, label_,
                  ": block scaling is not built for grouped products (the grouped FP8 kernel scales tensor-wise in "
                  "its epilogue); use current or delayed scaling (Note [FP8 GroupedLinear])");
    SG_CHECK_CODE(config.dtype == DType::kBFloat16, ErrorCode::kUnsupported, label_, ": FP8 needs a bf16 layer, got ",
                  dtype_name(config.dtype));
    SG_CHECK(lin % 16 == 0 && lout % 16 == 0, label_, ": FP8 grouped products need in_features and out_features ",
             "divisible by 16", ranks_ > 1 ? " on every rank" : "", ", got ", lin, " and ", lout);
    non_finite_ = detail::make_non_finite_counter(ctx, name + ".fp8.non_finite_amaxes");
    if (config.fp8->scaling == Fp8Scaling::kDelayed) {
      x_state_ = detail::make_delayed_state(ctx, name + ".fp8.x", *config.fp8, state_);
      w_state_ = detail::make_delayed_state(ctx, name + ".fp8.w", *config.fp8, state_);
      dy_state_ = detail::make_delayed_state(ctx, name + ".fp8.dy", *config.fp8, state_);
    }
    if (config.fp8->cache_weights) {
      w_cache_ = detail::make_weight_cache(ctx, name + ".fp8.w_cache", weight_.value, *config.fp8);
      weight_.after_update = {weight_cache_hook()};
      run_after_update(ctx, weight_);
    }
  }
}

std::function<void(Context&)> GroupedLinear::weight_cache_hook() const {
  return detail::weight_cache_hook(*config_.fp8, weight_.value, w_state_, tp_, *w_cache_, non_finite_);
}

std::int64_t GroupedLinear::non_finite_amaxes(Context& ctx) const {
  return detail::read_non_finite_counter(ctx, non_finite_);
}

void GroupedLinear::share_non_finite_counter(const Tensor& counter) {
  detail::check_non_finite_counter(label_, counter);
  non_finite_ = counter;
  if (w_cache_) weight_.after_update = {weight_cache_hook()};  // the hook counts into the shared counter now
}

std::int64_t GroupedLinear::local_in() const {
  return config_.parallel == GroupedParallel::kRow ? config_.in_features / ranks_ : config_.in_features;
}

std::int64_t GroupedLinear::local_experts() const {
  return config_.held_experts > 0 ? config_.held_experts : config_.experts;
}

std::int64_t GroupedLinear::local_out() const {
  return config_.parallel == GroupedParallel::kColumn ? config_.out_features / ranks_ : config_.out_features;
}

std::vector<Parameter*> GroupedLinear::parameters() {
  std::vector<Parameter*> out{&weight_};
  if (config_.bias) out.push_back(&bias_);
  return out;
}

GroupedLinear::Forward GroupedLinear::forward(Context& ctx, const FwdArgs& args) const {
  const std::string& label = label_;
  check_input(label, "forward", "input", args.x, {"tokens", local_in()}, config_.dtype);
  check_input(label, "forward", "splits", args.splits, {local_experts()}, DType::kInt32,
              local_experts() < config_.experts ? "one size per expert this layer holds" : "one size per expert");
  const TensorMeta& x = args.x.meta();
  const Tensor offsets = ops::split_offsets(ctx, args.splits, error_word_, x.shape.dim(0), config_.split_sum);
  offsets.set_name(name_ + ".offsets");
  // A row-parallel bias goes into the ranks' sum once: rank 0 adds it.
  const bool adds_bias = config_.bias && (config_.parallel != GroupedParallel::kRow || rank_ == 0);
  const Tensor bias = adds_bias ? bias_.value : Tensor();
  Forward out;
  if (config_.fp8) {
    out = forward_fp8(ctx, args.x, offsets, bias);
  } else {
    out.saved.x = args.x;
    out.saved.offsets = offsets;
    out.y = ops::grouped_linear_forward(ctx, args.x, weight_.value, offsets, bias, config_.dtype);
  }
  if (config_.activation == LinearActivation::kGelu) {
    out.pre = out.y;
    out.y = ops::gelu(ctx, out.pre);
  }
  return out;
}

GroupedLinear::Forward GroupedLinear::forward_fp8(Context& ctx, const Tensor& x, const Tensor& offsets,
                                                  const Tensor& bias) const {
  const Fp8Recipe& recipe = *config_.fp8;
  const std::int64_t tokens = x.shape().dim(0);
  SG_CHECK(tokens % 16 == 0, label_, " forward: FP8 grouped products need a token count divisible by 16, got ",
           tokens);
  const bool row = config_.parallel == GroupedParallel::kRow;
  const detail::Fp8Copies xq = detail::quantize_for_gemm(ctx, recipe, x, recipe.forward_format(), true, true, x_state_,
                                                         kernels::BlockShape::k1x128, slices_of(row));
  detail::Fp8Copies wq;
  if (w_cache_) {
    wq = detail::cached_copies(*w_cache_);  // made after the last update (Note [FP8 weight cache])
  } else {
    // W's copy does not wait for the activations (as an FP8 Linear's).
    WeightGradScope side(ctx);
    wq = detail::quantize_for_gemm(ctx, recipe, weight_.value, recipe.forward_format(), true, false, w_state_,
                                   kernels::BlockShape::k128x128, tp_);
  }
  ops::count_flags_(ctx, non_finite_, detail::defined({xq.non_finite, wq.non_finite}));
  Forward out;
  out.y = ops::grouped_fp8_forward(ctx, xq.rowwise, xq.rowwise_scale_inv, wq.rowwise,
                                   wq.rowwise_scale_inv, offsets, bias, config_.dtype,
                                   !recipe.fast_accumulation_forward);
  const bool current = recipe.scaling == Fp8Scaling::kCurrent;
  out.saved = Saved{.offsets = offsets,
                    .x_fp8_t = xq.columnwise,
                    .x_scale_inv = xq.columnwise_scale_inv,
                    .w_scale = current ? wq.scale : Tensor(),
                    .w_scale_inv = current ? wq.rowwise_scale_inv : Tensor(),
                    .x_amax = xq.amax,
                    .w_amax = wq.amax};
  return out;
}

Tensor GroupedLinear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const bool takes_pre = config_.input_activation == LinearActivation::kGelu;
  if (takes_pre) {
    check_input(label_, "backward", "input_pre", args.input_pre, {"tokens", local_in()}, config_.dtype,
                "the pre-activation of the forward's input");
  }
  const Tensor dx = config_.fp8 ? backward_fp8(ctx, saved, args.dy) : backward_16bit(ctx, saved, args);
  return takes_pre ? ops::gelu_backward(ctx, dx, args.input_pre) : dx;
}

Tensor GroupedLinear::backward_16bit(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const std::string& label = label_;
  // A saved input left undefined is made again from the pre-activation (recompute_activation).
  const bool remakes_x = config_.input_activation == LinearActivation::kGelu && !saved.x.defined();
  const Tensor x = remakes_x ? ops::gelu(ctx, args.input_pre) : saved.x;
  check_input(label, "backward", "saved.x", x, {"tokens", local_in()}, config_.dtype, "the forward's input");
  check_input(label, "backward", "saved.offsets", saved.offsets, {local_experts() + 1}, DType::kInt32,
              "the forward's split offsets");
  check_input(label, "backward", "dy", args.dy, {x.shape().dim(0), local_out()}, config_.dtype,
              "the forward's output");
  // A row-parallel bias gradient is the whole one on every rank: every rank
  // gets the same (whole) dy, whichever rank added the bias.
  ops::grouped_linear_wgrad_(ctx, weight_.gradient_for_write(ctx), args.dy, x, saved.offsets,
                             /*accumulate=*/false);
  if (config_.bias) {
    ops::grouped_bias_grad_(ctx, bias_.gradient_for_write(ctx), args.dy, saved.offsets, /*accumulate=*/false);
  }
  return ops::grouped_linear_dgrad(ctx, args.dy, weight_.value, saved.offsets, config_.dtype);
}

Tensor GroupedLinear::backward_fp8(Context& ctx, const Saved& saved, const Tensor& dy_value) const {
  const Fp8Recipe& recipe = *config_.fp8;
  check_input(label_, "backward", "saved.x_fp8_t", saved.x_fp8_t, {local_in(), "tokens"},
              fp8_dtype(recipe.forward_format()), "the forward's input, transposed, in FP8");
  const std::int64_t tokens = saved.x_fp8_t.shape().dim(1);
  check_input(label_, "backward", "saved.offsets", saved.offsets, {local_experts() + 1}, DType::kInt32,
              "the forward's split offsets");
  check_input(label_, "backward", "dy", dy_value, {tokens, local_out()}, config_.dtype, "the forward's output");
  const bool column = config_.parallel == GroupedParallel::kColumn;
  const detail::Fp8Copies dy = detail::quantize_for_gemm(ctx, recipe, dy_value, recipe.gradient_format(), true, true,
                                                         dy_state_, kernels::BlockShape::k1x128, slices_of(column));
  ops::grouped_fp8_wgrad_(ctx, weight_.gradient_for_write(ctx), dy.columnwise, dy.columnwise_scale_inv,
                          saved.x_fp8_t, saved.x_scale_inv, saved.offsets, /*accumulate=*/false,
                          !recipe.fast_accumulation_backward);
  // The bias's gradient from the 16-bit dy (as the 16-bit layer's).
  if (config_.bias) {
    ops::grouped_bias_grad_(ctx, bias_.gradient_for_write(ctx), dy_value, saved.offsets, /*accumulate=*/false);
  }
  // W's column-wise copy [in, E * out], quantized again with the forward's scale.
  const bool delayed = recipe.scaling == Fp8Scaling::kDelayed;
  const Tensor w_scale = delayed ? w_state_.scale : saved.w_scale;
  const Tensor w_scale_inv = delayed ? w_state_.scale_inv : saved.w_scale_inv;
  const Tensor w_t = w_cache_ ? w_cache_->columnwise
                             : ops::quantize(ctx, weight_.value, w_scale, {recipe.forward_format(), false, true}).columnwise;
  const Tensor dx = ops::grouped_fp8_dgrad(ctx, dy.rowwise, dy.rowwise_scale_inv, w_t,
                                           w_cache_ ? w_cache_->scale_inv : w_scale_inv, saved.offsets, config_.dtype,
                                           !recipe.fast_accumulation_backward);
  if (delayed) {
    // This step's amaxes into the histories, after the products above read the old scales.
    const bool row = config_.parallel == GroupedParallel::kRow;
    detail::update_delayed_scaling(ctx, recipe,
                                   {{saved.x_amax, x_state_, recipe.forward_format(), row, true},
                                    {saved.w_amax, w_state_, recipe.forward_format(), true, false},
                                    {dy.amax, dy_state_, recipe.gradient_format(), column, true}},
                                   tp_, amax_group_, non_finite_);
  } else if (dy.non_finite.defined()) {
    ops::count_flags_(ctx, non_finite_, {dy.non_finite});
  }
  return dx;
}

void GroupedLinear::check_splits(Context& ctx) const {
  check_routing_error_word(ctx, error_word_, "GroupedLinear '" + name_ + "'");
}

void check_routing_error_word(Context& ctx, const Tensor& word, const std::string& what) {
  const std::int32_t bits = ctx.to_vector<std::int32_t>(word).at(0);
  if (bits == 0) return;
  const std::int32_t zero = 0;
  ctx.copy_from_host(word, &zero, sizeof(zero));
  std::string problems;
  auto add = [&](std::int32_t bit, const char* text) {
    if ((bits & bit) == 0) return;
    problems += problems.empty() ? "" : "; ";
    problems += text;
  };
  add(kernels::kSplitNegative, "a split size was negative");
  add(kernels::kSplitSumMismatch,
      "the split sizes did not add up to the token count (or, where fewer rows are allowed, exceeded it)");
  add(kernels::kExpertOutOfRange, "an expert index was outside [0, experts)");
  SG_THROW(ErrorCode::kInvalidArgument, what, ": bad routing in a step since the last check: ", problems,
           " (error word ", bits,
           "); the step clamped them to stay in bounds, so its results are wrong. "
           "Check the split sizes passed to the layer.");
}

}  // namespace stepgraph
