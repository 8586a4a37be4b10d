#include "layers/linear.h"

#include <cmath>

#include "engine/error.h"
#include "layers/layer_checks.h"
#include "layers/weight_grad_scope.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"

namespace stepgraph {

using kernels::GemmEpilogue;

std::string_view tensor_parallel_mode_name(TensorParallelMode mode) {
  switch (mode) {
    case TensorParallelMode::kNone: return "none";
    case TensorParallelMode::kColumn: return "column";
    case TensorParallelMode::kRow: return "row";
  }
  return "unknown";
}

Linear::Linear(Context& ctx, const std::string& name, const LinearConfig& config, std::uint32_t seed,
               Communicator* tensor_parallel)
    : label_(layer_label("Linear", name)), config_(config), tp_(tensor_parallel) {
  SG_CHECK(config.in_features > 0 && config.out_features > 0, "Linear '", name,
           "': in_features and out_features must be > 0, got ", config.in_features, " and ", config.out_features);
  // See Note [Column- and row-parallel Linear].
  const bool split = config.tensor_parallel != TensorParallelMode::kNone;
  SG_CHECK(split || tp_ == nullptr, label_, ": got a tensor-parallel communicator (", tp_ ? tp_->describe() : "",
           ") but config.tensor_parallel is none; set it to kColumn or kRow, or pass no communicator");
  SG_CHECK(!split || tp_ != nullptr, label_, ": config.tensor_parallel is ",
           tensor_parallel_mode_name(config.tensor_parallel),
           " but no communicator was given; pass the tensor-parallel group's Communicator (a world of one for a "
           "single rank)");
  SG_CHECK(split || !config.sequence_parallel, label_,
           ": sequence_parallel needs a tensor-parallel layer; set config.tensor_parallel to kColumn or kRow");
  if (tp_ != nullptr) {
    tp_->check_device(ctx.device(), label_);
    const std::int64_t n = tp_->world_size();
    SG_CHECK(!column() || config.out_features % n == 0, label_, ": a column-parallel layer splits out_features ",
             config.out_features, " over the ", n, " ranks of ", tp_->describe(), "; make out_features a multiple of ",
             n);
    SG_CHECK(!row() || config.in_features % n == 0, label_, ": a row-parallel layer splits in_features ",
             config.in_features, " over the ", n, " ranks of ", tp_->describe(), "; make in_features a multiple of ",
             n);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(config.in_features));
  const std::int64_t in = local_in_features();
  const std::int64_t out = local_out_features();
  const std::int64_t rank = tp_ != nullptr ? tp_->rank() : 0;
  // This rank's slice of the weights one rank draws from `seed`; the plain
  // layer's whole draw without a communicator.
  ParameterInit w_init = ParameterInit::uniform(scale, seed);
  ParameterInit b_init = ParameterInit::uniform(scale, seed + 1);
  if (column()) {
    w_init = w_init.rows_from(config.out_features, config.in_features, rank * out);
    b_init = b_init.rows_from(config.out_features, 1, rank * out);
  } else if (row()) {
    w_init = w_init.columns_from(config.out_features, config.in_features, rank * in);
  }
  weight_ = make_parameter(ctx, name + ".weight", Shape{out, in}, config.dtype, w_init);
  if (config.bias) bias_ = make_parameter(ctx, name + ".bias", Shape{out}, config.dtype, b_init);
}

std::int64_t Linear::local_in_features() const { return config_.in_features / (row() ? ranks() : 1); }
std::int64_t Linear::local_out_features() const { return config_.out_features / (column() ? ranks() : 1); }

std::vector<Parameter*> Linear::parameters() {
  std::vector<Parameter*> out{&weight_};
  if (config_.bias) out.push_back(&bias_);
  return out;
}

Linear::Forward Linear::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "input", args.x, {"tokens", local_in_features()}, config_.dtype);
  if (row() && sequence_parallel()) {
    const std::int64_t tokens = args.x.shape().dim(0);
    SG_CHECK(tokens % ranks() == 0, label_, " forward: a sequence-parallel row-parallel layer reduce-scatters its ",
             tokens, " tokens over the ", ranks(), " ranks of ", tp_->describe(), "; give it a multiple of ", ranks(),
             " tokens");
  }
  // Column-parallel with SP: the GEMM takes every rank's tokens.
  const Tensor x = column() && sequence_parallel() ? ops::all_gather(ctx, *tp_, args.x) : args.x;
  // Row-parallel: the bias once in the sum of the ranks' partial products.
  const bool adds_bias = config_.bias && (!row() || tp_->rank() == 0);
  ops::GemmParams params{
      .trans_b = true, .epilogue = adds_bias ? GemmEpilogue::kBias : GemmEpilogue::kNone, .out_dtype = config_.dtype};
  Forward out;
  out.y = ops::gemm(ctx, x, weight_.value, params, adds_bias ? bias_.value : Tensor()).d;
  if (row()) {
    out.y = sequence_parallel() ? ops::reduce_scatter(ctx, *tp_, out.y, ReduceOp::kSum)
                                : ops::all_reduce(ctx, *tp_, out.y, ReduceOp::kSum);
  }
  out.saved = Saved{x, config_.dgrad, config_.wgrad};
  return out;
}

Tensor Linear::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "saved.x", saved.x, {"tokens", local_in_features()}, config_.dtype,
              "the forward's input");
  // The GEMM's tokens; a sequence-parallel row-parallel output holds 1/N of them.
  const std::int64_t tokens = saved.x.shape().dim(0);
  const bool gathers_dy = row() && sequence_parallel();
  check_input(label_, "backward", "dy", args.dy, {gathers_dy ? tokens / ranks() : tokens, local_out_features()},
              config_.dtype, "the forward's output");
  const Tensor dy = gathers_dy ? ops::all_gather(ctx, *tp_, args.dy) : args.dy;
  if (saved.wgrad) {
    // grad_W[out, in] = dy^T x, with grad_b = sum over tokens of dy fused
    // (BGRADB), on the weight-gradient stream.
    WeightGradScope weight_grads(ctx);
    ops::GemmParams wgrad{.trans_a = true,
                          .epilogue = config_.bias ? GemmEpilogue::kBiasGradOfA : GemmEpilogue::kNone,
                          .out_dtype = DType::kFloat32};
    const Tensor bias_grad = ops::gemm_into_(ctx, weight_.grad, dy, saved.x, wgrad);
    if (config_.bias) ops::copy_(ctx, bias_.grad, bias_grad);
  }
  if (!saved.dgrad) return {};
  // dx[tokens, in] = dy W
  Tensor dx = ops::gemm(ctx, dy, weight_.value, {.out_dtype = config_.dtype}).d;
  if (column()) {
    // Every rank's slice of out contributed to every input feature: sum them
    // (SP: and keep this rank's tokens).
    dx = sequence_parallel() ? ops::reduce_scatter(ctx, *tp_, dx, ReduceOp::kSum)
                             : ops::all_reduce(ctx, *tp_, dx, ReduceOp::kSum);
  }
  return dx;
}

}  // namespace stepgraph
