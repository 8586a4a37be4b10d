#include "ops/norm_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

using kernels::NormKind;

std::string NormParams::to_string() const {
  char text[64];
  std::snprintf(text, sizeof(text), "%s, eps=%g%s", kind == NormKind::kLayerNorm ? "layernorm" : "rmsnorm",
                static_cast<double>(eps), dx_residual ? ", dx + residual" : "");
  return text;
}

namespace {

bool layernorm(const NormParams& p) { return p.kind == NormKind::kLayerNorm; }

kernels::NormDesc describe(const NormParams& p, const TensorMeta& x) {
  kernels::NormDesc desc;
  desc.kind = p.kind;
  desc.dtype = x.dtype;
  desc.hidden = x.shape.rank() == 0 ? 1 : x.shape.dim(-1);
  desc.rows = desc.hidden == 0 ? 0 : x.numel() / desc.hidden;
  desc.eps = p.eps;
  return desc;
}

void expect(std::string_view op, std::string_view role, const TensorMeta& got, const TensorMeta& want) {
  SG_CHECK(got == want, "op ", op, ": ", role, " must be ", want.shape, " ", dtype_name(want.dtype), ", got ",
           got.shape, " ", dtype_name(got.dtype));
}

std::vector<TensorMeta> check_forward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const NormParams& p = params.as<NormParams>();
  const std::size_t arity = layernorm(p) ? 3 : 2;
  SG_CHECK(inputs.size() == arity, "op norm_forward (", p.to_string(), ") takes ", arity, " inputs, got ",
           inputs.size());
  SG_CHECK(inputs[0].shape.rank() >= 1, "op norm_forward: x must have at least one dimension");
  const kernels::NormDesc desc = describe(p, inputs[0]);
  kernels::check_norm(desc);
  const TensorMeta param{Shape{desc.hidden}, inputs[0].dtype};
  expect("norm_forward", "gamma", inputs[1], param);
  if (layernorm(p)) expect("norm_forward", "beta", inputs[2], param);
  const TensorMeta stat{Shape{desc.rows}, DType::kFloat32};
  std::vector<TensorMeta> out{inputs[0]};
  if (layernorm(p)) out.push_back(stat);
  out.push_back(stat);
  return out;
}

// Backward inputs: dy, x, [mean], rstd, gamma.
// The inputs of both backward ops before the parameter gradients: dy, x, [mean], rstd, gamma.
std::size_t backward_arity(const NormParams& p) { return layernorm(p) ? 5 : 4; }

// norm_backward outputs dgamma (and dbeta); norm_backward_into_ takes them as
// inputs after gamma and writes them in place (a layer's gradients, without
// a copy).
std::vector<TensorMeta> check_backward_of(std::string_view op, const OpParams& params,
                                          std::span<const TensorMeta> inputs, bool into) {
  const NormParams& p = params.as<NormParams>();
  const std::size_t grads = into ? (layernorm(p) ? 2 : 1) : 0;
  SG_CHECK(into || !p.dx_residual, "op ", op, ": dx_residual is for norm_backward_into_");
  const std::size_t arity = backward_arity(p) + grads + (p.dx_residual ? 1 : 0);
  SG_CHECK(inputs.size() == arity, "op ", op, " (", p.to_string(), ") takes ", arity, " inputs, got ", inputs.size());
  const kernels::NormDesc desc = describe(p, inputs[1]);
  kernels::check_norm(desc);
  expect(op, "dy", inputs[0], inputs[1]);
  const TensorMeta stat{Shape{desc.rows}, DType::kFloat32};
  std::size_t next = 2;
  if (layernorm(p)) expect(op, "mean", inputs[next++], stat);
  expect(op, "rstd", inputs[next++], stat);
  expect(op, "gamma", inputs[next++], {Shape{desc.hidden}, inputs[1].dtype});
  const TensorMeta grad{Shape{desc.hidden}, DType::kFloat32};
  if (into) {
    expect(op, "dgamma", inputs[next++], grad);
    if (layernorm(p)) expect(op, "dbeta", inputs[next++], grad);
    if (p.dx_residual) expect(op, "dx_residual", inputs[next], inputs[1]);
  }
  std::vector<TensorMeta> out{inputs[1]};
  if (!into) {
    out.push_back(grad);
    if (layernorm(p)) out.push_back(grad);
  }
  const auto scratch = static_cast<std::int64_t>((kernels::norm_backward_workspace_bytes(desc) + 3) / 4);
  out.push_back({Shape{scratch}, DType::kFloat32});
  return out;
}

std::vector<TensorMeta> check_backward(const OpParams& params, std::span<const TensorMeta> inputs) {
  return check_backward_of("norm_backward", params, inputs, false);
}

std::vector<TensorMeta> check_backward_into(const OpParams& params, std::span<const TensorMeta> inputs) {
  return check_backward_of("norm_backward_into_", params, inputs, true);
}

std::vector<int> written_gradients(const OpParams& params, std::size_t) {
  const NormParams& p = params.as<NormParams>();
  const int first = static_cast<int>(backward_arity(p));
  return layernorm(p) ? std::vector<int>{first, first + 1} : std::vector<int>{first};
}

struct ForwardPointers {
  const void* x;
  const void* gamma;
  const void* beta = nullptr;
  void* y;
  float* mean = nullptr;
  float* rstd;
};

ForwardPointers forward_pointers(const NormParams& p, const KernelArgs& a) {
  ForwardPointers f{a.inputs[0], a.inputs[1]};
  if (layernorm(p)) f.beta = a.inputs[2];
  f.y = a.outputs[0];
  std::size_t next = 1;
  if (layernorm(p)) f.mean = static_cast<float*>(a.outputs[next++]);
  f.rstd = static_cast<float*>(a.outputs[next]);
  return f;
}

struct BackwardPointers {
  const void* dy;
  const void* x;
  const float* mean = nullptr;
  const float* rstd;
  const void* gamma;
  void* dx;
  float* dgamma;
  float* dbeta = nullptr;
  void* workspace;
  const void* dx_residual = nullptr;
};

BackwardPointers backward_pointers(const NormParams& p, const KernelArgs& a, bool into) {
  BackwardPointers b{};
  b.dy = a.inputs[0];
  b.x = a.inputs[1];
  std::size_t next = 2;
  if (layernorm(p)) b.mean = static_cast<const float*>(a.inputs[next++]);
  b.rstd = static_cast<const float*>(a.inputs[next++]);
  b.gamma = a.inputs[next++];
  b.dx = a.outputs[0];
  if (into) {  // the parameter gradients follow gamma among the inputs
    b.dgamma = static_cast<float*>(a.inputs[next++]);
    if (layernorm(p)) b.dbeta = static_cast<float*>(a.inputs[next++]);
    if (p.dx_residual) b.dx_residual = a.inputs[next];
    b.workspace = a.outputs[1];
    return b;
  }
  b.dgamma = static_cast<float*>(a.outputs[1]);
  next = 2;
  if (layernorm(p)) b.dbeta = static_cast<float*>(a.outputs[next++]);
  b.workspace = a.outputs[next];
  return b;
}

void launch_backward(const OpParams& params, const KernelArgs& a, CUstream_st* stream, bool into) {
  const NormParams& p = params.as<NormParams>();
  const BackwardPointers b = backward_pointers(p, a, into);
  kernels::launch_norm_backward(describe(p, a.input_metas[1]), b.dy, b.x, b.mean, b.rstd, b.gamma, b.dx, b.dgamma,
                                b.dbeta, b.workspace, stream, {}, b.dx_residual);
}

void run_backward_host(const OpParams& params, const KernelArgs& a, bool into) {
  const NormParams& p = params.as<NormParams>();
  const BackwardPointers b = backward_pointers(p, a, into);
  kernels::host::norm_backward(describe(p, a.input_metas[1]), b.dy, b.x, b.mean, b.rstd, b.gamma, b.dx, b.dgamma,
                               b.dbeta, b.dx_residual);
}

}  // namespace

const OpDef& norm_forward_op() {
  static const OpDef op{
      .name = "norm_forward",
      .check = check_forward,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const NormParams& p = params.as<NormParams>();
            const ForwardPointers f = forward_pointers(p, a);
            kernels::launch_norm_forward(describe(p, a.input_metas[0]), f.x, f.gamma, f.beta, f.y, f.mean, f.rstd,
                                         stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const NormParams& p = params.as<NormParams>();
            const ForwardPointers f = forward_pointers(p, a);
            kernels::host::norm_forward(describe(p, a.input_metas[0]), f.x, f.gamma, f.beta, f.y, f.mean, f.rstd);
          },
  };
  return op;
}
SG_REGISTER_OP(norm_forward_op);

const OpDef& norm_backward_op() {
  static const OpDef op{
      .name = "norm_backward",
      .check = check_backward,
      .launch_cuda = [](const OpParams& params, const KernelArgs& a,
                        CUstream_st* stream) { launch_backward(params, a, stream, false); },
      .run_host = [](const OpParams& params, const KernelArgs& a) { run_backward_host(params, a, false); },
  };
  return op;
}
SG_REGISTER_OP(norm_backward_op);

const OpDef& norm_backward_into_op() {
  static const OpDef op{
      .name = "norm_backward_into_",
      .check = check_backward_into,
      .mutated_inputs_for = written_gradients,
      .launch_cuda = [](const OpParams& params, const KernelArgs& a,
                        CUstream_st* stream) { launch_backward(params, a, stream, true); },
      .run_host = [](const OpParams& params, const KernelArgs& a) { run_backward_host(params, a, true); },
  };
  return op;
}
SG_REGISTER_OP(norm_backward_into_op);

NormForward norm_forward(Context& ctx, const NormParams& params, const Tensor& x, const Tensor& gamma,
                         const Tensor& beta) {
  std::vector<Tensor> inputs{x, gamma};
  if (layernorm(params)) inputs.push_back(beta);
  std::vector<Tensor> out = ctx.call(norm_forward_op(), params, std::move(inputs));
  NormForward result;
  result.y = out[0];
  std::size_t next = 1;
  if (layernorm(params)) result.mean = out[next++];
  result.rstd = out[next];
  return result;
}

NormBackward norm_backward(Context& ctx, const NormParams& params, const Tensor& dy, const Tensor& x,
                           const Tensor& mean, const Tensor& rstd, const Tensor& gamma) {
  std::vector<Tensor> inputs{dy, x};
  if (layernorm(params)) inputs.push_back(mean);
  inputs.push_back(rstd);
  inputs.push_back(gamma);
  std::vector<Tensor> out = ctx.call(norm_backward_op(), params, std::move(inputs));
  NormBackward result;
  result.dx = out[0];
  result.dgamma = out[1];
  if (layernorm(params)) result.dbeta = out[2];
  return result;
}

Tensor norm_backward_into_(Context& ctx, const NormParams& params, const Tensor& dy, const Tensor& x, const Tensor& mean,
                          const Tensor& rstd, const Tensor& gamma, const Tensor& dgamma, const Tensor& dbeta,
                          const Tensor& dx_residual) {
  NormParams p = params;
  p.dx_residual = dx_residual.defined();
  std::vector<Tensor> inputs{dy, x};
  if (layernorm(p)) inputs.push_back(mean);
  inputs.push_back(rstd);
  inputs.push_back(gamma);
  inputs.push_back(dgamma);
  if (layernorm(p)) inputs.push_back(dbeta);
  if (p.dx_residual) inputs.push_back(dx_residual);
  return ctx.call(norm_backward_into_op(), p, std::move(inputs)).at(0);
}

}  // namespace stepgraph::ops
