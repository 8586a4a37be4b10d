#include "layers/norm.h"

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "ops/elementwise_ops.h"
#include "ops/norm_ops.h"

namespace stepgraph {

Norm::Norm(Context& ctx, const std::string& name, const NormConfig& config)
    : label_(layer_label("Norm", name)), config_(config) {
  SG_CHECK(config.hidden > 0, "Norm '", name, "': hidden must be > 0, got ", config.hidden);
  gamma_ = make_parameter(ctx, name + ".gamma", Shape{config.hidden}, config.dtype, ParameterInit::constant(1.0f));
  if (layernorm()) {
    beta_ = make_parameter(ctx, name + ".beta", Shape{config.hidden}, config.dtype, ParameterInit::constant(0.0f));
  }
}

std::vector<Parameter*> Norm::parameters() {
  std::vector<Parameter*> out{&gamma_};
  if (layernorm()) out.push_back(&beta_);
  return out;
}

std::vector<Tensor> Norm::gradients() const {
  std::vector<Tensor> out{gamma_.grad};
  if (layernorm()) out.push_back(beta_.grad);
  return out;
}

Norm::Forward Norm::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"...", config_.hidden}, config_.dtype);
  const ops::NormParams params{config_.kind, config_.eps};
  const ops::NormForward f = ops::norm_forward(ctx, params, args.x, gamma_.value, layernorm() ? beta_.value : Tensor());
  return {f.y, Saved{args.x, f.mean, f.rstd}};
}

Norm::Fp8Forward Norm::forward_fp8(Context& ctx, const Tensor& x, const Tensor& scale,
                                   const ops::FusedFp8Params& params) const {
  check_input(label_, "forward_fp8", "input", x, {"tokens", config_.hidden}, config_.dtype);
  const ops::NormFp8 f = ops::norm_fp8(ctx, {{config_.kind, config_.eps}, params}, x, gamma_.value,
                                       layernorm() ? beta_.value : Tensor(), scale);
  return {f.out, Saved{x, f.mean, f.rstd}};
}

Tensor Norm::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.x", saved.x, {"...", config_.hidden}, config_.dtype, "the forward's input");
  check_input(label_, "backward", "dy", args.dy, exactly(saved.x.shape()), config_.dtype, "the forward's output");
  const ops::NormParams params{config_.kind, config_.eps};
  // The parameter gradients straight into gamma's and beta's grads: no copy launches after it.
  if (args.dx_residual.defined()) {
    check_input(label_, "backward", "dx_residual", args.dx_residual, exactly(saved.x.shape()), config_.dtype,
                "the forward's input");
  }
  return ops::norm_backward_into_(ctx, params, args.dy, saved.x, saved.mean, saved.rstd, gamma_.value,
                                  gamma_.gradient_for_write(ctx),
                                  layernorm() ? beta_.gradient_for_write(ctx) : Tensor(), args.dx_residual);
}

}  // namespace stepgraph
