#include "ops/step_guard_ops.h"

#include "engine/error.h"
#include "kernels/adamw.h"
#include "kernels/step_guard.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

const TensorMeta kFlag{Shape{1}, DType::kInt32};

void check_flag(std::string_view op, const TensorMeta& flag) {
  SG_CHECK(flag == kFlag, "op ", op, ": the flag must be int32 [1], got ", flag.shape, " ", dtype_name(flag.dtype));
}

const TensorMeta kLossScaleState{Shape{kernels::kLossScaleStateSize}, DType::kFloat32};

void check_state(std::string_view op, const TensorMeta& state) {
  SG_CHECK(state == kLossScaleState, "op ", op, ": the loss scale state must be fp32 [", kernels::kLossScaleStateSize,
           "], got ", state.shape, " ", dtype_name(state.dtype));
}

// flag_nonfinite_: flag = 1 where x is not finite.
template <typename F>
struct FlagOperands {
  F flag;  // int32 [1], written
  F x;     // fp32
};

template <typename F, typename V>
void visit_operands(const NoParams&, FlagOperands<F>& o, V& v) {
  v({.name = "flag", .use = Use::kWrite}, o.flag);
  v({"x"}, o.x);
}

template <typename F>
struct FlagGradsOperands {
  F flag;                // int32 [1], written
  F table;               // the AdamW launch table, int64 words
  std::vector<F> grads;  // fp32, in the table's order
};

template <typename F, typename V>
void visit_operands(const FlagGradsParams&, FlagGradsOperands<F>& o, V& v) {
  v({.name = "flag", .use = Use::kWrite}, o.flag);
  v({"table"}, o.table);
  v.list("grads", o.grads, kRestOfInputs);
  for (std::size_t i = 0; i < o.grads.size(); ++i)
    v({.name = "grads", .index = static_cast<std::int64_t>(i)}, o.grads[i]);
}

template <typename F>
struct CountFlagOperands {
  F count;  // int64 [1], written
  F flag;   // int32 [1], cleared
};

template <typename F, typename V>
void visit_operands(const NoParams&, CountFlagOperands<F>& o, V& v) {
  v({.name = "count", .use = Use::kWrite}, o.count);
  v({.name = "flag", .use = Use::kWrite}, o.flag);
}

template <typename F>
struct LossScaleUpdateOperands {
  F state;  // fp32 [kLossScaleStateSize], written
  F flag;   // int32 [1]
};

template <typename F, typename V>
void visit_operands(const LossScaleParams&, LossScaleUpdateOperands<F>& o, V& v) {
  v({.name = "state", .use = Use::kWrite}, o.state);
  v({"flag"}, o.flag);
}

template <typename F>
struct ScaleByLossScaleOperands {
  F x;      // fp32, bf16 or fp16, written
  F state;  // fp32 [kLossScaleStateSize]
};

template <typename F, typename V>
void visit_operands(const NoParams&, ScaleByLossScaleOperands<F>& o, V& v) {
  v({.name = "x", .use = Use::kWrite}, o.x);
  v({"state"}, o.state);
}

constexpr std::string_view kFlagNonfinite = "flag_nonfinite_";
constexpr std::string_view kFlagGrads = "adamw_flag_nonfinite_grads_";
constexpr std::string_view kCountAndClear = "count_and_clear_flag_";
constexpr std::string_view kLossScaleUpdate = "loss_scale_update_";
constexpr std::string_view kScaleByLossScale = "scale_by_loss_scale_";

// The gradients' pointers and sizes as AdamW tensors (only grad is read).
std::vector<kernels::AdamWTensor> grads_of(const FlagGradsOperands<Operand>& o) {
  std::vector<kernels::AdamWTensor> out;
  for (const Operand& grad : o.grads) out.push_back({.grad = grad.as<const float>(), .numel = grad.numel()});
  return out;
}

}  // namespace

std::string FlagGradsParams::to_string() const { return std::to_string(total_numel) + " elements"; }

const OpDef& flag_nonfinite_op() {
  static const OpDef op{
      .name = kFlagNonfinite,
      .check =
          [](const OpParams&, std::span<const TensorMeta> inputs) {
            const auto o = bind_metas<FlagOperands>(kFlagNonfinite, NoParams{}, inputs);
            check_flag(kFlagNonfinite, o.flag);
            SG_CHECK(o.x.dtype == DType::kFloat32, "op flag_nonfinite_: checks fp32 values, got ",
                     dtype_name(o.x.dtype));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<FlagOperands, NoParams>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            const auto o = bind_args<FlagOperands>(NoParams{}, a);
            kernels::launch_flag_nonfinite(o.x.as<const float>(), o.x.numel(), o.flag.as<std::int32_t>(), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<FlagOperands>(NoParams{}, a);
            kernels::host::flag_nonfinite(o.x.as<const float>(), o.x.numel(), o.flag.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(flag_nonfinite_op);

const OpDef& adamw_flag_nonfinite_grads_op() {
  static const OpDef op{
      .name = kFlagGrads,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> inputs) {
            const auto& p = params.as<FlagGradsParams>();
            const auto o = bind_metas<FlagGradsOperands>(kFlagGrads, p, inputs);
            check_flag(kFlagGrads, o.flag);
            SG_CHECK(o.table.dtype == DType::kInt64, "op adamw_flag_nonfinite_grads_: the table is int64 words");
            std::int64_t total = 0;
            for (const TensorMeta& grad : o.grads) {
              SG_CHECK(grad.dtype == DType::kFloat32, "op adamw_flag_nonfinite_grads_: gradients are fp32, got ",
                       dtype_name(grad.dtype));
              total += grad.numel();
            }
            SG_CHECK(total == p.total_numel, "op adamw_flag_nonfinite_grads_: the gradients hold ", total,
                     " elements, the params say ", p.total_numel);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<FlagGradsOperands, FlagGradsParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<FlagGradsParams>();
            const auto o = bind_args<FlagGradsOperands>(p, a);
            kernels::launch_adamw_flag_nonfinite_grads(o.table.data, static_cast<std::int64_t>(o.grads.size()),
                                                       p.total_numel, o.flag.as<std::int32_t>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto o = bind_args<FlagGradsOperands>(params.as<FlagGradsParams>(), a);
            kernels::host::adamw_flag_nonfinite_grads(grads_of(o), o.flag.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(adamw_flag_nonfinite_grads_op);

const OpDef& count_and_clear_flag_op() {
  static const OpDef op{
      .name = kCountAndClear,
      .check =
          [](const OpParams&, std::span<const TensorMeta> inputs) {
            const auto o = bind_metas<CountFlagOperands>(kCountAndClear, NoParams{}, inputs);
            SG_CHECK(o.count == (TensorMeta{Shape{1}, DType::kInt64}),
                     "op count_and_clear_flag_ takes the count (int64 [1]) and the flag");
            check_flag(kCountAndClear, o.flag);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<CountFlagOperands, NoParams>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            const auto o = bind_args<CountFlagOperands>(NoParams{}, a);
            kernels::launch_count_and_clear_flag(o.flag.as<std::int32_t>(), o.count.as<std::int64_t>(), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<CountFlagOperands>(NoParams{}, a);
            kernels::host::count_and_clear_flag(o.flag.as<std::int32_t>(), o.count.as<std::int64_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(count_and_clear_flag_op);

std::string LossScaleParams::to_string() const {
  return "initial " + std::to_string(scaling.initial_scale) + ", x" + std::to_string(scaling.growth_factor) +
         " every " + std::to_string(scaling.growth_interval) + " good steps, x" +
         std::to_string(scaling.backoff_factor) + " on overflow, in [" + std::to_string(scaling.min_scale) + ", " +
         std::to_string(scaling.max_scale) + "]";
}

const OpDef& loss_scale_update_op() {
  static const OpDef op{
      .name = kLossScaleUpdate,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> inputs) {
            const auto& p = params.as<LossScaleParams>();
            const auto o = bind_metas<LossScaleUpdateOperands>(kLossScaleUpdate, p, inputs);
            check_state(kLossScaleUpdate, o.state);
            check_flag(kLossScaleUpdate, o.flag);
            kernels::check_loss_scaling(p.scaling);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<LossScaleUpdateOperands, LossScaleParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<LossScaleParams>();
            const auto o = bind_args<LossScaleUpdateOperands>(p, a);
            kernels::launch_loss_scale_update(p.scaling, o.state.as<float>(), o.flag.as<const std::int32_t>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<LossScaleParams>();
            const auto o = bind_args<LossScaleUpdateOperands>(p, a);
            kernels::host::loss_scale_update(p.scaling, o.state.as<float>(), o.flag.as<const std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(loss_scale_update_op);

const OpDef& scale_by_loss_scale_op() {
  static const OpDef op{
      .name = kScaleByLossScale,
      .check =
          [](const OpParams&, std::span<const TensorMeta> inputs) {
            const auto o = bind_metas<ScaleByLossScaleOperands>(kScaleByLossScale, NoParams{}, inputs);
            const DType dtype = o.x.dtype;
            SG_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                     "op scale_by_loss_scale_: fp32, bf16 or fp16 values, got ", dtype_name(dtype));
            check_state(kScaleByLossScale, o.state);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<ScaleByLossScaleOperands, NoParams>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            const auto o = bind_args<ScaleByLossScaleOperands>(NoParams{}, a);
            kernels::launch_scale_by_loss_scale(o.x.dtype(), o.x.data, o.x.numel(), o.state.as<const float>(), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<ScaleByLossScaleOperands>(NoParams{}, a);
            kernels::host::scale_by_loss_scale(o.x.dtype(), o.x.data, o.x.numel(), o.state.as<const float>());
          },
  };
  return op;
}
SG_REGISTER_OP(scale_by_loss_scale_op);

void loss_scale_update_(Context& ctx, const kernels::LossScaling& scaling, const Tensor& state, const Tensor& flag) {
  const LossScaleParams params{scaling};
  ctx.call(loss_scale_update_op(), params,
           flatten(kLossScaleUpdate, params, LossScaleUpdateOperands<Tensor>{.state = state, .flag = flag}));
}

void scale_by_loss_scale_(Context& ctx, const Tensor& x, const Tensor& state) {
  ctx.call(scale_by_loss_scale_op(), NoParams{},
           flatten(kScaleByLossScale, NoParams{}, ScaleByLossScaleOperands<Tensor>{.x = x, .state = state}));
}

void flag_nonfinite_(Context& ctx, const Tensor& flag, const Tensor& x) {
  ctx.call(flag_nonfinite_op(), NoParams{},
           flatten(kFlagNonfinite, NoParams{}, FlagOperands<Tensor>{.flag = flag, .x = x}));
}

void adamw_flag_nonfinite_grads_(Context& ctx, const Tensor& flag, const Tensor& table,
                                 const std::vector<Tensor>& grads) {
  FlagGradsParams params;
  for (const Tensor& grad : grads) params.total_numel += grad.numel();
  ctx.call(adamw_flag_nonfinite_grads_op(), params,
           flatten(kFlagGrads, params, FlagGradsOperands<Tensor>{.flag = flag, .table = table, .grads = grads}));
}

void count_and_clear_flag_(Context& ctx, const Tensor& skipped, const Tensor& flag) {
  ctx.call(count_and_clear_flag_op(), NoParams{},
           flatten(kCountAndClear, NoParams{}, CountFlagOperands<Tensor>{.count = skipped, .flag = flag}));
}

}  // namespace stepgraph::ops
