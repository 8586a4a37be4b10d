#include "ops/grouped_fp8_ops.h"

#include <cstdint>
#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/grouped_gemm.h"
#include "ops/grouped_gemm_op_def.h"
#include "ops/grouped_gemm_ops.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

using kernels::GroupedGemmDesc;
using kernels::GroupedGemmKind;

namespace {

std::string describe(const TensorMeta& m) { return m.shape.to_string() + " " + std::string(dtype_name(m.dtype)); }

// --- operands -----------------------------------------------------------------

template <typename F>
struct Fp8ForwardOperands {
  F x, x_scale_inv;  // e4m3 [T, K], fp32 [1]
  F w, w_scale_inv;  // e4m3 [E * N, K] (w [E, N, K] as rows), fp32 [1]
  F offsets;         // int32 [E + 1]
  F bias;            // bf16 [E, N], with params.bias
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams& p, Fp8ForwardOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v({"x_scale_inv"}, o.x_scale_inv);
  v({"w"}, o.w);
  v({"w_scale_inv"}, o.w_scale_inv);
  v({"offsets"}, o.offsets);
  v({.name = "bias", .present = p.bias}, o.bias);
}

template <typename F>
struct Fp8DgradOperands {
  F dy, dy_scale_inv;  // FP8 [T, N], fp32 [1]
  F w_t, w_scale_inv;  // e4m3 [K, E * N] (w's column-wise copy), fp32 [1]
  F offsets;
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams&, Fp8DgradOperands<F>& o, V& v) {
  v({"dy"}, o.dy);
  v({"dy_scale_inv"}, o.dy_scale_inv);
  v({"w_t"}, o.w_t);
  v({"w_scale_inv"}, o.w_scale_inv);
  v({"offsets"}, o.offsets);
}

template <typename F>
struct Fp8WgradOperands {
  F dw;                  // fp32 [E, N, K], written
  F dy_t, dy_scale_inv;  // FP8 [N, T] (dy's column-wise copy), fp32 [1]
  F x_t, x_scale_inv;    // e4m3 [K, T] (x's column-wise copy), fp32 [1]
  F offsets;
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams&, Fp8WgradOperands<F>& o, V& v) {
  v({.name = "dw", .use = Use::kWrite}, o.dw);
  v({"dy_t"}, o.dy_t);
  v({"dy_scale_inv"}, o.dy_scale_inv);
  v({"x_t"}, o.x_t);
  v({"x_scale_inv"}, o.x_scale_inv);
  v({"offsets"}, o.offsets);
}

constexpr std::string_view kForward = "grouped_fp8_forward";
constexpr std::string_view kDgrad = "grouped_fp8_dgrad";
constexpr std::string_view kWgrad = "grouped_fp8_wgrad_";

void expect_matrix(std::string_view op, const char* role, const TensorMeta& m, const char* dims) {
  SG_CHECK(m.shape.rank() == 2 && is_fp8(m.dtype), "op ", op, ": ", role, " must be FP8 ", dims, ", got ", describe(m));
}

// What every kind checks: both scales, the offsets, e4m3 where the forward's
// format is needed; returns the desc with the experts and types set.
GroupedGemmDesc describe_common(std::string_view op, GroupedGemmKind kind, const GroupedGemmParams& p,
                                const TensorMeta& a_scale, const TensorMeta& b_scale, const TensorMeta& offsets) {
  for (const TensorMeta* scale : {&a_scale, &b_scale}) {
    SG_CHECK(*scale == (TensorMeta{Shape{1}, DType::kFloat32}), "op ", op, ": a scale_inv must be [1] fp32, got ",
             describe(*scale));
  }
  SG_CHECK(offsets.dtype == DType::kInt32 && offsets.shape.rank() == 1 && offsets.shape.dim(0) >= 2, "op ", op,
           ": offsets must be int32 [E + 1] with E >= 1, got ", describe(offsets));
  GroupedGemmDesc d;
  d.kind = kind;
  d.experts = offsets.shape.dim(0) - 1;
  d.in_type = DType::kFloat8E4M3;
  d.out_type = kind == GroupedGemmKind::kWgrad ? DType::kFloat32 : p.out_dtype;
  d.split_accumulation = p.split_accumulation;
  return d;
}

void expect_e4m3(std::string_view op, const TensorMeta& e4m3, const TensorMeta& other, bool both) {
  SG_CHECK(e4m3.dtype == DType::kFloat8E4M3 && (!both || other.dtype == DType::kFloat8E4M3), "op ", op,
           ": x and w must be e4m3, got operands ", describe(e4m3), " and ", describe(other));
}

template <typename F>
GroupedGemmDesc describe_call(const GroupedGemmParams& p, const Fp8ForwardOperands<F>& o) {
  constexpr std::string_view op = kForward;
  GroupedGemmDesc d = describe_common(op, GroupedGemmKind::kForward, p, meta_of(o.x_scale_inv), meta_of(o.w_scale_inv),
                                      meta_of(o.offsets));
  const TensorMeta& x = meta_of(o.x);
  const TensorMeta& w = meta_of(o.w);
  expect_matrix(op, "x", x, "[T, K]");
  expect_matrix(op, "w", w, "[E * N, K] (w [E, N, K] as rows)");
  SG_CHECK(w.shape.dim(0) % d.experts == 0 && w.shape.dim(1) == x.shape.dim(1), "op ", op,
           ": w must be [E * N, K] with E = ", d.experts, " and x's K, got operands ", describe(x), " and ",
           describe(w));
  d.tokens = x.shape.dim(0);
  d.n = w.shape.dim(0) / d.experts;
  d.k = w.shape.dim(1);
  d.bias = p.bias;
  if (p.bias) {
    const TensorMeta& bias = meta_of(o.bias);
    SG_CHECK(bias == (TensorMeta{Shape{d.experts, d.n}, DType::kBFloat16}), "op ", op,
             ": bias must be [E, N] = ", Shape{d.experts, d.n}, " bf16, got ", describe(bias));
  }
  expect_e4m3(op, x, w, /*both=*/true);
  kernels::check_grouped_gemm(d);
  return d;
}

template <typename F>
GroupedGemmDesc describe_call(const GroupedGemmParams& p, const Fp8DgradOperands<F>& o) {
  constexpr std::string_view op = kDgrad;
  GroupedGemmDesc d = describe_common(op, GroupedGemmKind::kDgrad, p, meta_of(o.dy_scale_inv), meta_of(o.w_scale_inv),
                                      meta_of(o.offsets));
  const TensorMeta& dy = meta_of(o.dy);
  const TensorMeta& w_t = meta_of(o.w_t);
  expect_matrix(op, "dy", dy, "[T, N]");
  expect_matrix(op, "w_t", w_t, "[K, E * N] (w's column-wise copy)");
  SG_CHECK(w_t.shape.dim(1) == d.experts * dy.shape.dim(1), "op ", op, ": w_t must be [K, E * N] with E = ", d.experts,
           " and dy's N, got operands ", describe(dy), " and ", describe(w_t));
  d.tokens = dy.shape.dim(0);
  d.n = dy.shape.dim(1);
  d.k = w_t.shape.dim(0);
  d.dy_type = dy.dtype;
  expect_e4m3(op, w_t, dy, /*both=*/false);
  kernels::check_grouped_gemm(d);
  return d;
}

template <typename F>
GroupedGemmDesc describe_call(const GroupedGemmParams& p, const Fp8WgradOperands<F>& o) {
  constexpr std::string_view op = kWgrad;
  GroupedGemmDesc d = describe_common(op, GroupedGemmKind::kWgrad, p, meta_of(o.dy_scale_inv), meta_of(o.x_scale_inv),
                                      meta_of(o.offsets));
  const TensorMeta& dw = meta_of(o.dw);
  const TensorMeta& dy_t = meta_of(o.dy_t);
  const TensorMeta& x_t = meta_of(o.x_t);
  expect_matrix(op, "dy_t", dy_t, "[N, T] (dy's column-wise copy)");
  expect_matrix(op, "x_t", x_t, "[K, T] (x's column-wise copy)");
  const Shape want{d.experts, dy_t.shape.dim(0), x_t.shape.dim(0)};
  SG_CHECK(dw.dtype == DType::kFloat32 && dw.shape == want, "op ", op, ": dw must be fp32 [E, N, K] = ", want, ", got ",
           describe(dw));
  SG_CHECK(dy_t.shape.dim(1) == x_t.shape.dim(1), "op ", op, ": token counts of dy_t and x_t differ: operands ",
           describe(dy_t), " and ", describe(x_t));
  d.tokens = dy_t.shape.dim(1);
  d.n = dy_t.shape.dim(0);
  d.k = x_t.shape.dim(0);
  d.dy_type = dy_t.dtype;
  d.accumulate = p.accumulate;
  expect_e4m3(op, x_t, dy_t, /*both=*/false);
  kernels::check_grouped_gemm(d);
  return d;
}

const float* scale_of(const Operand& scale_inv) { return scale_inv.as<const float>(); }
const std::int32_t* offsets_of(const Operand& offsets) { return offsets.as<const std::int32_t>(); }

kernels::GroupedGemmOperands pointers_of(const Fp8ForwardOperands<Operand>& o, const KernelArgs& a) {
  return {.x = o.x.data,
          .w = o.w.data,
          .bias = o.bias.data,
          .offsets = offsets_of(o.offsets),
          .out = a.outputs[0],
          .x_scale_inv = scale_of(o.x_scale_inv),
          .w_scale_inv = scale_of(o.w_scale_inv)};
}

kernels::GroupedGemmOperands pointers_of(const Fp8DgradOperands<Operand>& o, const KernelArgs& a) {
  return {.w = o.w_t.data,
          .dy = o.dy.data,
          .offsets = offsets_of(o.offsets),
          .out = a.outputs[0],
          .w_scale_inv = scale_of(o.w_scale_inv),
          .dy_scale_inv = scale_of(o.dy_scale_inv)};
}

kernels::GroupedGemmOperands pointers_of(const Fp8WgradOperands<Operand>& o, const KernelArgs&) {
  return {.x = o.x_t.data,
          .dy = o.dy_t.data,
          .offsets = offsets_of(o.offsets),
          .out = o.dw.data,
          .x_scale_inv = scale_of(o.x_scale_inv),
          .dy_scale_inv = scale_of(o.dy_scale_inv)};
}

}  // namespace

const OpDef& grouped_fp8_forward_op() {
  static const OpDef op = grouped_gemm_op::define<GroupedGemmParams, Fp8ForwardOperands, kForward>();
  return op;
}
SG_REGISTER_OP(grouped_fp8_forward_op);

const OpDef& grouped_fp8_dgrad_op() {
  static const OpDef op = grouped_gemm_op::define<GroupedGemmParams, Fp8DgradOperands, kDgrad>();
  return op;
}
SG_REGISTER_OP(grouped_fp8_dgrad_op);

const OpDef& grouped_fp8_wgrad_op() {
  static const OpDef op = grouped_gemm_op::define<GroupedGemmParams, Fp8WgradOperands, kWgrad>();
  return op;
}
SG_REGISTER_OP(grouped_fp8_wgrad_op);

Tensor grouped_fp8_forward(Context& ctx, const Tensor& x, const Tensor& x_scale_inv, const Tensor& w,
                           const Tensor& w_scale_inv, const Tensor& offsets, const Tensor& bias, DType out_dtype,
                           bool split_accumulation) {
  const GroupedGemmParams params{
      .out_dtype = out_dtype, .bias = bias.defined(), .split_accumulation = split_accumulation};
  return ctx
      .call(grouped_fp8_forward_op(), params,
            flatten(kForward, params,
                    Fp8ForwardOperands<Tensor>{.x = x,
                                            .x_scale_inv = x_scale_inv,
                                            .w = w,
                                            .w_scale_inv = w_scale_inv,
                                            .offsets = offsets,
                                            .bias = bias}))
      .front();
}

Tensor grouped_fp8_dgrad(Context& ctx, const Tensor& dy, const Tensor& dy_scale_inv, const Tensor& w_t,
                         const Tensor& w_scale_inv, const Tensor& offsets, DType out_dtype, bool split_accumulation) {
  const GroupedGemmParams params{.out_dtype = out_dtype, .split_accumulation = split_accumulation};
  return ctx
      .call(
          grouped_fp8_dgrad_op(), params,
          flatten(
              kDgrad, params,
              Fp8DgradOperands<Tensor>{
                  .dy = dy, .dy_scale_inv = dy_scale_inv, .w_t = w_t, .w_scale_inv = w_scale_inv, .offsets = offsets}))
      .front();
}

void grouped_fp8_wgrad_(Context& ctx, const Tensor& dw, const Tensor& dy_t, const Tensor& dy_scale_inv,
                        const Tensor& x_t, const Tensor& x_scale_inv, const Tensor& offsets, bool accumulate,
                        bool split_accumulation) {
  const GroupedGemmParams params{
      .out_dtype = DType::kFloat32, .accumulate = accumulate, .split_accumulation = split_accumulation};
  ctx.call(grouped_fp8_wgrad_op(), params,
           flatten(kWgrad, params,
                   Fp8WgradOperands<Tensor>{.dw = dw,
                                         .dy_t = dy_t,
                                         .dy_scale_inv = dy_scale_inv,
                                         .x_t = x_t,
                                         .x_scale_inv = x_scale_inv,
                                         .offsets = offsets}));
}

}  // namespace stepgraph::ops
