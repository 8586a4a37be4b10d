#include "layers/layernorm_linear.h"

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "ops/collective_ops.h"

namespace stepgraph {
namespace {

// The linear's config, checked for a LayerNormLinear first: only a
// column-parallel linear can follow the norm (a row-parallel one would need
// a norm over a slice of the hidden features).
const LinearConfig& checked(const std::string& label, const LinearConfig& linear) {
  SG_CHECK(linear.tensor_parallel != TensorParallelMode::kRow, label,
           ": the linear cannot be row-parallel (the norm needs every hidden feature of a token); use kColumn");
  return linear;
}

}  // namespace

LayerNormLinear::LayerNormLinear(Context& ctx, const std::string& name, const LayerNormLinearConfig& config,
                                 std::uint32_t seed, Communicator* tensor_parallel)
    : label_(layer_label("LayerNormLinear", name)),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.linear.in_features, config.eps, config.linear.dtype}),
      linear_(ctx, name + ".linear", checked(label_, config.linear), seed, tensor_parallel),
      fp8_fused_(config.fp8_fused) {}

bool LayerNormLinear::sequence_parallel() const { return linear_.config().sequence_parallel; }

std::vector<Parameter*> LayerNormLinear::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Parameter* p : linear_.parameters()) out.push_back(p);
  return out;
}

LayerNormLinear::Forward LayerNormLinear::forward(Context& ctx, const FwdArgs& args) const {
  const LinearConfig& linear = linear_.config();
  check_input(label_, "forward", "input", args.x, {"tokens", linear.in_features}, linear.dtype);
  if (fp8_fused_ && linear_.takes_quantized_operands()) {
    // Current scaling takes the amax in a pass of its own first.
    const Fp8Format format = linear.fp8->forward_format();
    const Linear::OperandScale scale = linear_.input_scale(
        ctx, linear.fp8->scaling == Fp8Scaling::kCurrent
                 ? norm_.forward_fp8(ctx, args.x, Tensor(), {.format = format, .amax_only = true}).out.amax
                 : Tensor());
    const Norm::Fp8Forward normed =
        norm_.forward_fp8(ctx, args.x, scale.scale, {.format = format, .columnwise = linear.wgrad});
    const Linear::Forward projected =
        linear_.forward_quantized(ctx, {normed.out.rowwise, normed.out.columnwise, normed.out.amax}, scale);
    return {projected.y, Saved{normed.saved, projected.saved}};
  }
  const Norm::Forward normed = norm_.forward(ctx, {args.x});
  // Sequence-parallel: the linear all-gathers the normalised shards.
  const Linear::Forward projected = linear_.forward(ctx, {normed.y});
  return {projected.y, Saved{normed.saved, projected.saved}};
}

Tensor LayerNormLinear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const LinearConfig& linear = linear_.config();
  check_input(label_, "backward", "saved.norm.x", saved.norm.x, {"tokens", linear.in_features}, linear.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  Communicator* tp = linear_.tensor_parallel();
  // The linear's tokens: every rank's under sequence parallelism.
  const std::int64_t all_tokens = tokens * (sequence_parallel() ? tp->world_size() : 1);
  if (!linear.fp8) {  // an FP8 Linear keeps its input's FP8 copy instead (Note [FP8 Linear])
    check_input(label_, "backward", "saved.linear.x", saved.linear.x, {all_tokens, linear.in_features}, linear.dtype,
                "the forward's normed input");
  }
  check_input(label_, "backward", "dy", args.dy, {all_tokens, linear_.local_out_features()}, linear.dtype,
              "the forward's output");
  // Sequence-parallel: d_normed comes back reduce-scattered to this rank's tokens.
  Tensor d_normed;
  if (args.dy_weights.defined()) {
    SG_CHECK(!linear.fp8, label_, " backward: dy_weights with an FP8 linear (its scaling state takes one dy a step); "
             "pass no dy_weights");
    check_input(label_, "backward", "dy_weights", args.dy_weights, exactly(args.dy.shape()), linear.dtype,
                "dy with the copied rows' gradients summed");
    Linear::Saved data = saved.linear;
    data.wgrad = false;
    Linear::Saved weights = saved.linear;
    weights.dgrad = false;
    d_normed = linear_.backward(ctx, data, {args.dy});
    linear_.backward(ctx, weights, {args.dy_weights});
  } else {
    d_normed = linear_.backward(ctx, saved.linear, {args.dy});
  }
  if (!d_normed.defined()) return args.dx_residual;  // no dx of its own: the residual's gradient alone
  const Tensor dx = norm_.backward(ctx, saved.norm, {d_normed, args.dx_residual});
  // gamma and beta saw only this rank's tokens.
  if (sequence_parallel()) ops::all_reduce_many_(ctx, *tp, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

}  // namespace stepgraph
