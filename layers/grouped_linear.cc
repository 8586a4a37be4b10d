#include "layers/grouped_linear.h"

#include <cmath>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "layers/layer_checks.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/moe_ops.h"

namespace stepgraph {

GroupedLinear::GroupedLinear(Context& ctx, const std::string& name, const GroupedLinearConfig& config,
                             std::uint32_t seed)
    : name_(name), config_(config) {
  SG_CHECK(config.experts >= 1 && config.experts <= kernels::kMaxExperts, "GroupedLinear '", name,
           "': experts must be in [1, ", kernels::kMaxExperts, "], got ", config.experts);
  SG_CHECK(config.in_features > 0 && config.out_features > 0, "GroupedLinear '", name,
           "': in_features and out_features must be > 0, got ", config.in_features, " and ", config.out_features);
  SG_CHECK_CODE(config.dtype == DType::kBFloat16 || config.dtype == DType::kFloat32, ErrorCode::kUnsupported,
                "GroupedLinear '", name, "': dtype ", dtype_name(config.dtype),
                " is not supported (the grouped GEMM takes bf16 or fp32)");
  const float scale = 1.0f / std::sqrt(static_cast<float>(config.in_features));
  const Shape shape{config.experts, config.out_features, config.in_features};
  weight_ = make_parameter(ctx, name + ".weight", shape, config.dtype, ParameterInit::uniform(scale, seed));
  if (config.bias) {
    const Shape bias{config.experts, config.out_features};
    bias_ = make_parameter(ctx, name + ".bias", bias, config.dtype, ParameterInit::uniform(scale, seed + 1));
  }
  error_word_ = ctx.persistent(name + ".split_error", {Shape{1}, DType::kInt32});
}

std::vector<Parameter*> GroupedLinear::parameters() {
  std::vector<Parameter*> out{&weight_};
  if (config_.bias) out.push_back(&bias_);
  return out;
}

GroupedLinear::Forward GroupedLinear::forward(Context& ctx, const FwdArgs& args) const {
  const std::string label = layer_label("GroupedLinear", name_);
  check_input(label, "forward", "input", args.x, {"tokens", config_.in_features}, config_.dtype);
  check_input(label, "forward", "splits", args.splits, {config_.experts}, DType::kInt32, "one size per expert");
  const TensorMeta& x = args.x.meta();
  Forward out;
  out.saved.x = args.x;
  out.saved.offsets = ops::split_offsets(ctx, args.splits, error_word_, x.shape.dim(0));
  out.saved.offsets.set_name(name_ + ".offsets");
  out.y = ops::grouped_linear_forward(ctx, args.x, weight_.value, out.saved.offsets,
                                      config_.bias ? bias_.value : Tensor(), config_.dtype);
  return out;
}

Tensor GroupedLinear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const std::string label = layer_label("GroupedLinear", name_);
  check_input(label, "backward", "saved.x", saved.x, {"tokens", config_.in_features}, config_.dtype,
              "the forward's input");
  check_input(label, "backward", "saved.offsets", saved.offsets, {config_.experts + 1}, DType::kInt32,
              "the forward's split offsets");
  check_input(label, "backward", "dy", args.dy, {saved.x.shape().dim(0), config_.out_features}, config_.dtype,
              "the forward's output");
  ops::grouped_linear_wgrad_(ctx, weight_.grad, args.dy, saved.x, saved.offsets, /*accumulate=*/false);
  if (config_.bias) ops::grouped_bias_grad_(ctx, bias_.grad, args.dy, saved.offsets, /*accumulate=*/false);
  return ops::grouped_linear_dgrad(ctx, args.dy, weight_.value, saved.offsets, config_.dtype);
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
  add(kernels::kSplitSumMismatch, "the split sizes did not add up to the token count");
  add(kernels::kExpertOutOfRange, "an expert index was outside [0, experts)");
  SG_THROW(ErrorCode::kInvalidArgument, what, ": bad routing in a step since the last check: ", problems,
           " (error word ", bits,
           "); the step clamped them to stay in bounds, so its results are wrong. "
           "Check the split sizes passed to the layer.");
}

}  // namespace stepgraph
