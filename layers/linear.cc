#include "layers/linear.h"

#include <cmath>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"

namespace stepgraph {

using kernels::GemmEpilogue;

Linear::Linear(Context& ctx, const std::string& name, const LinearConfig& config, std::uint32_t seed)
    : label_(layer_label("Linear", name)), config_(config) {
  SG_CHECK(config.in_features > 0 && config.out_features > 0, "Linear '", name,
           "': in_features and out_features must be > 0, got ", config.in_features, " and ", config.out_features);
  const float scale = 1.0f / std::sqrt(static_cast<float>(config.in_features));
  const Shape shape{config.out_features, config.in_features};
  weight_ = make_parameter(ctx, name + ".weight", shape, config.dtype, ParameterInit::uniform(scale, seed));
  if (config.bias) {
    bias_ = make_parameter(ctx, name + ".bias", Shape{config.out_features}, config.dtype,
                           ParameterInit::uniform(scale, seed + 1));
  }
}

std::vector<Parameter*> Linear::parameters() {
  std::vector<Parameter*> out{&weight_};
  if (config_.bias) out.push_back(&bias_);
  return out;
}

Linear::Forward Linear::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", config_.in_features}, config_.dtype);
  ops::GemmParams params{.trans_b = true,
                         .epilogue = config_.bias ? GemmEpilogue::kBias : GemmEpilogue::kNone,
                         .out_dtype = config_.dtype};
  Forward out;
  out.y = ops::gemm(ctx, args.x, weight_.value, params, config_.bias ? bias_.value : Tensor()).d;
  out.saved = Saved{args.x, config_.dgrad, config_.wgrad};
  return out;
}

Tensor Linear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.x", saved.x, {"tokens", config_.in_features}, config_.dtype,
              "the forward's input");
  check_input(label_, "backward", "dy", args.dy, {saved.x.shape().dim(0), config_.out_features}, config_.dtype,
              "the forward's output");
  if (saved.wgrad) {
    // grad_W[out, in] = dy^T x, with grad_b = sum over tokens of dy fused
    // (BGRADB), on the weight-gradient stream.
    WeightGradScope weight_grads(ctx);
    ops::GemmParams wgrad{.trans_a = true,
                          .epilogue = config_.bias ? GemmEpilogue::kBiasGradOfA : GemmEpilogue::kNone,
                          .out_dtype = DType::kFloat32};
    const Tensor bias_grad = ops::gemm_into_(ctx, weight_.grad, args.dy, saved.x, wgrad);
    if (config_.bias) ops::copy_(ctx, bias_.grad, bias_grad);
  }
  if (!saved.dgrad) return {};
  // dx[tokens, in] = dy W
  return ops::gemm(ctx, args.dy, weight_.value, {.out_dtype = config_.dtype}).d;
}

}  // namespace stepgraph
