#include "ops/gemm_ops.h"

#include <cstdio>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "kernels/gemm_host.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

using kernels::GemmEpilogue;

std::string GemmParams::to_string() const {
  char text[224];
  int length = std::snprintf(text, sizeof(text), "%s%s%s, out=%s, alpha=%g", trans_a ? "A^T " : "",
                             trans_b ? "B^T " : "", kernels::gemm_epilogue_name(epilogue).c_str(),
                             std::string(dtype_name(out_dtype)).c_str(), static_cast<double>(alpha));
  if (fp8_scales)
    length += std::snprintf(text + length, sizeof(text) - static_cast<std::size_t>(length), "%s",
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

// A call of gemm or gemm_into_: the params and which op (their operands differ).
struct GemmCall {
  GemmParams p;
  bool into = false;
};

template <typename F>
struct GemmInputs {
  F a, b;
  F bias;                      // [n], where the epilogue reads a bias
  F aux;                       // [m, n]: read by the epilogue, or written by it through gemm_into_
  F a_scale_inv, b_scale_inv;  // FP8 (params.fp8_scales): a scalar or block scales each
  F d;                         // gemm_into_: the result, written
  F bias_grad;                 // gemm_into_ with params.bias_grad_into: written
};

template <typename F, typename V>
void visit_operands(const GemmCall& c, GemmInputs<F>& o, V& v) {
  const GemmEpilogue e = c.p.epilogue;
  const bool writes_aux = c.into && kernels::epilogue_writes_aux(e);
  v({"a"}, o.a);
  v({"b"}, o.b);
  v({.name = "bias", .present = kernels::epilogue_reads_bias(e)}, o.bias);
  v({.name = "aux",
     .use = writes_aux ? Use::kWrite : Use::kRead,
     .present = kernels::epilogue_reads_aux(e) || writes_aux},
    o.aux);
  v({.name = "a_scale_inv", .present = c.p.fp8_scales}, o.a_scale_inv);
  v({.name = "b_scale_inv", .present = c.p.fp8_scales}, o.b_scale_inv);
  v({.name = "d", .use = Use::kWrite, .present = c.into}, o.d);
  v({.name = "bias_grad", .use = Use::kWrite, .present = c.into && c.p.bias_grad_into}, o.bias_grad);
}

template <typename F>
struct GemmOutputs {
  F d;          // gemm: [m, n]
  F aux;        // gemm with an epilogue that writes the pre-activation
  F bias_grad;  // where the epilogue writes a bias gradient, unless into an input
  F workspace;  // fp32 [workspace_bytes / 4], with workspace_bytes > 0
};

template <typename F, typename V>
void visit_operands(const GemmCall& c, GemmOutputs<F>& o, V& v) {
  const GemmEpilogue e = c.p.epilogue;
  v({.name = "d", .present = !c.into}, o.d);
  v({.name = "aux", .present = !c.into && kernels::epilogue_writes_aux(e)}, o.aux);
  v({.name = "bias_grad", .present = kernels::epilogue_writes_bias_grad(e) && !c.p.bias_grad_into}, o.bias_grad);
  v({.name = "workspace", .present = c.p.workspace_bytes > 0}, o.workspace);
}

constexpr std::string_view kGemm = "gemm";
constexpr std::string_view kGemmInto = "gemm_into_";

std::string_view op_name(bool into) { return into ? kGemmInto : kGemm; }

kernels::GemmDesc describe(const GemmParams& p, const TensorMeta& a, const TensorMeta& b) {
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
void check_windows(const GemmCall& c, const GemmInputs<TensorMeta>& o, std::string_view op) {
  const GemmParams& p = c.p;
  SG_CHECK(p.rows >= 0 && p.a_row >= 0 && p.d_row >= 0, "op ", op, ": rows, a_row and d_row must be >= 0, got ", p.rows,
           ", ", p.a_row, ", ", p.d_row);
  const std::int64_t m = p.rows > 0 ? p.rows : p.trans_a ? o.a.shape.dim(1) : o.a.shape.dim(0);
  if (p.trans_a) {
    SG_CHECK(p.a_row == 0 && (p.rows == 0 || p.rows == o.a.shape.dim(1)), "op ", op, ": a row window (rows=", p.rows,
             ", a_row=", p.a_row, ") needs A not transposed");
  } else {
    SG_CHECK(p.a_row + m <= o.a.shape.dim(0), "op ", op, ": A rows [", p.a_row, ", ", p.a_row + m, ") exceed A ",
             o.a.shape);
  }
  if (!c.into) {
    SG_CHECK(p.d_row == 0, "op ", op, ": d_row (", p.d_row, ") is for gemm_into_; a fresh D is the window itself");
    return;
  }
  SG_CHECK(o.d.shape.rank() == 2 && p.d_row + m <= o.d.shape.dim(0), "op ", op, ": D rows [", p.d_row, ", ",
           p.d_row + m, ") exceed D ", o.d.shape);
}

std::vector<TensorMeta> check(const GemmCall& c, std::span<const TensorMeta> inputs) {
  const GemmParams& p = c.p;
  const std::string_view op = op_name(c.into);
  const auto o = bind_metas<GemmInputs>(op, c, inputs);
  SG_CHECK(o.a.shape.rank() == 2 && o.b.shape.rank() == 2, "op ", op, " needs 2-D operands, got A ", o.a.shape,
           " and B ", o.b.shape);
  const std::int64_t k_of_b = p.trans_b ? o.b.shape.dim(1) : o.b.shape.dim(0);
  const kernels::GemmDesc desc = describe(p, o.a, o.b);
  SG_CHECK(desc.k == k_of_b, "op ", op, ": inner dimensions differ: opA(A) is ", desc.m, "x", desc.k, " but opB(B) is ",
           k_of_b, "x", desc.n, " (A ", o.a.shape, p.trans_a ? " transposed" : "", ", B ", o.b.shape,
           p.trans_b ? " transposed" : "", ")");
  kernels::check_gemm(desc);
  SG_CHECK(p.fp8_scales == (is_fp8(desc.a_type) && is_fp8(desc.b_type)), "op ", op, ": ",
           p.fp8_scales ? "fp8 scales given for non-FP8 operands" : "FP8 operands need their scale_inv tensors", " (A ",
           dtype_name(desc.a_type), ", B ", dtype_name(desc.b_type), "); call fp8_gemm");
  check_windows(c, o, op);
  const TensorMeta d_meta{Shape{desc.m, desc.n}, p.out_dtype};
  // gemm_into_'s D (and its aux) may hold more rows than the window.
  const TensorMeta whole_d = c.into ? TensorMeta{Shape{o.d.shape.dim(0), desc.n}, p.out_dtype} : d_meta;
  const GemmEpilogue e = p.epilogue;
  if (kernels::epilogue_reads_bias(e)) expect_meta("bias", o.bias, {Shape{desc.n}, p.out_dtype}, op);
  if (kernels::epilogue_reads_aux(e) || (c.into && kernels::epilogue_writes_aux(e))) {
    expect_meta("aux (the forward pre-activation)", o.aux, whole_d, op);
  }
  if (c.into) expect_meta("D", o.d, whole_d, op);
  // One scalar, or the block scales of the TN operand [outer, k].
  auto scales = [&](const std::optional<kernels::BlockShape>& blocks, std::int64_t outer) {
    const std::int64_t count = blocks ? kernels::BlockScaleLayout{*blocks, outer, desc.k}.count() : 1;
    return TensorMeta{Shape{count}, DType::kFloat32};
  };
  if (p.a_blocks || p.b_blocks) {
    SG_CHECK(p.rows == 0 && p.a_row == 0 && p.d_row == 0, "op ", op,
             ": block-scaled FP8 takes no row windows (the scales cover whole operands), got ", p.to_string());
  }
  if (p.fp8_scales) {
    expect_meta("A's scale_inv", o.a_scale_inv, scales(p.a_blocks, desc.m), op);
    expect_meta("B's scale_inv", o.b_scale_inv, scales(p.b_blocks, desc.n), op);
  }
  SG_CHECK(!p.bias_grad_into || (c.into && kernels::epilogue_writes_bias_grad(e)), "op ", op,
           ": bias_grad_into needs gemm_into_ with an epilogue that writes a bias gradient, got ",
           kernels::gemm_epilogue_name(e));
  GemmOutputs<TensorMeta> outputs{.d = d_meta, .aux = d_meta};
  if (kernels::epilogue_writes_bias_grad(e)) {
    const std::int64_t length = e == GemmEpilogue::kBiasGradOfA ? desc.m : desc.n;
    const TensorMeta bias_grad{Shape{length}, p.out_dtype};
    if (p.bias_grad_into) {
      expect_meta("the bias gradient written in place", o.bias_grad, bias_grad, op);
    } else {
      outputs.bias_grad = bias_grad;
    }
  }
  SG_CHECK(p.workspace_bytes >= 0 && p.workspace_bytes % 4 == 0 &&
               static_cast<std::size_t>(p.workspace_bytes) <= kernels::gemm_workspace_bytes(),
           "op ", op, ": workspace_bytes must be a multiple of 4 in [0, ", kernels::gemm_workspace_bytes(), "], got ",
           p.workspace_bytes);
  outputs.workspace = {Shape{p.workspace_bytes / 4}, DType::kFloat32};
  return output_metas(c, std::move(outputs));
}

// The address of row `row` of a row-major tensor of `meta`'s shape.
template <typename T>
T* row_address(T* base, const TensorMeta& meta, std::int64_t row) {
  if (row == 0) return base;
  const std::int64_t row_bytes = meta.bytes() / meta.shape.dim(0);
  return reinterpret_cast<T*>(reinterpret_cast<std::conditional_t<std::is_const_v<T>, const char, char>*>(base) +
                              row * row_bytes);
}

kernels::GemmOperands pointers(const GemmCall& c, const GemmInputs<Operand>& in, const GemmOutputs<Operand>& out) {
  const GemmParams& p = c.p;
  kernels::GemmOperands o;
  o.a = row_address<const void>(in.a.data, *in.a.meta, p.a_row);
  o.b = in.b.data;
  o.bias = in.bias.data;
  if (in.aux.present()) o.aux = row_address<void>(in.aux.data, *in.aux.meta, p.d_row);
  if (out.aux.present()) o.aux = out.aux.data;
  o.a_scale_inv = in.a_scale_inv.as<const float>();
  o.b_scale_inv = in.b_scale_inv.as<const float>();
  o.d = c.into ? row_address<void>(in.d.data, *in.d.meta, p.d_row) : out.d.data;
  o.bias_grad = in.bias_grad.present() ? in.bias_grad.data : out.bias_grad.data;
  o.workspace_bytes = static_cast<std::size_t>(p.workspace_bytes);
  o.workspace = out.workspace.data;
  return o;
}

template <bool kInto>
std::vector<TensorMeta> check_op(const OpParams& params, std::span<const TensorMeta> inputs) {
  return check(GemmCall{params.as<GemmParams>(), kInto}, inputs);
}

// The kernel's description and operands of a launch.
template <bool kInto>
std::pair<kernels::GemmDesc, kernels::GemmOperands> bind(const OpParams& params, const KernelArgs& args) {
  const GemmCall c{params.as<GemmParams>(), kInto};
  const auto in = bind_args<GemmInputs>(c, args);
  return {describe(c.p, *in.a.meta, *in.b.meta), pointers(c, in, bind_outputs<GemmOutputs>(c, args))};
}

template <bool kInto>
void launch_cuda(const OpParams& params, const KernelArgs& args, CUstream_st* stream) {
  const auto [desc, operands] = bind<kInto>(params, args);
  kernels::launch_gemm(desc, operands, stream);
}

template <bool kInto>
void run_host(const OpParams& params, const KernelArgs& args) {
  const auto [desc, operands] = bind<kInto>(params, args);
  kernels::host::gemm(desc, operands);
}

template <bool kInto>
void prepare_cuda(const OpParams& params, std::span<const TensorMeta> inputs) {
  const GemmCall c{params.as<GemmParams>(), kInto};
  const auto o = bind_metas<GemmInputs>(op_name(kInto), c, inputs);
  kernels::gemm_prepare(describe(c.p, o.a, o.b));
}

std::vector<int> written_input(const OpParams& params, std::size_t input_count) {
  return operand_layout<GemmInputs>(GemmCall{params.as<GemmParams>(), true}, input_count).written;
}

}  // namespace

const OpDef& gemm_op() {
  static const OpDef op{
      .name = kGemm,
      .check = check_op<false>,
      .launch_cuda = launch_cuda<false>,
      .run_host = run_host<false>,
      .prepare_cuda = prepare_cuda<false>,
  };
  return op;
}
SG_REGISTER_OP(gemm_op);

const OpDef& gemm_into_op() {
  static const OpDef op{
      .name = kGemmInto,
      .check = check_op<true>,
      .mutated_inputs_for = written_input,
      .launch_cuda = launch_cuda<true>,
      .run_host = run_host<true>,
      .prepare_cuda = prepare_cuda<true>,
  };
  return op;
}
SG_REGISTER_OP(gemm_into_op);

namespace {

// params with the workspace its GEMM needs on this context's device.
GemmParams with_workspace(Context& ctx, GemmParams params, const Tensor& a, const Tensor& b) {
  params.algorithm = ctx.algorithm_choice();
  params.workspace_bytes = static_cast<std::int64_t>(ctx.backend().library_scratch_bytes(
      [&] { return kernels::gemm_workspace_bytes(describe(params, a.meta(), b.meta())); }));
  return params;
}

// The call's tensors as its inputs: those of other epilogues are left out.
std::vector<Tensor> gemm_inputs(const GemmCall& c, GemmInputs<Tensor> o) {
  const GemmEpilogue e = c.p.epilogue;
  if (!kernels::epilogue_reads_bias(e)) o.bias = Tensor();
  if (!kernels::epilogue_reads_aux(e) && !(c.into && kernels::epilogue_writes_aux(e))) o.aux = Tensor();
  return flatten(op_name(c.into), c, std::move(o));
}

}  // namespace

GemmResult gemm(Context& ctx, const Tensor& a, const Tensor& b, const GemmParams& params, const Tensor& bias,
                const Tensor& aux) {
  const GemmCall c{with_workspace(ctx, params, a, b)};
  const std::vector<Tensor> outputs =
      ctx.call(gemm_op(), c.p, gemm_inputs(c, {.a = a, .b = b, .bias = bias, .aux = aux}));
  const auto r = bind_results<GemmOutputs>(c, outputs);
  return {.d = r.d, .aux = r.aux, .bias_grad = r.bias_grad};
}

GemmResult fp8_gemm(Context& ctx, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                    const Tensor& b_scale_inv, GemmParams params, const Tensor& bias) {
  params.fp8_scales = true;
  const GemmCall c{with_workspace(ctx, params, a, b)};
  const std::vector<Tensor> outputs =
      ctx.call(gemm_op(), c.p,
               gemm_inputs(c, {.a = a, .b = b, .bias = bias, .a_scale_inv = a_scale_inv, .b_scale_inv = b_scale_inv}));
  return GemmResult{bind_results<GemmOutputs>(c, outputs).d, {}, {}};
}

void fp8_gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                    const Tensor& b_scale_inv, GemmParams params) {
  params.fp8_scales = true;
  SG_CHECK(!kernels::epilogue_reads_bias(params.epilogue) && !kernels::epilogue_uses_aux(params.epilogue),
           "fp8_gemm_into_: epilogue ", kernels::gemm_epilogue_name(params.epilogue),
           " takes inputs this call has "
           "no place for; use fp8_gemm");
  const GemmCall c{with_workspace(ctx, params, a, b), /*into=*/true};
  ctx.call(gemm_into_op(), c.p,
           gemm_inputs(c, {.a = a, .b = b, .a_scale_inv = a_scale_inv, .b_scale_inv = b_scale_inv, .d = d}));
}

Tensor gemm_into_(Context& ctx, const Tensor& d, const Tensor& a, const Tensor& b, const GemmParams& params,
                  const Tensor& bias, const Tensor& aux, const Tensor& bias_grad) {
  GemmParams into = params;
  into.bias_grad_into = bias_grad.defined();
  const GemmCall c{with_workspace(ctx, into, a, b), /*into=*/true};
  const std::vector<Tensor> outputs = ctx.call(
      gemm_into_op(), c.p, gemm_inputs(c, {.a = a, .b = b, .bias = bias, .aux = aux, .d = d, .bias_grad = bias_grad}));
  if (!kernels::epilogue_writes_bias_grad(params.epilogue)) return Tensor();
  return bias_grad.defined() ? bias_grad : bind_results<GemmOutputs>(c, outputs).bias_grad;
}

}  // namespace stepgraph::ops
