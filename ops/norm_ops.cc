#include "ops/norm_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

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

// --- operands -------------------------------------------------------------------

template <typename F>
struct ForwardInputs {
  F x;      // [..., hidden]
  F gamma;  // [hidden], x's dtype
  F beta;   // [hidden]: LayerNorm only
};

template <typename F, typename V>
void visit_operands(const NormParams& p, ForwardInputs<F>& o, V& v) {
  v({"x"}, o.x);
  v({"gamma"}, o.gamma);
  v({.name = "beta", .present = layernorm(p)}, o.beta);
}

template <typename F>
struct ForwardOutputs {
  F y;
  F mean;  // fp32 [rows]: LayerNorm only
  F rstd;  // fp32 [rows]
};

template <typename F, typename V>
void visit_operands(const NormParams& p, ForwardOutputs<F>& o, V& v) {
  v({"y"}, o.y);
  v({.name = "mean", .present = layernorm(p)}, o.mean);
  v({"rstd"}, o.rstd);
}

// norm_backward outputs dgamma (and dbeta); norm_backward_into_ takes them as
// inputs after gamma and writes them in place (a layer's gradients, without
// a copy).
struct BackwardCall {
  NormParams p;
  bool into = false;
};

template <typename F>
struct BackwardInputs {
  F dy, x;
  F mean;  // LayerNorm only
  F rstd;
  F gamma;
  F dgamma;       // norm_backward_into_: fp32 [hidden], written
  F dbeta;        // norm_backward_into_ and LayerNorm: fp32 [hidden], written
  F dx_residual;  // norm_backward_into_ with params.dx_residual: x's shape and dtype
};

template <typename F, typename V>
void visit_operands(const BackwardCall& c, BackwardInputs<F>& o, V& v) {
  v({"dy"}, o.dy);
  v({"x"}, o.x);
  v({.name = "mean", .present = layernorm(c.p)}, o.mean);
  v({"rstd"}, o.rstd);
  v({"gamma"}, o.gamma);
  v({.name = "dgamma", .use = Use::kWrite, .present = c.into}, o.dgamma);
  v({.name = "dbeta", .use = Use::kWrite, .present = c.into && layernorm(c.p)}, o.dbeta);
  v({.name = "dx_residual", .present = c.into && c.p.dx_residual}, o.dx_residual);
}

template <typename F>
struct BackwardOutputs {
  F dx;
  F dgamma;     // norm_backward: fp32 [hidden]
  F dbeta;      // norm_backward and LayerNorm: fp32 [hidden]
  F workspace;  // fp32: the reduction's scratch
};

template <typename F, typename V>
void visit_operands(const BackwardCall& c, BackwardOutputs<F>& o, V& v) {
  v({"dx"}, o.dx);
  v({.name = "dgamma", .present = !c.into}, o.dgamma);
  v({.name = "dbeta", .present = !c.into && layernorm(c.p)}, o.dbeta);
  v({"workspace"}, o.workspace);
}

constexpr std::string_view kForward = "norm_forward";
constexpr std::string_view kBackward = "norm_backward";
constexpr std::string_view kBackwardInto = "norm_backward_into_";

std::string_view backward_name(bool into) { return into ? kBackwardInto : kBackward; }

// --- checks and launches ----------------------------------------------------------

std::vector<TensorMeta> check_forward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const NormParams& p = params.as<NormParams>();
  const auto o = bind_metas<ForwardInputs>(kForward, p, inputs);
  SG_CHECK(o.x.shape.rank() >= 1, "op norm_forward: x must have at least one dimension");
  const kernels::NormDesc desc = describe(p, o.x);
  kernels::check_norm(desc);
  const TensorMeta param{Shape{desc.hidden}, o.x.dtype};
  expect(kForward, "gamma", o.gamma, param);
  if (layernorm(p)) expect(kForward, "beta", o.beta, param);
  const TensorMeta stat{Shape{desc.rows}, DType::kFloat32};
  return output_metas(p, ForwardOutputs<TensorMeta>{.y = o.x, .mean = stat, .rstd = stat});
}

std::vector<TensorMeta> check_backward_of(const BackwardCall& c, std::span<const TensorMeta> inputs) {
  const NormParams& p = c.p;
  const std::string_view op = backward_name(c.into);
  SG_CHECK(c.into || !p.dx_residual, "op ", op, ": dx_residual is for norm_backward_into_");
  const auto o = bind_metas<BackwardInputs>(op, c, inputs);
  const kernels::NormDesc desc = describe(p, o.x);
  kernels::check_norm(desc);
  expect(op, "dy", o.dy, o.x);
  const TensorMeta stat{Shape{desc.rows}, DType::kFloat32};
  if (layernorm(p)) expect(op, "mean", o.mean, stat);
  expect(op, "rstd", o.rstd, stat);
  expect(op, "gamma", o.gamma, {Shape{desc.hidden}, o.x.dtype});
  const TensorMeta grad{Shape{desc.hidden}, DType::kFloat32};
  if (c.into) {
    expect(op, "dgamma", o.dgamma, grad);
    if (layernorm(p)) expect(op, "dbeta", o.dbeta, grad);
    if (p.dx_residual) expect(op, "dx_residual", o.dx_residual, o.x);
  }
  const auto scratch = static_cast<std::int64_t>((kernels::norm_backward_workspace_bytes(desc) + 3) / 4);
  return output_metas(c, BackwardOutputs<TensorMeta>{
                             .dx = o.x, .dgamma = grad, .dbeta = grad, .workspace = {Shape{scratch}, DType::kFloat32}});
}

std::vector<TensorMeta> check_backward(const OpParams& params, std::span<const TensorMeta> inputs) {
  return check_backward_of({params.as<NormParams>(), false}, inputs);
}

std::vector<TensorMeta> check_backward_into(const OpParams& params, std::span<const TensorMeta> inputs) {
  return check_backward_of({params.as<NormParams>(), true}, inputs);
}

std::vector<int> written_gradients(const OpParams& params, std::size_t input_count) {
  return operand_layout<BackwardInputs>(BackwardCall{params.as<NormParams>(), true}, input_count).written;
}

struct BackwardPointers {
  const void* dy;
  const void* x;
  const float* mean;
  const float* rstd;
  const void* gamma;
  void* dx;
  float* dgamma;
  float* dbeta;
  void* workspace;
  const void* dx_residual;
};

BackwardPointers backward_pointers(const BackwardCall& c, const BackwardInputs<Operand>& in,
                                   const BackwardOutputs<Operand>& out) {
  const Operand& dgamma = c.into ? in.dgamma : out.dgamma;
  const Operand& dbeta = c.into ? in.dbeta : out.dbeta;
  return {in.dy.data,  in.x.data,          in.mean.as<const float>(), in.rstd.as<const float>(), in.gamma.data,
          out.dx.data, dgamma.as<float>(), dbeta.as<float>(),         out.workspace.data,        in.dx_residual.data};
}

void launch_backward(const OpParams& params, const KernelArgs& a, CUstream_st* stream, bool into) {
  const BackwardCall c{params.as<NormParams>(), into};
  const auto in = bind_args<BackwardInputs>(c, a);
  const BackwardPointers b = backward_pointers(c, in, bind_outputs<BackwardOutputs>(c, a));
  kernels::launch_norm_backward(describe(c.p, *in.x.meta), b.dy, b.x, b.mean, b.rstd, b.gamma, b.dx, b.dgamma, b.dbeta,
                                b.workspace, stream, {}, b.dx_residual);
}

void run_backward_host(const OpParams& params, const KernelArgs& a, bool into) {
  const BackwardCall c{params.as<NormParams>(), into};
  const auto in = bind_args<BackwardInputs>(c, a);
  const BackwardPointers b = backward_pointers(c, in, bind_outputs<BackwardOutputs>(c, a));
  kernels::host::norm_backward(describe(c.p, *in.x.meta), b.dy, b.x, b.mean, b.rstd, b.gamma, b.dx, b.dgamma, b.dbeta,
                               b.dx_residual);
}

}  // namespace

const OpDef& norm_forward_op() {
  static const OpDef op{
      .name = kForward,
      .check = check_forward,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const NormParams& p = params.as<NormParams>();
            const auto in = bind_args<ForwardInputs>(p, a);
            const auto out = bind_outputs<ForwardOutputs>(p, a);
            kernels::launch_norm_forward(describe(p, *in.x.meta), in.x.data, in.gamma.data, in.beta.data, out.y.data,
                                         out.mean.as<float>(), out.rstd.as<float>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const NormParams& p = params.as<NormParams>();
            const auto in = bind_args<ForwardInputs>(p, a);
            const auto out = bind_outputs<ForwardOutputs>(p, a);
            kernels::host::norm_forward(describe(p, *in.x.meta), in.x.data, in.gamma.data, in.beta.data, out.y.data,
                                        out.mean.as<float>(), out.rstd.as<float>());
          },
  };
  return op;
}
SG_REGISTER_OP(norm_forward_op);

const OpDef& norm_backward_op() {
  static const OpDef op{
      .name = kBackward,
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
      .name = kBackwardInto,
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
  const ForwardInputs<Tensor> in{.x = x, .gamma = gamma, .beta = layernorm(params) ? beta : Tensor()};
  const auto out =
      bind_results<ForwardOutputs>(params, ctx.call(norm_forward_op(), params, flatten(kForward, params, in)));
  return {.y = out.y, .mean = out.mean, .rstd = out.rstd};
}

NormBackward norm_backward(Context& ctx, const NormParams& params, const Tensor& dy, const Tensor& x,
                           const Tensor& mean, const Tensor& rstd, const Tensor& gamma) {
  const BackwardCall c{params, false};
  const BackwardInputs<Tensor> in{
      .dy = dy, .x = x, .mean = layernorm(params) ? mean : Tensor(), .rstd = rstd, .gamma = gamma};
  const auto out = bind_results<BackwardOutputs>(c, ctx.call(norm_backward_op(), params, flatten(kBackward, c, in)));
  return {.dx = out.dx, .dgamma = out.dgamma, .dbeta = out.dbeta};
}

Tensor norm_backward_into_(Context& ctx, const NormParams& params, const Tensor& dy, const Tensor& x,
                           const Tensor& mean, const Tensor& rstd, const Tensor& gamma, const Tensor& dgamma,
                           const Tensor& dbeta, const Tensor& dx_residual) {
  BackwardCall c{params, true};
  c.p.dx_residual = dx_residual.defined();
  const bool ln = layernorm(c.p);
  const BackwardInputs<Tensor> in{.dy = dy,
                                  .x = x,
                                  .mean = ln ? mean : Tensor(),
                                  .rstd = rstd,
                                  .gamma = gamma,
                                  .dgamma = dgamma,
                                  .dbeta = ln ? dbeta : Tensor(),
                                  .dx_residual = dx_residual};
  return bind_results<BackwardOutputs>(c, ctx.call(norm_backward_into_op(), c.p, flatten(kBackwardInto, c, in))).dx;
}

}  // namespace stepgraph::ops
