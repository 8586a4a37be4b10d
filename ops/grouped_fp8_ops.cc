#include "ops/grouped_fp8_ops.h"

#include <cstdint>
#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/grouped_gemm.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

using kernels::GroupedGemmDesc;
using kernels::GroupedGemmKind;

namespace {

std::string describe(const TensorMeta& m) { return m.shape.to_string() + " " + std::string(dtype_name(m.dtype)); }


const char* op_name(GroupedGemmKind kind) {
  switch (kind) {
    case GroupedGemmKind::kForward: return "grouped_fp8_forward";
    case GroupedGemmKind::kDgrad: return "grouped_fp8_dgrad";
    case GroupedGemmKind::kWgrad: return "grouped_fp8_wgrad_";
  }
  return "grouped_fp8";
}

// The inputs' order: forward x, x_si, w, w_si, offsets[, bias]; dgrad dy,
// dy_si, w_t, w_si, offsets; wgrad dw, dy_t, dy_si, x_t, x_si, offsets.
struct Roles {
  int a, a_scale, b, b_scale, offsets;
};
Roles roles(GroupedGemmKind kind) {
  return kind == GroupedGemmKind::kWgrad ? Roles{1, 2, 3, 4, 5} : Roles{0, 1, 2, 3, 4};
}

void expect_matrix(const char* op, const char* role, const TensorMeta& m, bool fp8, const char* dims) {
  SG_CHECK(m.shape.rank() == 2 && (!fp8 || is_fp8(m.dtype)), "op ", op, ": ", role, " must be ", fp8 ? "FP8 " : "",
           dims, ", got ", describe(m));
}

// The kernel description of a call, after the checks of its shapes.
GroupedGemmDesc describe_call(GroupedGemmKind kind, const GroupedGemmParams& p, std::span<const TensorMeta> in) {
  const char* op = op_name(kind);
  const std::size_t count = kind == GroupedGemmKind::kWgrad ? 6u : (p.bias ? 6u : 5u);
  SG_CHECK(in.size() == count, "op ", op, " takes ", count, " inputs, got ", in.size());
  const Roles r = roles(kind);
  for (int scale : {r.a_scale, r.b_scale}) {
    SG_CHECK(in[scale] == (TensorMeta{Shape{1}, DType::kFloat32}), "op ", op, ": a scale_inv must be [1] fp32, got ",
             describe(in[scale]));
  }
  const TensorMeta& offsets = in[r.offsets];
  SG_CHECK(offsets.dtype == DType::kInt32 && offsets.shape.rank() == 1 && offsets.shape.dim(0) >= 2, "op ", op,
           ": offsets must be int32 [E + 1] with E >= 1, got ", describe(offsets));
  GroupedGemmDesc d;
  d.kind = kind;
  d.experts = offsets.shape.dim(0) - 1;
  d.in_type = DType::kFloat8E4M3;
  d.out_type = kind == GroupedGemmKind::kWgrad ? DType::kFloat32 : p.out_dtype;
  d.split_accumulation = p.split_accumulation;
  const TensorMeta& a = in[r.a];
  const TensorMeta& b = in[r.b];
  const std::string context = "operands " + describe(a) + " and " + describe(b);
  switch (kind) {
    case GroupedGemmKind::kForward:
      expect_matrix(op, "x", a, true, "[T, K]");
      expect_matrix(op, "w", b, true, "[E * N, K] (w [E, N, K] as rows)");
      SG_CHECK(b.shape.dim(0) % d.experts == 0 && b.shape.dim(1) == a.shape.dim(1), "op ", op,
               ": w must be [E * N, K] with E = ", d.experts, " and x's K, got ", context);
      d.tokens = a.shape.dim(0);
      d.n = b.shape.dim(0) / d.experts;
      d.k = b.shape.dim(1);
      d.bias = p.bias;
      if (p.bias) {
        SG_CHECK(in[5] == (TensorMeta{Shape{d.experts, d.n}, DType::kBFloat16}), "op ", op, ": bias must be [E, N] = ",
                 Shape{d.experts, d.n}, " bf16, got ", describe(in[5]));
      }
      break;
    case GroupedGemmKind::kDgrad:
      expect_matrix(op, "dy", a, true, "[T, N]");
      expect_matrix(op, "w_t", b, true, "[K, E * N] (w's column-wise copy)");
      SG_CHECK(b.shape.dim(1) == d.experts * a.shape.dim(1), "op ", op, ": w_t must be [K, E * N] with E = ",
               d.experts, " and dy's N, got ", context);
      d.tokens = a.shape.dim(0);
      d.n = a.shape.dim(1);
      d.k = b.shape.dim(0);
      d.dy_type = a.dtype;
      break;
    case GroupedGemmKind::kWgrad: {
      const TensorMeta& dw = in[0];
      expect_matrix(op, "dy_t", a, true, "[N, T] (dy's column-wise copy)");
      expect_matrix(op, "x_t", b, true, "[K, T] (x's column-wise copy)");
      SG_CHECK(dw.dtype == DType::kFloat32 && dw.shape == (Shape{d.experts, a.shape.dim(0), b.shape.dim(0)}), "op ",
               op, ": dw must be fp32 [E, N, K] = ", Shape{d.experts, a.shape.dim(0), b.shape.dim(0)}, ", got ",
               describe(dw));
      SG_CHECK(a.shape.dim(1) == b.shape.dim(1), "op ", op, ": token counts of dy_t and x_t differ: ", context);
      d.tokens = a.shape.dim(1);
      d.n = a.shape.dim(0);
      d.k = b.shape.dim(0);
      d.dy_type = a.dtype;
      d.accumulate = p.accumulate;
      break;
    }
  }
  // x and w are E4M3 (the forward format); dy may be either.
  const TensorMeta& e4m3 = kind == GroupedGemmKind::kForward ? a : b;
  SG_CHECK(e4m3.dtype == DType::kFloat8E4M3 && (kind != GroupedGemmKind::kForward || b.dtype == DType::kFloat8E4M3),
           "op ", op, ": x and w must be e4m3, got ", context);
  kernels::check_grouped_gemm(d);
  return d;
}

kernels::GroupedGemmOperands operands_of(GroupedGemmKind kind, const GroupedGemmParams& p, const KernelArgs& a) {
  const Roles r = roles(kind);
  auto scale = [&](int i) { return static_cast<const float*>(a.inputs[i]); };
  kernels::GroupedGemmOperands o;
  o.offsets = static_cast<const std::int32_t*>(a.inputs[r.offsets]);
  switch (kind) {
    case GroupedGemmKind::kForward:
      o.x = a.inputs[r.a];
      o.x_scale_inv = scale(r.a_scale);
      o.w = a.inputs[r.b];
      o.w_scale_inv = scale(r.b_scale);
      if (p.bias) o.bias = a.inputs[5];
      o.out = a.outputs[0];
      break;
    case GroupedGemmKind::kDgrad:
      o.dy = a.inputs[r.a];
      o.dy_scale_inv = scale(r.a_scale);
      o.w = a.inputs[r.b];
      o.w_scale_inv = scale(r.b_scale);
      o.out = a.outputs[0];
      break;
    case GroupedGemmKind::kWgrad:
      o.dy = a.inputs[r.a];
      o.dy_scale_inv = scale(r.a_scale);
      o.x = a.inputs[r.b];
      o.x_scale_inv = scale(r.b_scale);
      o.out = a.inputs[0];
      break;
  }
  return o;
}

template <GroupedGemmKind kKind>
std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const GroupedGemmDesc d = describe_call(kKind, params.as<GroupedGemmParams>(), inputs);
  if constexpr (kKind == GroupedGemmKind::kForward) return {{Shape{d.tokens, d.n}, d.out_type}};
  if constexpr (kKind == GroupedGemmKind::kDgrad) return {{Shape{d.tokens, d.k}, d.out_type}};
  return {};
}

template <GroupedGemmKind kKind>
void launch(const OpParams& params, const KernelArgs& args, CUstream_st* stream) {
  const GroupedGemmParams& p = params.as<GroupedGemmParams>();
  kernels::launch_grouped_gemm(describe_call(kKind, p, args.input_metas), operands_of(kKind, p, args), stream);
}

template <GroupedGemmKind kKind>
void run_host(const OpParams& params, const KernelArgs& args) {
  const GroupedGemmParams& p = params.as<GroupedGemmParams>();
  kernels::host::grouped_gemm(describe_call(kKind, p, args.input_metas), operands_of(kKind, p, args));
}

}  // namespace

const OpDef& grouped_fp8_forward_op() {
  static const OpDef op{.name = "grouped_fp8_forward",
                        .check = check<GroupedGemmKind::kForward>,
                        .launch_cuda = launch<GroupedGemmKind::kForward>,
                        .run_host = run_host<GroupedGemmKind::kForward>};
  return op;
}
SG_REGISTER_OP(grouped_fp8_forward_op);

const OpDef& grouped_fp8_dgrad_op() {
  static const OpDef op{.name = "grouped_fp8_dgrad",
                        .check = check<GroupedGemmKind::kDgrad>,
                        .launch_cuda = launch<GroupedGemmKind::kDgrad>,
                        .run_host = run_host<GroupedGemmKind::kDgrad>};
  return op;
}
SG_REGISTER_OP(grouped_fp8_dgrad_op);

const OpDef& grouped_fp8_wgrad_op() {
  static const OpDef op{.name = "grouped_fp8_wgrad_",
                        .check = check<GroupedGemmKind::kWgrad>,
                        .mutated_inputs = {0},
                        .launch_cuda = launch<GroupedGemmKind::kWgrad>,
                        .run_host = run_host<GroupedGemmKind::kWgrad>};
  return op;
}
SG_REGISTER_OP(grouped_fp8_wgrad_op);

Tensor grouped_fp8_forward(Context& ctx, const Tensor& x, const Tensor& x_scale_inv, const Tensor& w,
                           const Tensor& w_scale_inv, const Tensor& offsets, const Tensor& bias, DType out_dtype,
                           bool split_accumulation) {
  std::vector<Tensor> inputs{x, x_scale_inv, w, w_scale_inv, offsets};
  if (bias.defined()) inputs.push_back(bias);
  return ctx
      .call(grouped_fp8_forward_op(),
            GroupedGemmParams{.out_dtype = out_dtype, .bias = bias.defined(), .split_accumulation = split_accumulation},
            std::move(inputs))
      .front();
}

Tensor grouped_fp8_dgrad(Context& ctx, const Tensor& dy, const Tensor& dy_scale_inv, const Tensor& w_t,
                         const Tensor& w_scale_inv, const Tensor& offsets, DType out_dtype, bool split_accumulation) {
  return ctx
      .call(grouped_fp8_dgrad_op(), GroupedGemmParams{.out_dtype = out_dtype, .split_accumulation = split_accumulation},
            {dy, dy_scale_inv, w_t, w_scale_inv, offsets})
      .front();
}

void grouped_fp8_wgrad_(Context& ctx, const Tensor& dw, const Tensor& dy_t, const Tensor& dy_scale_inv,
                        const Tensor& x_t, const Tensor& x_scale_inv, const Tensor& offsets, bool accumulate,
                        bool split_accumulation) {
  ctx.call(grouped_fp8_wgrad_op(),
           GroupedGemmParams{
               .out_dtype = DType::kFloat32, .accumulate = accumulate, .split_accumulation = split_accumulation},
           {dw, dy_t, dy_scale_inv, x_t, x_scale_inv, offsets});
}

}  // namespace stepgraph::ops
