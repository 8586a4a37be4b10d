#include "layers/grouped_linear.h"

#include <cmath>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "layers/layer_checks.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/moe_ops.h"

namespace stepgraph {

GroupedLinear::GroupedLinear(Context& ctx, const std::string& name, const GroupedLinearConfig& config,
                             std::uint32_t seed, Communicator* tensor_parallel)
    : name_(name), config_(config) {
  SG_CHECK(config.experts >= 1 && config.experts <= kernels::kMaxExperts, "GroupedLinear '", name,
           "': experts must be in [1, ", kernels::kMaxExperts, "], got ", config.experts);
  SG_CHECK(config.in_features > 0 && config.out_features > 0, "GroupedLinear '", name,
           "': in_features and out_features must be > 0, got ", config.in_features, " and ", config.out_features);
  SG_CHECK_CODE(config.dtype == DType::kBFloat16 || config.dtype == DType::kFloat32, ErrorCode::kUnsupported,
                "GroupedLinear '", name, "': dtype ", dtype_name(config.dtype),
                " is not supported (the grouped GEMM takes bf16 or fp32)");
  if (tensor_parallel != nullptr) {
    SG_CHECK(config.parallel != GroupedParallel::kNone, "GroupedLinear '", name,
             "': a tensor-parallel communicator needs config.parallel = GroupedParallel::kColumn or kRow (which "
             "side of the weights to shard); pass no communicator for the whole layer");
    tensor_parallel->check_device(ctx.device(), layer_label("GroupedLinear", name));
    ranks_ = tensor_parallel->world_size();
    rank_ = tensor_parallel->rank();
    const bool column = config.parallel == GroupedParallel::kColumn;
    const std::int64_t sharded = column ? config.out_features : config.in_features;
    SG_CHECK(sharded % ranks_ == 0, "GroupedLinear '", name, "': ", column ? "out_features " : "in_features ",
             sharded, " must divide by the ", ranks_, " tensor-parallel ranks (", column ? "column" : "row",
             "-parallel); pick a size that is a multiple of the tensor-parallel world size");
  }
  const std::int64_t e = config.experts, in = config.in_features, out = config.out_features;
  const std::int64_t lin = local_in(), lout = local_out();
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
  }
  weight_ = make_parameter(ctx, name + ".weight", Shape{e, lout, lin}, config.dtype, weight_init);
  if (config.bias) {
    bias_ = make_parameter(ctx, name + ".bias", Shape{e, lout}, config.dtype, bias_init);
  }
  error_word_ = ctx.persistent(name + ".split_error", {Shape{1}, DType::kInt32});
}

std::int64_t GroupedLinear::local_in() const {
  return config_.parallel == GroupedParallel::kRow ? config_.in_features / ranks_ : config_.in_features;
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
  const std::string label = layer_label("GroupedLinear", name_);
  check_input(label, "forward", "input", args.x, {"tokens", local_in()}, config_.dtype);
  check_input(label, "forward", "splits", args.splits, {config_.experts}, DType::kInt32, "one size per expert");
  const TensorMeta& x = args.x.meta();
  Forward out;
  out.saved.x = args.x;
  out.saved.offsets = ops::split_offsets(ctx, args.splits, error_word_, x.shape.dim(0));
  out.saved.offsets.set_name(name_ + ".offsets");
  // A row-parallel bias goes into the ranks' sum once: rank 0 adds it.
  const bool adds_bias = config_.bias && (config_.parallel != GroupedParallel::kRow || rank_ == 0);
  out.y = ops::grouped_linear_forward(ctx, args.x, weight_.value, out.saved.offsets,
                                      adds_bias ? bias_.value : Tensor(), config_.dtype);
  return out;
}

Tensor GroupedLinear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  const std::string label = layer_label("GroupedLinear", name_);
  check_input(label, "backward", "saved.x", saved.x, {"tokens", local_in()}, config_.dtype,
              "the forward's input");
  check_input(label, "backward", "saved.offsets", saved.offsets, {config_.experts + 1}, DType::kInt32,
              "the forward's split offsets");
  check_input(label, "backward", "dy", args.dy, {saved.x.shape().dim(0), local_out()}, config_.dtype,
              "the forward's output");
  // A row-parallel bias gradient is the whole one on every rank: every rank
  // gets the same (whole) dy, whichever rank added the bias.
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
