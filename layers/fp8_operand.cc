#include "layers/fp8_operand.h"

#include "engine/error.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/fp8_ops.h"

namespace stepgraph::detail {

DelayedState make_delayed_state(Context& ctx, const std::string& prefix, const Fp8Recipe& recipe,
                                std::vector<StateTensor>& named) {
  const std::int64_t length = recipe.amax_history_len;
  DelayedState s{ctx.persistent(prefix + ".amax_history", {Shape{length}, DType::kFloat32}),
                 ctx.persistent(prefix + ".scale", {Shape{1}, DType::kFloat32}),
                 ctx.persistent(prefix + ".scale_inv", {Shape{1}, DType::kFloat32})};
  named.push_back({prefix + ".amax_history", s.history});
  named.push_back({prefix + ".scale", s.scale});
  named.push_back({prefix + ".scale_inv", s.scale_inv});
  const std::vector<float> zeros(static_cast<std::size_t>(length), 0.0f);
  const float one = 1.0f;
  ctx.copy_from_host(s.history, zeros.data(), zeros.size() * sizeof(float));
  ctx.copy_from_host(s.scale, &one, sizeof(one));
  ctx.copy_from_host(s.scale_inv, &one, sizeof(one));
  return s;
}

Fp8Copies quantize_for_gemm(Context& ctx, const Fp8Recipe& recipe, const Tensor& t, Fp8Format format, bool rowwise,
                            bool columnwise, const DelayedState& delayed, kernels::BlockShape shape,
                            Communicator* amax_group) {
  if (recipe.scaling == Fp8Scaling::kBlock) {
    const ops::BlockQuantized q =
        ops::quantize_blocks(ctx, t, {format, shape, recipe.power_of_two_scales, rowwise, columnwise});
    return {q.rowwise, q.rowwise_scale_inv, q.columnwise, q.columnwise_scale_inv, Tensor(), Tensor(), shape,
            q.non_finite};
  }
  Tensor scale = delayed.scale, scale_inv = delayed.scale_inv, non_finite;
  if (recipe.scaling == Fp8Scaling::kCurrent) {
    Tensor amax = ops::amax(ctx, t);
    if (amax_group != nullptr) amax = ops::all_reduce(ctx, *amax_group, amax, ReduceOp::kMax);
    const ops::Scales s = ops::scale_from_amax(ctx, amax, {format, false});
    scale = s.scale;
    scale_inv = s.scale_inv;
    non_finite = s.non_finite;
  }
  const ops::Quantized q = ops::quantize(ctx, t, scale, {format, rowwise, columnwise});
  return {q.rowwise, scale_inv, q.columnwise, scale_inv, q.amax, scale, std::nullopt, non_finite};
}

Fp8WeightCache make_weight_cache(Context& ctx, const std::string& prefix, const Tensor& weight,
                                 const Fp8Recipe& recipe) {
  const Shape& shape = weight.shape();
  const std::int64_t cols = shape.dim(shape.rank() - 1);
  const std::int64_t rows = shape.numel() / cols;
  const DType q = fp8_dtype(recipe.forward_format());
  return {ctx.persistent(prefix + ".rowwise", {Shape{rows, cols}, q}),
          ctx.persistent(prefix + ".columnwise", {Shape{cols, rows}, q}),
          ctx.persistent(prefix + ".scale_inv", {Shape{1}, DType::kFloat32}),
          ctx.persistent(prefix + ".amax", {Shape{1}, DType::kFloat32})};
}

void refresh_weight_cache(Context& ctx, const Fp8Recipe& recipe, const Tensor& weight, const DelayedState& delayed,
                          Communicator* amax_group, const Fp8WeightCache& cache, const Tensor& non_finite_counter) {
  const ops::QuantizeParams both{recipe.forward_format(), true, true};
  if (recipe.scaling == Fp8Scaling::kDelayed) {
    ops::quantize_into_(ctx, weight, delayed.scale, both, cache.rowwise, cache.columnwise, cache.amax);
    ops::copy_(ctx, cache.scale_inv, delayed.scale_inv);
    return;
  }
  Tensor amax = ops::amax(ctx, weight);
  if (amax_group != nullptr) amax = ops::all_reduce(ctx, *amax_group, amax, ReduceOp::kMax);
  const ops::Scales s = ops::scale_from_amax(ctx, amax, {recipe.forward_format(), false});
  ops::quantize_into_(ctx, weight, s.scale, both, cache.rowwise, cache.columnwise, cache.amax);
  ops::copy_(ctx, cache.scale_inv, s.scale_inv);
  ops::count_flags_(ctx, non_finite_counter, {s.non_finite});
}

Fp8Copies cached_copies(const Fp8WeightCache& cache) {
  return {.rowwise = cache.rowwise,
          .rowwise_scale_inv = cache.scale_inv,
          .columnwise = cache.columnwise,
          .columnwise_scale_inv = cache.scale_inv,
          .amax = cache.amax};
}

std::function<void(Context&)> weight_cache_hook(const Fp8Recipe& recipe, const Tensor& weight,
                                                const DelayedState& delayed, Communicator* amax_group,
                                                const Fp8WeightCache& cache, const Tensor& non_finite_counter) {
  return [recipe, weight, delayed, amax_group, cache, non_finite_counter](Context& ctx) {
    refresh_weight_cache(ctx, recipe, weight, delayed, amax_group, cache, non_finite_counter);
  };
}

Tensor make_non_finite_counter(Context& ctx, const std::string& name) {
  const Tensor counter = ctx.persistent(name, {Shape{1}, DType::kInt32});
  const std::int32_t zero = 0;
  ctx.copy_from_host(counter, &zero, sizeof(zero));
  return counter;
}

std::int64_t read_non_finite_counter(Context& ctx, const Tensor& counter) {
  return counter.defined() ? ctx.to_vector<std::int32_t>(counter).at(0) : 0;
}

void check_non_finite_counter(std::string_view label, const Tensor& counter) {
  SG_CHECK(counter.shape() == Shape{1} && counter.dtype() == DType::kInt32, label,
           ": the non-finite counter must be [1] int32, got ", counter.shape(), " ", dtype_name(counter.dtype()));
}

void update_delayed_scaling(Context& ctx, const Fp8Recipe& recipe, std::initializer_list<AmaxUpdate> updates,
                            Communicator* tensor_parallel, Communicator* amax_group,
                            const Tensor& non_finite_counter) {
  std::vector<Tensor> flags;
  for (const AmaxUpdate& u : updates) {
    Tensor amax = u.amax;
    if (u.sliced && tensor_parallel != nullptr) amax = ops::all_reduce(ctx, *tensor_parallel, amax, ReduceOp::kMax);
    if (u.data_parallel && amax_group != nullptr) amax = ops::all_reduce(ctx, *amax_group, amax, ReduceOp::kMax);
    flags.push_back(ops::delayed_scaling_update_(ctx, {recipe, u.format}, amax, u.state.history, u.state.scale,
                                                 u.state.scale_inv));
  }
  ops::count_flags_(ctx, non_finite_counter, flags);
}

std::vector<Tensor> defined(std::initializer_list<Tensor> flags) {
  std::vector<Tensor> out;
  for (const Tensor& flag : flags) {
    if (flag.defined()) out.push_back(flag);
  }
  return out;
}

}  // namespace stepgraph::detail
