#include "ops/optimizer_ops.h"

#include <cstdio>

#include "engine/error.h"
#include "kernels/step_guard.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

bool AdamWParams::operator==(const AdamWParams& other) const {
  // A device rate makes hyper.lr unused: it must not split graph keys.
  const bool same_lr = device_lr || hyper.lr == other.hyper.lr;
  return same_lr && hyper.beta1 == other.hyper.beta1 && hyper.beta2 == other.hyper.beta2 &&
         hyper.eps == other.hyper.eps && hyper.weight_decay == other.hyper.weight_decay && has_copy == other.has_copy &&
         total_numel == other.total_numel && advance_step == other.advance_step && device_lr == other.device_lr &&
         unscale_grads == other.unscale_grads && table_from_operands == other.table_from_operands;
}

std::string AdamWParams::to_string() const {
  char lr[32] = "lr read on the device";
  if (!device_lr) std::snprintf(lr, sizeof(lr), "lr=%g", static_cast<double>(hyper.lr));
  char text[240];
  std::snprintf(text, sizeof(text), "%s, betas=(%g, %g), eps=%g, wd=%g, %zu tensors%s%s%s", lr,
                static_cast<double>(hyper.beta1), static_cast<double>(hyper.beta2), static_cast<double>(hyper.eps),
                static_cast<double>(hyper.weight_decay), has_copy.size(), advance_step ? "" : ", step not advanced",
                unscale_grads ? ", gradients unscaled" : "", table_from_operands ? ", table from operands" : "");
  return text;
}

namespace {

constexpr std::string_view kAdamW = "adamw";

std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const AdamWParams& p = params.as<AdamWParams>();
  const AdamWOperands<TensorMeta> o = bind_metas<AdamWOperands>(kAdamW, p, inputs);
  SG_CHECK(o.step == (TensorMeta{Shape{1}, DType::kInt64}), "op adamw: the step counter must be int64 [1]");
  SG_CHECK(!p.device_lr || o.lr == (TensorMeta{Shape{1}, DType::kFloat32}),
           "op adamw: the learning rate must be fp32 [1]");
  SG_CHECK(!p.unscale_grads || o.loss_scale == (TensorMeta{Shape{kernels::kLossScaleStateSize}, DType::kFloat32}),
           "op adamw: the loss-scale state must be fp32 [", kernels::kLossScaleStateSize, "]");
  std::int64_t total = 0;
  for (const AdamWParamOperands<TensorMeta>& param : o.params) {
    SG_CHECK(param.master.dtype == DType::kFloat32, "op adamw: master weights are fp32, got ",
             dtype_name(param.master.dtype));
    SG_CHECK(param.grad == param.master && param.m == param.master && param.v == param.master,
             "op adamw: grad, m and v must match their master ", param.master.shape, " fp32");
    total += param.master.numel();
  }
  SG_CHECK(total == p.total_numel, "op adamw: parameters hold ", total, " elements, the params say ", p.total_numel);
  return {};
}

std::vector<kernels::AdamWTensor> tensors_of(const AdamWOperands<Operand>& o) {
  std::vector<kernels::AdamWTensor> out;
  for (const AdamWParamOperands<Operand>& param : o.params) {
    out.push_back({param.master.as<float>(), param.grad.as<const float>(), param.m.as<float>(), param.v.as<float>(),
                   param.copy.data, param.master.numel(),
                   param.copy.present() && param.copy.dtype() == DType::kFloat16});
  }
  return out;
}

// The device rate, or null for hyper.lr.
const float* rate_of(const AdamWOperands<Operand>& o) { return o.lr.as<const float>(); }

// 1/S of the loss-scale state, or null.
const float* unscale_of(const AdamWOperands<Operand>& o) {
  return o.loss_scale.present() ? o.loss_scale.as<const float>() + 1 : nullptr;
}

}  // namespace

const OpDef& adamw_op() {
  static const OpDef op{
      .name = "adamw",
      .check = check,
      .mutated_inputs_for = written_inputs_of<AdamWOperands, AdamWParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const AdamWParams& p = params.as<AdamWParams>();
            const AdamWOperands<Operand> o = bind_args<AdamWOperands>(p, a);
            if (p.table_from_operands) kernels::write_adamw_table_entries(tensors_of(o), o.table.data, stream);
            kernels::launch_adamw(p.hyper, o.table.data, static_cast<std::int64_t>(o.params.size()), p.total_numel,
                                  o.step.as<std::int64_t>(), stream, p.advance_step, rate_of(o), unscale_of(o));
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const AdamWParams& p = params.as<AdamWParams>();
            const AdamWOperands<Operand> o = bind_args<AdamWOperands>(p, a);
            kernels::host::adamw(p.hyper, tensors_of(o), o.step.as<std::int64_t>(), p.advance_step, rate_of(o),
                                 unscale_of(o));
          },
  };
  return op;
}
SG_REGISTER_OP(adamw_op);

void adamw_step(Context& ctx, const AdamWParams& params, AdamWOperands<Tensor> operands) {
  ctx.call(adamw_op(), params, flatten(kAdamW, params, std::move(operands)));
}

namespace {

template <typename F>
struct LrScheduleOperands {
  F step;  // int64 [1]: the updates done
  F lr;    // fp32 [1]: the rate it writes
};

template <typename F, typename V>
void visit_operands(const kernels::LrSchedule&, LrScheduleOperands<F>& o, V& v) {
  v({"step"}, o.step);
  v({.name = "lr", .use = Use::kWrite}, o.lr);
}

constexpr std::string_view kLrSchedule = "lr_schedule_";

}  // namespace

const OpDef& lr_schedule_op() {
  static const OpDef op{
      .name = kLrSchedule,
      .check = [](const OpParams& params, std::span<const TensorMeta> inputs) {
        const auto& schedule = params.as<kernels::LrSchedule>();
        kernels::check_lr_schedule(schedule);
        const auto o = bind_metas<LrScheduleOperands>(kLrSchedule, schedule, inputs);
        SG_CHECK(o.step == (TensorMeta{Shape{1}, DType::kInt64}) && o.lr == (TensorMeta{Shape{1}, DType::kFloat32}),
                 "op lr_schedule_ takes the step counter (int64 [1]) and the rate it writes (fp32 [1])");
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs_for = written_inputs_of<LrScheduleOperands, kernels::LrSchedule>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& schedule = params.as<kernels::LrSchedule>();
            const auto o = bind_args<LrScheduleOperands>(schedule, a);
            kernels::launch_lr_schedule(schedule, o.step.as<const std::int64_t>(), o.lr.as<float>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& schedule = params.as<kernels::LrSchedule>();
            const auto o = bind_args<LrScheduleOperands>(schedule, a);
            *o.lr.as<float>() = kernels::lr_at(schedule, *o.step.as<const std::int64_t>() + 1);
          },
  };
  return op;
}
SG_REGISTER_OP(lr_schedule_op);

void lr_schedule_(Context& ctx, const kernels::LrSchedule& schedule, const Tensor& step, const Tensor& lr) {
  ctx.call(lr_schedule_op(), schedule, flatten(kLrSchedule, schedule, LrScheduleOperands<Tensor>{step, lr}));
}

}  // namespace stepgraph::ops
