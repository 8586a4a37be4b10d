#include "ops/gemm_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/gemm_host.h"

namespace stepgraph::ops {

using kernels::GemmEpilogue;

std::string GemmParams::to_string() const {
  char text[160];
  std::snprintf(text, sizeof(text), "%s%s%s, out=%s, alpha=%g", trans_a ? "A^T " : "", trans_b ? "B^T " : "",
                kernels::gemm_epilogue_name(epilogue).c_str(), std::string(dtype_name(out_dtype)).c_str(),
                static_cast<double>(alpha));
  return text;
}

namespace {

// Input positions: a, b, then bias or aux (by epilogue), then d (gemm_into_).
struct Layout {
  int bias = -1;
  int aux = -1;
  int d = -1;
  std::size_t inputs = 2;
};

Layout input_layout(const GemmParams& p, bool into) {
  Layout layout;
  if (kernels::epilogue_reads_bias(p.epilogue)) layout.bias = static_cast<int>(layout.inputs++);
  if (kernels::epilogue_reads_aux(p.epilogue)) layout.aux = static_cast<int>(layout.inputs++);
  if (into) layout.d = static_cast<int>(layout.inputs++);
  return layout;
}

kernels::GemmDesc describe(const GemmParams& p, std::span<const TensorMeta> inputs) {
  const TensorMeta& a = inputs[0];
  const TensorMeta& b = inputs[1];
  kernels::GemmDesc desc;
  desc.trans_a = p.trans_a;
  desc.trans_b = p.trans_b;
  desc.m = p.trans_a ? a.shape.dim(1) : a.shape.dim(0);
  desc.k = p.trans_a ? a.shape.dim(0) : a.shape.dim(1);
  desc.n = p.trans_b ? b.shape.dim(0) : b.shape.dim(1);
  desc.a_type = a.dtype;
  desc.b_type = b.dtype;
  desc.d_type = p.out_dtype;
  desc.epilogue = p.epilogue;
  desc.alpha = p.alpha;
  desc.beta = 0.0f;  // D is written, never read
  return desc;
}

void expect_meta(std::string_view role, const TensorMeta& got, const TensorMeta& want, std::string_view op) {
  SG_CHECK(got == want, "op ", op, ": ", role, " must be ", want.shape, " ", dtype_name(want.dtype), ", got ",
           got.shape, " ", dtype_name(got.dtype));
}

std::vector<TensorMeta> check(const GemmParams& p, std::span<const TensorMeta> inputs, bool into) {
  const std::string_view op = into ? "gemm_into_" : "gemm";
  const Layout layout = input_layout(p, into);
  SG_CHECK(inputs.size() == layout.inputs, "op ", op, " with epilogue ", kernels::gemm_epilogue_name(p.epilogue),
           " takes ", layout.inputs, " inputs, got ", inputs.size());
  SG_CHECK(inputs[0].shape.rank() == 2 && inputs[1].shape.rank() == 2, "op ", op, " needs 2-D operands, got A ",
           inputs[0].shape, " and B ", inputs[1].shape);
  const std::int64_t k_of_b = p.trans_b ? inputs[1].shape.dim(1) : inputs[1].shape.dim(0);
  const kernels::GemmDesc desc = describe(p, inputs);
  SG_CHECK(desc.k == k_of_b, "op ", op, ": inner dimensions differ: opA(A) is ", desc.m, "x", desc.k, " but opB(B) is ",
           k_of_b, "x", desc.n, " (A ", inputs[0].shape, p.trans_a ? " transposed" : "", ", B ", inputs[1].shape,
           p.trans_b ? " transposed" : "", ")");
  kernels::check_gemm(desc);
  const TensorMeta d_meta{Shape{desc.m, desc.n}, p.out_dtype};
  if (layout.bias >= 0) expect_meta("bias", inputs[layout.bias], {Shape{desc.n}, p.out_dtype}, op);
  if (layout.aux >= 0) expect_meta("aux (the forward pre-activation)", inputs[layout.aux], d_meta, op);
  if (layout.d >= 0) expect_meta("D", inputs[layout.d], d_meta, op);

  std::vector<TensorMeta> outputs;
  if (!into) outputs.push_back(d_meta);
  if (kernels::epilogue_writes_aux(p.epilogue)) outputs.push_back(d_meta);
  if (kernels::epilogue_writes_bias_grad(p.epilogue)) {
    const std::int64_t length = p.epilogue == GemmEpilogue::kBiasGradOfA ? desc.m : desc.n;
    outputs.push_back({Shape{length}, p.out_dtype});
  }
  outputs.push_back({Shape{static_cast<std::int64_t>(kernels::gemm_workspace_bytes() / 4)}, DType::kFloat32});
  return outputs;
}

kernels::GemmOperands operands(const GemmParams& p, const KernelArgs& args, bool into) {
  const Layout layout = input_layout(p, into);
  kernels::GemmOperands o;
  o.a = args.inputs[0];
  o.b = args.inputs[1];
  if (layout.bias >= 0) o.bias = args.inputs[layout.bias];
  if (layout.aux >= 0) o.aux = args.inputs[layout.aux];
  std::size_t next = 0;
  o.d = into ? args.inputs[layout.d] : args.outputs[next++];
  if (kernels::epilogue_writes_aux(p.epilogue)) o.aux = args.outputs[next++];
  if (kernels::epilogue_writes_bias_grad(p.epilogue)) o.bias_grad = args.outputs[next++];
  o.workspace = args.outputs[next];
  return o;
}

template <bool kInto>
std::vector<TensorMeta> check_op(const OpParams& params, std::span<const TensorMeta> inputs) {
  return check(params.as<GemmParams>(), inputs, kInto);
}

template <bool kInto>
void launch_cuda(const OpParams& params, const KernelArgs& args, CUstream_st* stream) {
  const GemmParams& p = params.as<GemmParams>();
  kernels::launch_gemm(describe(p, args.input_metas), operands(p, args, kInto), stream);
}

template <bool kInto>
void run_host(const OpParams& params, const KernelArgs& args) {
  const GemmParams& p = params.as<GemmParams>();
  kernels::host::gemm(describe(p, args.input_metas), operands(p, args, kInto));
}

void prepare_cuda(const OpParams& params, std::span<const TensorMeta> inputs) {
  kernels::gemm_prepare(describe(params.as<GemmParams>(), inputs));
}

std::vector<int> written_input(const OpParams& params, std::size_t) {
  return {input_layout(params.as<GemmParams>(), true).d};
}

}  // namespace

const OpDef& gemm_op() {
  static const OpDef op{
      .name = "gemm",
      .check = check_op<false>,
      .launch_cuda = launch_cuda<false>,
      .run_host = run_host<false>,
      .prepare_cuda = prepare_cuda,
  };
  return op;
}

const OpDef& gemm_into_op() {
  static const OpDef op{
      .name = "gemm_into_",
      .check = check_op<true>,
      .mutated_inputs_for = written_input,
      .launch_cuda = launch_cuda<true>,
      .run_host = run_host<true>,
      .prepare_cuda = prepare_cuda,
  };
  return op;
}

GemmResult gemm(Context& ctx, const Tensor& a, const Tensor& b, const GemmParams& params, const Tensor& bias,
                const Tensor& aux) {
  std::vector<Tensor> inputs{a, b};
  if (kernels::epilogue_reads_bias(params.epilogue)) inputs.push_back(bias);
  if (kernels::epilogue_reads_aux(params.epilogue)) inputs.push_back(aux);
  std::vector<Tensor> outputs = ctx.call(gemm_op(), params, std::move(inputs));
  GemmResult result;
  std::size_t next = 0;
  result.d = outputs[next++];
  if (kernels::epilogue_writes_aux(params.epilogue)) result.aux = outputs[next++];
  if (kernels::epilogue_writes_bias_grad(params.epilogue)) result.bias_grad = outputs[next++];
  return result;
}

Tensor gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& b, const GemmParams& params) {
  SG_CHECK(params.epilogue == GemmEpilogue::kNone || params.epilogue == GemmEpilogue::kBiasGradOfA,
           "op gemm_into_: epilogue must be none or bias_grad_of_a, got ",
           kernels::gemm_epilogue_name(params.epilogue));
  std::vector<Tensor> outputs = ctx.call(gemm_into_op(), params, {a, b, d});
  return params.epilogue == GemmEpilogue::kBiasGradOfA ? outputs[0] : Tensor();
}

}  // namespace stepgraph::ops
