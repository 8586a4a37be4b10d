#include "ops/gemm_ops.h"

#include <cstdio>
#include <type_traits>
#include <vector>

#include "engine/error.h"
#include "kernels/gemm_host.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

using kernels::GemmEpilogue;

std::string GemmParams::to_string() const {
  char text[224];
  int length = std::snprintf(text, sizeof(text), "%s%s%s, out=%s, alpha=%g", trans_a ? "A^T " : "",
                             trans_b ? "B^T " : "", kernels::gemm_epilogue_name(epilogue).c_str(),
                             std::string(dtype_name(out_dtype)).c_str(), static_cast<double>(alpha));
  if (fp8_scales) length += std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length), "%s",
                                         fast_accumulation ? ", fp8 fast accumulation" : ", fp8");
  auto blocks_name = [](const std::optional<kernels::BlockShape>& blocks) {
    return !blocks ? "tensor" : *blocks == kernels::BlockShape::k1x128 ? "1x128" : "128x128";
  };
  if (a_blocks || b_blocks) {
    length += std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length), " blocks %s x %s",
                            blocks_name(a_blocks), blocks_name(b_blocks));
  }
  if (bias_grad_into) {
    length += std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length), ", bias grad in place");
  }
  if (algorithm == AlgorithmChoice::kTimed) {
    length += std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length), ", timed algorithm");
  }
  if (rows > 0 || a_row > 0 || d_row > 0) {
    length += std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length),
                            ", rows=%lld a_row=%lld d_row=%lld", static_cast<long long>(rows),
                            static_cast<long long>(a_row), static_cast<long long>(d_row));
  }
  if (workspace_bytes > 0) {
    std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length), ", workspace=%lld",
                  static_cast<long long>(workspace_bytes));
  }
  return text;
}

namespace {

// Input positions: a, b, then bias, aux (read by the epilogue, or written by
// it through gemm_into_), then the FP8 scale_inv of a and b, then d (gemm_into_).
struct Layout {
  int bias = -1;
  int aux = -1;
  int a_scale_inv = -1;
  int b_scale_inv = -1;
  int d = -1;
  int bias_grad = -1;  // GemmParams::bias_grad_into
  std::size_t inputs = 2;
};

Layout input_layout(const GemmParams& p, bool into) {
  Layout layout;
  if (kernels::epilogue_reads_bias(p.epilogue)) layout.bias = static_cast<int>(layout.inputs++);
  if (kernels::epilogue_reads_aux(p.epilogue) || (into && kernels::epilogue_writes_aux(p.epilogue))) {
    layout.aux = static_cast<int>(layout.inputs++);
  }
  if (p.fp8_scales) {
    layout.a_scale_inv = static_cast<int>(layout.inputs++);
    layout.b_scale_inv = static_cast<int>(layout.inputs++);
  }
  if (into) layout.d = static_cast<int>(layout.inputs++);
  if (into && p.bias_grad_into) layout.bias_grad = static_cast<int>(layout.inputs++);
  return layout;
}

kernels::GemmDesc describe(const GemmParams& p, std::span<const TensorMeta> inputs) {
  const TensorMeta& a = inputs[0];
  const TensorMeta& b = inputs[1];
  kernels::GemmDesc desc;
  desc.trans_a = p.trans_a;
  desc.trans_b = p.trans_b;
  desc.m = p.rows > 0 ? p.rows : p.trans_a ? a.shape.dim(1) : a.shape.dim(0);
  desc.k = p.trans_a ? a.shape.dim(0) : a.shape.dim(1);
  desc.n = p.trans_b ? b.shape.dim(0) : b.shape.dim(1);
  desc.a_type = a.dtype;
  desc.b_type = b.dtype;
  desc.d_type = p.out_dtype;
  desc.epilogue = p.epilogue;
  desc.alpha = p.alpha;
  desc.beta = 0.0f;  // D is written, never read
  desc.fast_accumulation = p.fast_accumulation;
  desc.a_blocks = p.a_blocks;
  desc.b_blocks = p.b_blocks;
  desc.algorithm = p.algorithm;
  return desc;
}

void expect_meta(std::string_view role, const TensorMeta& got, const TensorMeta& want, std::string_view op) {
  SG_CHECK(got == want, "op ", op, ": ", role, " must be ", want.shape, " ", dtype_name(want.dtype), ", got ",
           got.shape, " ", dtype_name(got.dtype));
}

// See Note [Row windows of a GEMM].
void check_windows(const GemmParams& p, std::span<const TensorMeta> inputs, bool into, std::string_view op) {
  SG_CHECK(p.rows >= 0 && p.a_row >= 0 && p.d_row >= 0, "op ", op, ": rows, a_row and d_row must be >= 0, got ",
           p.rows, ", ", p.a_row, ", ", p.d_row);
  const std::int64_t m = p.rows > 0 ? p.rows : p.trans_a ? inputs[0].shape.dim(1) : inputs[0].shape.dim(0);
  if (p.trans_a) {
    SG_CHECK(p.a_row == 0 && (p.rows == 0 || p.rows == inputs[0].shape.dim(1)), "op ", op,
             ": a row window (rows=", p.rows, ", a_row=", p.a_row, ") needs A not transposed");
  } else {
    SG_CHECK(p.a_row + m <= inputs[0].shape.dim(0), "op ", op, ": A rows [", p.a_row, ", ", p.a_row + m,
             ") exceed A ", inputs[0].shape);
  }
  if (!into) {
    SG_CHECK(p.d_row == 0, "op ", op, ": d_row (", p.d_row, ") is for gemm_into_; a fresh D is the window itself");
    return;
  }
  const TensorMeta& d = inputs[static_cast<std::size_t>(input_layout(p, true).d)];
  SG_CHECK(d.shape.rank() == 2 && p.d_row + m <= d.shape.dim(0), "op ", op, ": D rows [", p.d_row, ", ",
           p.d_row + m, ") exceed D ", d.shape);
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
  SG_CHECK(p.fp8_scales == (is_fp8(desc.a_type) && is_fp8(desc.b_type)), "op ", op, ": ",
           p.fp8_scales ? "fp8 scales given for non-FP8 operands" : "FP8 operands need their scale_inv tensors",
           " (A ", dtype_name(desc.a_type), ", B ", dtype_name(desc.b_type), "); call fp8_gemm");
  check_windows(p, inputs, into, op);
  const TensorMeta d_meta{Shape{desc.m, desc.n}, p.out_dtype};
  // gemm_into_'s D (and its aux) may hold more rows than the window.
  const TensorMeta whole_d =
      into ? TensorMeta{Shape{inputs[layout.d].shape.dim(0), desc.n}, p.out_dtype} : d_meta;
  if (layout.bias >= 0) expect_meta("bias", inputs[layout.bias], {Shape{desc.n}, p.out_dtype}, op);
  if (layout.aux >= 0) expect_meta("aux (the forward pre-activation)", inputs[layout.aux], whole_d, op);
  if (layout.d >= 0) expect_meta("D", inputs[layout.d], whole_d, op);
  // One scalar, or the block scales of the TN operand [outer, k].
  auto scales = [&](const std::optional<kernels::BlockShape>& blocks, std::int64_t outer) {
    const std::int64_t count = blocks ? kernels::BlockScaleLayout{*blocks, outer, desc.k}.count() : 1;
    return TensorMeta{Shape{count}, DType::kFloat32};
  };
  if (p.a_blocks || p.b_blocks) {
    SG_CHECK(p.rows == 0 && p.a_row == 0 && p.d_row == 0, "op ", op,
             ": block-scaled FP8 takes no row windows (the scales cover whole operands), got ", p.to_string());
  }
  if (layout.a_scale_inv >= 0) expect_meta("A's scale_inv", inputs[layout.a_scale_inv], scales(p.a_blocks, desc.m), op);
  if (layout.b_scale_inv >= 0) expect_meta("B's scale_inv", inputs[layout.b_scale_inv], scales(p.b_blocks, desc.n), op);

  std::vector<TensorMeta> outputs;
  if (!into) outputs.push_back(d_meta);
  if (!into && kernels::epilogue_writes_aux(p.epilogue)) outputs.push_back(d_meta);
  SG_CHECK(!p.bias_grad_into || (into && kernels::epilogue_writes_bias_grad(p.epilogue)), "op ", op,
           ": bias_grad_into needs gemm_into_ with an epilogue that writes a bias gradient, got ",
           kernels::gemm_epilogue_name(p.epilogue));
  if (kernels::epilogue_writes_bias_grad(p.epilogue)) {
    const std::int64_t length = p.epilogue == GemmEpilogue::kBiasGradOfA ? desc.m : desc.n;
    const TensorMeta bias_grad{Shape{length}, p.out_dtype};
    if (layout.bias_grad >= 0) {
      expect_meta("the bias gradient written in place", inputs[layout.bias_grad], bias_grad, op);
    } else {
      outputs.push_back(bias_grad);
    }
  }
  SG_CHECK(p.workspace_bytes >= 0 && p.workspace_bytes % 4 == 0 &&
               static_cast<std::size_t>(p.workspace_bytes) <= kernels::gemm_workspace_bytes(),
           "op ", op, ": workspace_bytes must be a multiple of 4 in [0, ", kernels::gemm_workspace_bytes(), "], got ",
           p.workspace_bytes);
  if (p.workspace_bytes > 0) outputs.push_back({Shape{p.workspace_bytes / 4}, DType::kFloat32});
  return outputs;
}

// The address of row `row` of a row-major tensor of `meta`'s shape.
template <typename T>
T* row_address(T* base, const TensorMeta& meta, std::int64_t row) {
  if (row == 0) return base;
  const std::int64_t row_bytes = meta.bytes() / meta.shape.dim(0);
  return reinterpret_cast<T*>(reinterpret_cast<std::conditional_t<std::is_const_v<T>, const char, char>*>(base) +
                              row * row_bytes);
}

kernels::GemmOperands operands(const GemmParams& p, const KernelArgs& args, bool into) {
  const Layout layout = input_layout(p, into);
  kernels::GemmOperands o;
  o.a = row_address<const void>(args.inputs[0], args.input_metas[0], p.a_row);
  o.b = args.inputs[1];
  if (layout.bias >= 0) o.bias = args.inputs[layout.bias];
  if (layout.aux >= 0) o.aux = row_address<void>(args.inputs[layout.aux], args.input_metas[layout.aux], p.d_row);
  if (layout.a_scale_inv >= 0) o.a_scale_inv = static_cast<const float*>(args.inputs[layout.a_scale_inv]);
  if (layout.b_scale_inv >= 0) o.b_scale_inv = static_cast<const float*>(args.inputs[layout.b_scale_inv]);
  std::size_t next = 0;
  o.d = into ? row_address<void>(args.inputs[layout.d], args.input_metas[layout.d], p.d_row) : args.outputs[next++];
  if (!into && kernels::epilogue_writes_aux(p.epilogue)) o.aux = args.outputs[next++];
  if (layout.bias_grad >= 0) {
    o.bias_grad = args.inputs[layout.bias_grad];
  } else if (kernels::epilogue_writes_bias_grad(p.epilogue)) {
    o.bias_grad = args.outputs[next++];
  }
  o.workspace_bytes = static_cast<std::size_t>(p.workspace_bytes);
  if (p.workspace_bytes > 0) o.workspace = args.outputs[next];
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
  const GemmParams& p = params.as<GemmParams>();
  const Layout layout = input_layout(p, true);
  std::vector<int> out{layout.d};
  if (kernels::epilogue_writes_aux(p.epilogue)) out.push_back(layout.aux);
  if (layout.bias_grad >= 0) out.push_back(layout.bias_grad);
  return out;
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
SG_REGISTER_OP(gemm_op);

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
SG_REGISTER_OP(gemm_into_op);

namespace {

// params with the workspace its GEMM needs on this context's device. Call it
// before ctx.call, not in its argument list: the list moves `inputs`, and its
// arguments are evaluated in an unspecified order (GCC moved them first).
GemmParams with_workspace(Context& ctx, GemmParams params, const std::vector<Tensor>& inputs) {
  std::vector<TensorMeta> metas;
  for (const Tensor& t : inputs) metas.push_back(t.meta());
  params.algorithm = ctx.algorithm_choice();
  params.workspace_bytes = static_cast<std::int64_t>(ctx.backend().library_scratch_bytes(
      [&] { return kernels::gemm_workspace_bytes(describe(params, metas)); }));
  return params;
}

}  // namespace

GemmResult gemm(Context& ctx, const Tensor& a, const Tensor& b, const GemmParams& params, const Tensor& bias,
                const Tensor& aux) {
  std::vector<Tensor> inputs{a, b};
  if (kernels::epilogue_reads_bias(params.epilogue)) inputs.push_back(bias);
  if (kernels::epilogue_reads_aux(params.epilogue)) inputs.push_back(aux);
  const GemmParams sized = with_workspace(ctx, params, inputs);
  std::vector<Tensor> outputs = ctx.call(gemm_op(), sized, std::move(inputs));
  GemmResult result;
  std::size_t next = 0;
  result.d = outputs[next++];
  if (kernels::epilogue_writes_aux(params.epilogue)) result.aux = outputs[next++];
  if (kernels::epilogue_writes_bias_grad(params.epilogue)) result.bias_grad = outputs[next++];
  return result;
}

GemmResult fp8_gemm(Context& ctx, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                    const Tensor& b_scale_inv, GemmParams params, const Tensor& bias) {
  params.fp8_scales = true;
  std::vector<Tensor> inputs{a, b};
  if (kernels::epilogue_reads_bias(params.epilogue)) inputs.push_back(bias);
  inputs.push_back(a_scale_inv);
  inputs.push_back(b_scale_inv);
  const GemmParams sized = with_workspace(ctx, params, inputs);
  std::vector<Tensor> outputs = ctx.call(gemm_op(), sized, std::move(inputs));
  return GemmResult{outputs[0], {}, {}};
}

void fp8_gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                    const Tensor& b_scale_inv, GemmParams params) {
  params.fp8_scales = true;
  SG_CHECK(!kernels::epilogue_reads_bias(params.epilogue) && !kernels::epilogue_uses_aux(params.epilogue),
           "fp8_gemm_into_: epilogue ", kernels::gemm_epilogue_name(params.epilogue), " takes inputs this call has "
           "no place for; use fp8_gemm");
  std::vector<Tensor> inputs{a, b, a_scale_inv, b_scale_inv, d};
  const GemmParams sized = with_workspace(ctx, params, inputs);
  ctx.call(gemm_into_op(), sized, std::move(inputs));
}

Tensor gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& b, const GemmParams& params,
                  const Tensor& bias, const Tensor& aux, const Tensor& bias_grad) {
  std::vector<Tensor> inputs{a, b};
  if (kernels::epilogue_reads_bias(params.epilogue)) inputs.push_back(bias);
  if (kernels::epilogue_uses_aux(params.epilogue)) inputs.push_back(aux);
  inputs.push_back(d);
  GemmParams into = params;
  into.bias_grad_into = bias_grad.defined();
  if (bias_grad.defined()) inputs.push_back(bias_grad);
  const GemmParams sized = with_workspace(ctx, into, inputs);
  std::vector<Tensor> outputs = ctx.call(gemm_into_op(), sized, std::move(inputs));
  if (!kernels::epilogue_writes_bias_grad(params.epilogue)) return Tensor();
  return bias_grad.defined() ? bias_grad : outputs[0];
}

}  // namespace stepgraph::ops
