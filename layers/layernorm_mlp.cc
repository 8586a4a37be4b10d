#include "layers/layernorm_mlp.h"

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "ops/activation_ops.h"
#include "ops/collective_ops.h"
#include "ops/fp8_fused_ops.h"

namespace stepgraph {
namespace {

// The config, checked for the layer before its Linears check theirs.
const LayerNormMLPConfig& checked(Context& ctx, const std::string& label, const LayerNormMLPConfig& config,
                                  Communicator* tp) {
  SG_CHECK(config.hidden > 0 && config.ffn > 0, label, ": hidden and ffn must be > 0, got ", config.hidden, " and ",
           config.ffn);
  const int ranks = tp != nullptr ? tp->world_size() : 1;
  SG_CHECK(config.ffn % ranks == 0, label, ": ffn ", config.ffn, " must divide by the ", ranks,
           " tensor-parallel ranks");
  if (tp != nullptr) tp->check_device(ctx.device(), label);
  config.overlap.check(label);
  return config;
}

// fc1 (`first`) or fc2 of the MLP: column- then row-parallel, both
// sequence-parallel, with a communicator (Note [Sequence-parallel
// LayerNormMLP]). GeLU sits between them as fc1's activation and fc2's input
// activation, unless the FP8 operands' makers apply it (Note [FP8 LayerNormMLP]).
LinearConfig fc_config(const LayerNormMLPConfig& config, bool first, bool split, bool quantized_operands) {
  const LinearActivation gelu = quantized_operands ? LinearActivation::kNone : LinearActivation::kGelu;
  const TensorParallelMode mode = first ? TensorParallelMode::kColumn : TensorParallelMode::kRow;
  // The overlap is the collectives' (tensor-parallel only); the plain layer has none.
  const MLPOverlap overlap = split ? config.overlap : MLPOverlap{};
  return {.in_features = first ? config.hidden : config.ffn,
          .out_features = first ? config.ffn : config.hidden,
          .dtype = config.dtype,
          .tensor_parallel = split ? mode : TensorParallelMode::kNone,
          .sequence_parallel = split,
          .fprop_overlap = first ? overlap.fc1_fprop : overlap.fc2_fprop,
          .dgrad_overlap = first ? overlap.fc1_dgrad : overlap.fc2_dgrad,
          .fp8 = config.fp8,
          .activation = first ? gelu : LinearActivation::kNone,
          .input_activation = first ? LinearActivation::kNone : gelu};
}

// Note [Fused FP8 operands]: fc1 and fc2 take the same recipe, dtype and communicator.
bool quantized_operands(const LayerNormMLPConfig& config, Communicator* tp) {
  return config.fp8_fused && takes_quantized_operands(fc_config(config, true, tp != nullptr, false), tp != nullptr);
}

}  // namespace

// Linear draws each weight uniform(1/sqrt(in)) from its seed and its bias
// from seed + 1: fc1 from seed, fc2 from seed + 2.
LayerNormMLP::LayerNormMLP(Context& ctx, const std::string& name, const LayerNormMLPConfig& config, std::uint32_t seed,
                           Communicator* tensor_parallel)
    : label_(layer_label("LayerNormMLP", name)),
      config_(checked(ctx, label_, config, tensor_parallel)),
      tp_(tensor_parallel),
      quantized_operands_(quantized_operands(config, tensor_parallel)),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.hidden, config.eps, config.dtype}),
      fc1_(ctx, name + ".fc1", fc_config(config, true, tp_ != nullptr, quantized_operands_), seed, tp_),
      fc2_(ctx, name + ".fc2", fc_config(config, false, tp_ != nullptr, quantized_operands_), seed + 2, tp_) {}

std::vector<Parameter*> LayerNormMLP::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Linear* fc : {&fc1_, &fc2_}) {
    for (Parameter* p : fc->parameters()) out.push_back(p);
  }
  return out;
}

std::vector<Linear*> LayerNormMLP::fp8_linears() {
  if (!config_.fp8) return {};
  return {&fc1_, &fc2_};
}

LayerNormMLP::Forward LayerNormMLP::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", config_.hidden}, config_.dtype);
  if (!quantized_operands_) {
    const Norm::Forward normed = norm_.forward(ctx, {args.x});
    // fc1 gives GeLU(pre) and pre; sequence-parallel, it all-gathers the normalised shards first.
    const Linear::Forward fc1 = fc1_.forward(ctx, {normed.y});
    Linear::Forward fc2 = fc2_.forward(ctx, {fc1.y});
    // Note [Recomputed activation]: fc2's backward makes its input again from pre.
    if (config_.recompute_activation) fc2.saved.x = Tensor();
    return {fc2.y, Saved{normed.saved, fc1.pre, fc1.saved, fc2.saved}};
  }
  // Note [Fused FP8 operands]: current scaling takes each amax in a pass of
  // its own first; delayed scaling quantizes with the state's scale at once.
  const bool current = config_.fp8->scaling == Fp8Scaling::kCurrent;
  const Fp8Format format = config_.fp8->forward_format();
  const ops::FusedFp8Params amax_only{.format = format, .amax_only = true};
  const ops::FusedFp8Params copies{.format = format, .columnwise = true};  // the Linears' wgrads read x^T
  const Linear::OperandScale s1 =
      fc1_.input_scale(ctx, current ? norm_.forward_fp8(ctx, args.x, Tensor(), amax_only).out.amax : Tensor());
  const Norm::Fp8Forward normed = norm_.forward_fp8(ctx, args.x, s1.scale, copies);
  const Linear::Forward fc1 =
      fc1_.forward_quantized(ctx, {normed.out.rowwise, normed.out.columnwise, normed.out.amax}, s1);
  // fc1 has no activation here: its y is pre, and GeLU writes fc2's FP8 input.
  const Linear::OperandScale s2 =
      fc2_.input_scale(ctx, current ? ops::gelu_fp8(ctx, fc1.y, Tensor(), amax_only).amax : Tensor());
  const ops::FusedFp8 act = ops::gelu_fp8(ctx, fc1.y, s2.scale, copies);
  const Linear::Forward fc2 = fc2_.forward_quantized(ctx, {act.rowwise, act.columnwise, act.amax}, s2);
  return {fc2.y, Saved{normed.saved, fc1.y, fc1.saved, fc2.saved}};
}

Tensor LayerNormMLP::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.norm.x", saved.norm.x, {"tokens", config_.hidden}, config_.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  check_input(label_, "backward", "dy", args.dy, {tokens, config_.hidden}, config_.dtype, "the forward's output");
  Tensor d_normed;
  if (!quantized_operands_) {
    // fc2's data gradient is the gradient of pre, with fc1's bias gradient
    // where its epilogue makes it (Note [Linear epilogues]).
    const Linear::Backward d_pre = fc2_.backward_fused(ctx, saved.fc2, {.dy = args.dy, .input_pre = saved.pre});
    d_normed = fc1_.backward(ctx, saved.fc1, {.dy = d_pre.dx, .bias_grad = d_pre.input_bias_grad});
  } else {
    // GeLU's backward writes fc1's FP8 output gradient, and the 16-bit one its bias gradient sums.
    const Tensor d_act = fc2_.backward(ctx, saved.fc2, {args.dy});
    const bool current = config_.fp8->scaling == Fp8Scaling::kCurrent;
    const Fp8Format format = config_.fp8->gradient_format();
    const Linear::OperandScale s = fc1_.gradient_scale(
        ctx, current ? ops::dgelu_fp8(ctx, d_act, saved.pre, Tensor(), {.format = format, .amax_only = true}).amax
                     : Tensor());
    const ops::FusedFp8 d_pre =
        ops::dgelu_fp8(ctx, d_act, saved.pre, s.scale, {.format = format, .columnwise = true, .keep_16bit = true});
    d_normed = fc1_.backward_quantized(ctx, saved.fc1, {d_pre.rowwise, d_pre.columnwise, d_pre.amax, d_pre.value}, s);
  }
  const Tensor dx = norm_.backward(ctx, saved.norm, {d_normed, args.dx_residual});
  // gamma and beta saw only this rank's tokens (Note [Sequence-parallel LayerNormMLP]).
  if (tp_ != nullptr) ops::all_reduce_many_(ctx, *tp_, norm_.gradients(), ReduceOp::kSum);
  return dx;
}

}  // namespace stepgraph
