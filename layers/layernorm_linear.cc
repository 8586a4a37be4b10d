#include "layers/layernorm_linear.h"

#include "engine/error.h"
#include "layers/layer_checks.h"

namespace stepgraph {

LayerNormLinear::LayerNormLinear(Context& ctx, const std::string& name, const LayerNormLinearConfig& config,
                                 std::uint32_t seed)
    : label_(layer_label("LayerNormLinear", name)),
      norm_(ctx, name + ".norm", NormConfig{config.norm, config.linear.in_features, config.eps, config.linear.dtype}),
      linear_(ctx, name + ".linear", config.linear, seed) {}

std::vector<Parameter*> LayerNormLinear::parameters() {
  std::vector<Parameter*> out = norm_.parameters();
  for (Parameter* p : linear_.parameters()) out.push_back(p);
  return out;
}

LayerNormLinear::Forward LayerNormLinear::forward(Context& ctx, const FwdArgs& args) const {
  const LinearConfig& linear = linear_.config();
  check_input(label_, "forward", "input", args.x, {"tokens", linear.in_features}, linear.dtype);
  const Norm::Forward normed = norm_.forward(ctx, {args.x});
  const Linear::Forward projected = linear_.forward(ctx, {normed.y});
  return {projected.y, Saved{normed.saved, projected.saved}};
}

Tensor LayerNormLinear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const LinearConfig& linear = linear_.config();
  check_input(label_, "backward", "saved.norm.x", saved.norm.x, {"tokens", linear.in_features}, linear.dtype,
              "the forward's input");
  const std::int64_t tokens = saved.norm.x.shape().dim(0);
  check_input(label_, "backward", "saved.linear.x", saved.linear.x, {tokens, linear.in_features}, linear.dtype,
              "the forward's normed input");
  check_input(label_, "backward", "dy", args.dy, {tokens, linear.out_features}, linear.dtype, "the forward's output");
  const Tensor d_normed = linear_.backward(ctx, saved.linear, {args.dy});
  if (!d_normed.defined()) return {};
  return norm_.backward(ctx, saved.norm, {d_normed});
}

}  // namespace stepgraph
