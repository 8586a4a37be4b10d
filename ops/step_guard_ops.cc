#include "ops/step_guard_ops.h"

#include "engine/error.h"
#include "kernels/adamw.h"
#include "kernels/step_guard.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

const TensorMeta kFlag{Shape{1}, DType::kInt32};

void check_flag(std::string_view op, const TensorMeta& flag) {
  SG_CHECK(flag == kFlag, "op ", op, ": the flag (the first input) must be int32 [1], got ", flag.shape, " ",
           dtype_name(flag.dtype));
}

std::int32_t* flag_of(const KernelArgs& a) { return static_cast<std::int32_t*>(a.inputs[0]); }

const TensorMeta kLossScaleState{Shape{kernels::kLossScaleStateSize}, DType::kFloat32};

void check_state(std::string_view op, const TensorMeta& state) {
  SG_CHECK(state == kLossScaleState, "op ", op, ": the loss scale state must be fp32 [", kernels::kLossScaleStateSize,
           "], got ", state.shape, " ", dtype_name(state.dtype));
}

// The gradients' pointers and sizes as AdamW tensors (only grad is read).
std::vector<kernels::AdamWTensor> grads_of(const KernelArgs& a) {
  std::vector<kernels::AdamWTensor> out;
  for (std::size_t i = 2; i < a.inputs.size(); ++i) {
    out.push_back({.grad = static_cast<const float*>(a.inputs[i]), .numel = a.input_metas[i].numel()});
  }
  return out;
}

}  // namespace

std::string FlagGradsParams::to_string() const { return std::to_string(total_numel) + " elements"; }

const OpDef& flag_nonfinite_op() {
  static const OpDef op{
      .name = "flag_nonfinite_",
      .check = [](const OpParams&, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() == 2, "op flag_nonfinite_ takes the flag and one tensor, got ", inputs.size(),
                 " inputs");
        check_flag("flag_nonfinite_", inputs[0]);
        SG_CHECK(inputs[1].dtype == DType::kFloat32, "op flag_nonfinite_: checks fp32 values, got ",
                 dtype_name(inputs[1].dtype));
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_flag_nonfinite(static_cast<const float*>(a.inputs[1]), a.input_metas[1].numel(),
                                           flag_of(a), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::flag_nonfinite(static_cast<const float*>(a.inputs[1]), a.input_metas[1].numel(),
                                          flag_of(a));
          },
  };
  return op;
}
SG_REGISTER_OP(flag_nonfinite_op);

const OpDef& adamw_flag_nonfinite_grads_op() {
  static const OpDef op{
      .name = "adamw_flag_nonfinite_grads_",
      .check = [](const OpParams& params, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() >= 2, "op adamw_flag_nonfinite_grads_ takes the flag, the table and the gradients");
        check_flag("adamw_flag_nonfinite_grads_", inputs[0]);
        SG_CHECK(inputs[1].dtype == DType::kInt64, "op adamw_flag_nonfinite_grads_: the table is int64 words");
        std::int64_t total = 0;
        for (std::size_t i = 2; i < inputs.size(); ++i) {
          SG_CHECK(inputs[i].dtype == DType::kFloat32, "op adamw_flag_nonfinite_grads_: gradients are fp32, got ",
                   dtype_name(inputs[i].dtype));
          total += inputs[i].numel();
        }
        SG_CHECK(total == params.as<FlagGradsParams>().total_numel, "op adamw_flag_nonfinite_grads_: the gradients "
                 "hold ", total, " elements, the params say ", params.as<FlagGradsParams>().total_numel);
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_adamw_flag_nonfinite_grads(a.inputs[1], static_cast<std::int64_t>(a.inputs.size() - 2),
                                                       params.as<FlagGradsParams>().total_numel, flag_of(a), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::adamw_flag_nonfinite_grads(grads_of(a), flag_of(a));
          },
  };
  return op;
}
SG_REGISTER_OP(adamw_flag_nonfinite_grads_op);

const OpDef& count_and_clear_flag_op() {
  static const OpDef op{
      .name = "count_and_clear_flag_",
      .check = [](const OpParams&, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() == 2 && inputs[0] == (TensorMeta{Shape{1}, DType::kInt64}),
                 "op count_and_clear_flag_ takes the count (int64 [1]) and the flag");
        check_flag("count_and_clear_flag_", inputs[1]);
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {0, 1},
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_count_and_clear_flag(static_cast<std::int32_t*>(a.inputs[1]),
                                          static_cast<std::int64_t*>(a.inputs[0]), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::count_and_clear_flag(static_cast<std::int32_t*>(a.inputs[1]),
                                         static_cast<std::int64_t*>(a.inputs[0]));
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
      .name = "loss_scale_update_",
      .check = [](const OpParams& params, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() == 2, "op loss_scale_update_ takes the scale state and the flag, got ", inputs.size(),
                 " inputs");
        check_state("loss_scale_update_", inputs[0]);
        check_flag("loss_scale_update_", inputs[1]);
        kernels::check_loss_scaling(params.as<LossScaleParams>().scaling);
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_loss_scale_update(params.as<LossScaleParams>().scaling, static_cast<float*>(a.inputs[0]),
                                              static_cast<const std::int32_t*>(a.inputs[1]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::loss_scale_update(params.as<LossScaleParams>().scaling, static_cast<float*>(a.inputs[0]),
                                             static_cast<const std::int32_t*>(a.inputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(loss_scale_update_op);

const OpDef& scale_by_loss_scale_op() {
  static const OpDef op{
      .name = "scale_by_loss_scale_",
      .check = [](const OpParams&, std::span<const TensorMeta> inputs) {
        SG_CHECK(inputs.size() == 2, "op scale_by_loss_scale_ takes the values and the scale state, got ",
                 inputs.size(), " inputs");
        const DType dtype = inputs[0].dtype;
        SG_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                 "op scale_by_loss_scale_: fp32, bf16 or fp16 values, got ", dtype_name(dtype));
        check_state("scale_by_loss_scale_", inputs[1]);
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_scale_by_loss_scale(a.input_metas[0].dtype, a.inputs[0], a.input_metas[0].numel(),
                                                static_cast<const float*>(a.inputs[1]), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::scale_by_loss_scale(a.input_metas[0].dtype, a.inputs[0], a.input_metas[0].numel(),
                                               static_cast<const float*>(a.inputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(scale_by_loss_scale_op);

void loss_scale_update_(Context& ctx, const kernels::LossScaling& scaling, const Tensor& state, const Tensor& flag) {
  ctx.call(loss_scale_update_op(), LossScaleParams{scaling}, {state, flag});
}

void scale_by_loss_scale_(Context& ctx, const Tensor& x, const Tensor& state) {
  ctx.call(scale_by_loss_scale_op(), NoParams{}, {x, state});
}

void flag_nonfinite_(Context& ctx, const Tensor& flag, const Tensor& x) {
  ctx.call(flag_nonfinite_op(), NoParams{}, {flag, x});
}

void adamw_flag_nonfinite_grads_(Context& ctx, const Tensor& flag, const Tensor& table,
                                 const std::vector<Tensor>& grads) {
  std::vector<Tensor> inputs{flag, table};
  FlagGradsParams params;
  for (const Tensor& grad : grads) {
    inputs.push_back(grad);
    params.total_numel += grad.numel();
  }
  ctx.call(adamw_flag_nonfinite_grads_op(), params, std::move(inputs));
}

void count_and_clear_flag_(Context& ctx, const Tensor& skipped, const Tensor& flag) {
  ctx.call(count_and_clear_flag_op(), NoParams{}, {skipped, flag});
}

}  // namespace stepgraph::ops
