#include "ops/optimizer_ops.h"

#include <cstdio>

#include "engine/error.h"
#include "kernels/step_guard.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

bool AdamWParams::operator==(const AdamWParams& other) const {
  return hyper.lr == other.hyper.lr && hyper.beta1 == other.hyper.beta1 && hyper.beta2 == other.hyper.beta2 &&
         hyper.eps == other.hyper.eps && hyper.weight_decay == other.hyper.weight_decay && has_copy == other.has_copy &&
         total_numel == other.total_numel && advance_step == other.advance_step && device_lr == other.device_lr &&
         unscale_grads == other.unscale_grads && table_from_operands == other.table_from_operands;
}

std::string AdamWParams::to_string() const {
  char text[240];
  std::snprintf(text, sizeof(text), "lr=%g%s, betas=(%g, %g), eps=%g, wd=%g, %zu tensors%s%s%s",
                static_cast<double>(hyper.lr), device_lr ? " (read on the device)" : "",
                static_cast<double>(hyper.beta1), static_cast<double>(hyper.beta2), static_cast<double>(hyper.eps),
                static_cast<double>(hyper.weight_decay), has_copy.size(), advance_step ? "" : ", step not advanced",
                unscale_grads ? ", gradients unscaled" : "", table_from_operands ? ", table from operands" : "");
  return text;
}

namespace {

constexpr std::size_t kTable = 0;
constexpr std::size_t kStep = 1;
constexpr std::size_t kFirstTensor = 2;

// Per parameter, the index of its master among the inputs.
std::vector<std::size_t> master_indices(const AdamWParams& p) {
  std::vector<std::size_t> out;
  std::size_t next = kFirstTensor;
  for (bool copy : p.has_copy) {
    out.push_back(next);
    next += copy ? 5 : 4;
  }
  return out;
}

std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const AdamWParams& p = params.as<AdamWParams>();
  std::size_t expected = kFirstTensor + (p.device_lr ? 1 : 0) + (p.unscale_grads ? 1 : 0);
  for (bool copy : p.has_copy) expected += copy ? 5 : 4;
  SG_CHECK(inputs.size() == expected, "op adamw: ", p.has_copy.size(), " parameters", p.device_lr ? ", the rate" : "",
           p.unscale_grads ? ", the loss scale" : "", " need ", expected, " inputs, got ", inputs.size());
  SG_CHECK(!p.device_lr || inputs[expected - 1 - (p.unscale_grads ? 1 : 0)] == (TensorMeta{Shape{1}, DType::kFloat32}),
           "op adamw: the learning rate (after the parameters) must be fp32 [1]");
  SG_CHECK(!p.unscale_grads ||
               inputs.back() == (TensorMeta{Shape{kernels::kLossScaleStateSize}, DType::kFloat32}),
           "op adamw: the loss-scale state (the last input) must be fp32 [", kernels::kLossScaleStateSize, "]");
  SG_CHECK(inputs[kStep] == (TensorMeta{Shape{1}, DType::kInt64}), "op adamw: the step counter must be int64 [1]");
  std::int64_t total = 0;
  for (std::size_t m : master_indices(p)) {
    const TensorMeta& master = inputs[m];
    SG_CHECK(master.dtype == DType::kFloat32, "op adamw: master weights are fp32, got ", dtype_name(master.dtype));
    for (std::size_t i = 1; i < 4; ++i) {
      SG_CHECK(inputs[m + i] == master, "op adamw: grad, m and v must match their master ", master.shape, " fp32");
    }
    total += master.numel();
  }
  SG_CHECK(total == p.total_numel, "op adamw: parameters hold ", total, " elements, the params say ", p.total_numel);
  return {};
}

std::vector<int> written(const OpParams& params, std::size_t) {
  const AdamWParams& p = params.as<AdamWParams>();
  std::vector<int> out;
  if (p.table_from_operands) out.push_back(static_cast<int>(kTable));
  if (p.advance_step) out.push_back(static_cast<int>(kStep));
  const std::vector<std::size_t> masters = master_indices(p);
  for (std::size_t t = 0; t < masters.size(); ++t) {
    const int m = static_cast<int>(masters[t]);
    out.insert(out.end(), {m, m + 2, m + 3});
    if (p.has_copy[t]) out.push_back(m + 4);
  }
  return out;
}

std::vector<kernels::AdamWTensor> tensors_of(const AdamWParams& p, const KernelArgs& a) {
  std::vector<kernels::AdamWTensor> out;
  const std::vector<std::size_t> masters = master_indices(p);
  for (std::size_t t = 0; t < masters.size(); ++t) {
    const std::size_t m = masters[t];
    out.push_back({static_cast<float*>(a.inputs[m]), static_cast<const float*>(a.inputs[m + 1]),
                   static_cast<float*>(a.inputs[m + 2]), static_cast<float*>(a.inputs[m + 3]),
                   p.has_copy[t] ? a.inputs[m + 4] : nullptr, a.input_metas[m].numel(),
                   p.has_copy[t] && a.input_metas[m + 4].dtype == DType::kFloat16});
  }
  return out;
}

// The device rate (after the parameters), or null for hyper.lr.
const float* rate_of(const AdamWParams& p, const KernelArgs& a) {
  return p.device_lr ? static_cast<const float*>(a.inputs[a.inputs.size() - 1 - (p.unscale_grads ? 1 : 0)]) : nullptr;
}

// 1/S of the loss-scale state (the last input), or null.
const float* unscale_of(const AdamWParams& p, const KernelArgs& a) {
  return p.unscale_grads ? static_cast<const float*>(a.inputs.back()) + 1 : nullptr;
}

}  // namespace

const OpDef& adamw_op() {
  static const OpDef op{
      .name = "adamw",
      .check = check,
      .mutated_inputs_for = written,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const AdamWParams& p = params.as<AdamWParams>();
            if (p.table_from_operands) kernels::write_adamw_table_entries(tensors_of(p, a), a.inputs[kTable], stream);
            kernels::launch_adamw(p.hyper, a.inputs[kTable], static_cast<std::int64_t>(p.has_copy.size()),
                                  p.total_numel, static_cast<std::int64_t*>(a.inputs[kStep]), stream, p.advance_step,
                                  rate_of(p, a), unscale_of(p, a));
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const AdamWParams& p = params.as<AdamWParams>();
            kernels::host::adamw(p.hyper, tensors_of(p, a), static_cast<std::int64_t*>(a.inputs[kStep]),
                                 p.advance_step, rate_of(p, a), unscale_of(p, a));
          },
  };
  return op;
}
SG_REGISTER_OP(adamw_op);

void adamw_step(Context& ctx, const AdamWParams& params, const Tensor& table, const Tensor& step,
                const std::vector<Tensor>& tensors, const Tensor& lr, const Tensor& loss_scale) {
  SG_CHECK(params.device_lr == lr.defined(), "adamw_step: params.device_lr is ", params.device_lr,
           " but the rate tensor is ", lr.defined() ? "given" : "missing");
  SG_CHECK(params.unscale_grads == loss_scale.defined(), "adamw_step: params.unscale_grads is ", params.unscale_grads,
           " but the loss-scale state is ", loss_scale.defined() ? "given" : "missing");
  std::vector<Tensor> inputs{table, step};
  inputs.insert(inputs.end(), tensors.begin(), tensors.end());
  if (lr.defined()) inputs.push_back(lr);
  if (loss_scale.defined()) inputs.push_back(loss_scale);
  ctx.call(adamw_op(), params, std::move(inputs));
}

const OpDef& lr_schedule_op() {
  static const OpDef op{
      .name = "lr_schedule_",
      .check = [](const OpParams& params, std::span<const TensorMeta> inputs) {
        kernels::check_lr_schedule(params.as<kernels::LrSchedule>());
        SG_CHECK(inputs.size() == 2 && inputs[0] == (TensorMeta{Shape{1}, DType::kInt64}) &&
                     inputs[1] == (TensorMeta{Shape{1}, DType::kFloat32}),
                 "op lr_schedule_ takes the step counter (int64 [1]) and the rate it writes (fp32 [1])");
        return std::vector<TensorMeta>{};
      },
      .mutated_inputs = {1},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_lr_schedule(params.as<kernels::LrSchedule>(),
                                        static_cast<const std::int64_t*>(a.inputs[0]), static_cast<float*>(a.inputs[1]),
                                        stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            *static_cast<float*>(a.inputs[1]) =
                kernels::lr_at(params.as<kernels::LrSchedule>(), *static_cast<const std::int64_t*>(a.inputs[0]) + 1);
          },
  };
  return op;
}
SG_REGISTER_OP(lr_schedule_op);

void lr_schedule_(Context& ctx, const kernels::LrSchedule& schedule, const Tensor& step, const Tensor& lr) {
  ctx.call(lr_schedule_op(), schedule, {step, lr});
}

}  // namespace stepgraph::ops
