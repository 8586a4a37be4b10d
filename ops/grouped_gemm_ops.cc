#include "ops/grouped_gemm_ops.h"

#include <cstdint>
#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/grouped_gemm.h"
#include "ops/grouped_gemm_op_def.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

using kernels::GroupedGemmDesc;
using kernels::GroupedGemmKind;

std::string GroupedGemmParams::to_string() const {
  char text[128];
  std::snprintf(text, sizeof(text), "out=%s%s%s%s", std::string(dtype_name(out_dtype)).c_str(), bias ? ", bias" : "",
                accumulate ? ", accumulate" : "", split_accumulation ? ", split_accumulation" : "");
  return text;
}

namespace {

std::string describe(const TensorMeta& m) {
  char text[32];
  std::snprintf(text, sizeof(text), " %s", std::string(dtype_name(m.dtype)).c_str());
  return m.shape.to_string() + text;
}

void expect_rank(std::string_view op, std::string_view role, const TensorMeta& m, int rank, std::string_view dims) {
  SG_CHECK(m.shape.rank() == rank, "op ", op, ": ", role, " must be ", rank, "-D ", dims, ", got ", describe(m));
}

// offsets int32 [E + 1]; returns E.
std::int64_t check_offsets(std::string_view op, const TensorMeta& offsets) {
  SG_CHECK(offsets.dtype == DType::kInt32 && offsets.shape.rank() == 1 && offsets.shape.dim(0) >= 2, "op ", op,
           ": offsets must be int32 [E + 1] with E >= 1 (group e = rows [offsets[e], offsets[e+1])), got ",
           describe(offsets));
  return offsets.shape.dim(0) - 1;
}

void expect_same(std::string_view op, std::string_view what, std::int64_t got, std::int64_t want,
                 const std::string& context) {
  SG_CHECK(got == want, "op ", op, ": ", what, " differ: ", got, " vs ", want, " (", context, ")");
}

void expect_dtype(std::string_view op, std::string_view role, const TensorMeta& m, DType want) {
  SG_CHECK(m.dtype == want, "op ", op, ": ", role, " must be ", dtype_name(want), " like the other operands, got ",
           describe(m));
}

// --- operands -----------------------------------------------------------------

template <typename F>
struct ForwardOperands {
  F x;        // [T, K]
  F w;        // [E, N, K]
  F offsets;  // int32 [E + 1]
  F bias;     // [E, N], with params.bias
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams& p, ForwardOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v({"w"}, o.w);
  v({"offsets"}, o.offsets);
  v({.name = "bias", .present = p.bias}, o.bias);
}

template <typename F>
struct DgradOperands {
  F dy;  // [T, N]
  F w;   // [E, N, K]
  F offsets;
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams&, DgradOperands<F>& o, V& v) {
  v({"dy"}, o.dy);
  v({"w"}, o.w);
  v({"offsets"}, o.offsets);
}

template <typename F>
struct WgradOperands {
  F dw;  // fp32 [E, N, K], written
  F dy;  // [T, N]
  F x;   // [T, K]
  F offsets;
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams&, WgradOperands<F>& o, V& v) {
  v({.name = "dw", .use = Use::kWrite}, o.dw);
  v({"dy"}, o.dy);
  v({"x"}, o.x);
  v({"offsets"}, o.offsets);
}

template <typename F>
struct BiasGradOperands {
  F db;  // fp32 [E, N], written
  F dy;  // [T, N]
  F offsets;
};

template <typename F, typename V>
void visit_operands(const GroupedGemmParams&, BiasGradOperands<F>& o, V& v) {
  v({.name = "db", .use = Use::kWrite}, o.db);
  v({"dy"}, o.dy);
  v({"offsets"}, o.offsets);
}

constexpr std::string_view kForward = "grouped_linear_forward";
constexpr std::string_view kDgrad = "grouped_linear_dgrad";
constexpr std::string_view kWgrad = "grouped_linear_wgrad_";
constexpr std::string_view kBiasGrad = "grouped_bias_grad_";

// --- the kernel descriptions of calls, after the checks of their shapes -------

// The forward's and dgrad's checks: rows `a` [T, ·] times the weights w
// [E, N, K], where a's columns are w's dimension `w_dim` (`dim_name`: K for
// the forward's x, N for dgrad's dy); returns the desc of the product.
GroupedGemmDesc describe_product(std::string_view op, GroupedGemmKind kind, const GroupedGemmParams& p,
                                 std::string_view a_name, const TensorMeta& a, std::string_view a_dims,
                                 const TensorMeta& w, int w_dim, std::string_view dim_name, const TensorMeta& offsets) {
  expect_rank(op, a_name, a, 2, a_dims);
  expect_rank(op, "w", w, 3, "[E, N, K]");
  GroupedGemmDesc d;
  d.kind = kind;
  d.experts = check_offsets(op, offsets);
  const std::string context =
      std::string(a_name) + " " + describe(a) + ", w " + describe(w) + ", offsets " + describe(offsets);
  expect_same(op, std::string(dim_name) + " of " + std::string(a_name) + " and of w", a.shape.dim(1),
              w.shape.dim(w_dim), context);
  expect_same(op, "expert counts of w and offsets", w.shape.dim(0), d.experts, context);
  expect_dtype(op, "w", w, a.dtype);
  d.tokens = a.shape.dim(0);
  d.n = w.shape.dim(1);
  d.k = w.shape.dim(2);
  d.in_type = a.dtype;
  d.out_type = p.out_dtype;
  return d;
}

template <typename F>
GroupedGemmDesc describe_call(const GroupedGemmParams& p, const ForwardOperands<F>& o) {
  const TensorMeta& w = meta_of(o.w);
  GroupedGemmDesc d = describe_product(kForward, GroupedGemmKind::kForward, p, "x", meta_of(o.x), "[T, K]", w, 2,
                                       "K", meta_of(o.offsets));
  if (p.bias) {
    const TensorMeta& bias = meta_of(o.bias);
    SG_CHECK(bias.shape == (Shape{w.shape.dim(0), w.shape.dim(1)}) && bias.dtype == w.dtype, "op ", kForward,
             ": bias must be [E, N] = ", Shape{w.shape.dim(0), w.shape.dim(1)}, " ", dtype_name(w.dtype),
             " (w's dtype), got ", describe(bias));
  }
  d.bias = p.bias;
  kernels::check_grouped_gemm(d);
  return d;
}

template <typename F>
GroupedGemmDesc describe_call(const GroupedGemmParams& p, const DgradOperands<F>& o) {
  const GroupedGemmDesc d = describe_product(kDgrad, GroupedGemmKind::kDgrad, p, "dy", meta_of(o.dy), "[T, N]",
                                             meta_of(o.w), 1, "N", meta_of(o.offsets));
  kernels::check_grouped_gemm(d);
  return d;
}

template <typename F>
GroupedGemmDesc describe_call(const GroupedGemmParams& p, const WgradOperands<F>& o) {
  constexpr std::string_view op = kWgrad;
  const TensorMeta& dw = meta_of(o.dw);
  const TensorMeta& dy = meta_of(o.dy);
  const TensorMeta& x = meta_of(o.x);
  const TensorMeta& offsets = meta_of(o.offsets);
  expect_rank(op, "dw", dw, 3, "[E, N, K]");
  expect_rank(op, "dy", dy, 2, "[T, N]");
  expect_rank(op, "x", x, 2, "[T, K]");
  GroupedGemmDesc d;
  d.kind = GroupedGemmKind::kWgrad;
  d.experts = check_offsets(op, offsets);
  const std::string context =
      "dw " + describe(dw) + ", dy " + describe(dy) + ", x " + describe(x) + ", offsets " + describe(offsets);
  SG_CHECK(dw.dtype == DType::kFloat32, "op ", op, ": dw must be fp32 (a main grad), got ", describe(dw));
  expect_same(op, "token counts of dy and x", dy.shape.dim(0), x.shape.dim(0), context);
  expect_same(op, "N of dy and of dw", dy.shape.dim(1), dw.shape.dim(1), context);
  expect_same(op, "K of x and of dw", x.shape.dim(1), dw.shape.dim(2), context);
  expect_same(op, "expert counts of dw and offsets", dw.shape.dim(0), d.experts, context);
  expect_dtype(op, "x", x, dy.dtype);
  d.tokens = dy.shape.dim(0);
  d.n = dw.shape.dim(1);
  d.k = dw.shape.dim(2);
  d.in_type = dy.dtype;
  d.out_type = DType::kFloat32;
  d.accumulate = p.accumulate;
  kernels::check_grouped_gemm(d);
  return d;
}

const std::int32_t* offsets_of(const Operand& offsets) { return offsets.as<const std::int32_t>(); }

kernels::GroupedGemmOperands pointers_of(const ForwardOperands<Operand>& o, const KernelArgs& a) {
  return {.x = o.x.data, .w = o.w.data, .bias = o.bias.data, .offsets = offsets_of(o.offsets), .out = a.outputs[0]};
}

kernels::GroupedGemmOperands pointers_of(const DgradOperands<Operand>& o, const KernelArgs& a) {
  return {.w = o.w.data, .dy = o.dy.data, .offsets = offsets_of(o.offsets), .out = a.outputs[0]};
}

kernels::GroupedGemmOperands pointers_of(const WgradOperands<Operand>& o, const KernelArgs&) {
  return {.x = o.x.data, .dy = o.dy.data, .offsets = offsets_of(o.offsets), .out = o.dw.data};
}

template <typename F>
kernels::GroupedBiasGradDesc describe_bias_grad(const GroupedGemmParams& p, const BiasGradOperands<F>& o) {
  constexpr std::string_view op = kBiasGrad;
  const TensorMeta& db = meta_of(o.db);
  const TensorMeta& dy = meta_of(o.dy);
  const TensorMeta& offsets = meta_of(o.offsets);
  expect_rank(op, "db", db, 2, "[E, N]");
  expect_rank(op, "dy", dy, 2, "[T, N]");
  kernels::GroupedBiasGradDesc d;
  d.experts = check_offsets(op, offsets);
  const std::string context = "db " + describe(db) + ", dy " + describe(dy) + ", offsets " + describe(offsets);
  SG_CHECK(db.dtype == DType::kFloat32, "op ", op, ": db must be fp32 (a main grad), got ", describe(db));
  expect_same(op, "N of dy and of db", dy.shape.dim(1), db.shape.dim(1), context);
  expect_same(op, "expert counts of db and offsets", db.shape.dim(0), d.experts, context);
  d.tokens = dy.shape.dim(0);
  d.n = dy.shape.dim(1);
  d.dy_type = dy.dtype;
  d.accumulate = p.accumulate;
  kernels::check_grouped_bias_grad(d);
  return d;
}

}  // namespace

const OpDef& grouped_linear_forward_op() {
  static const OpDef op = grouped_gemm_op::define<GroupedGemmParams, ForwardOperands, kForward>();
  return op;
}
SG_REGISTER_OP(grouped_linear_forward_op);

const OpDef& grouped_linear_dgrad_op() {
  static const OpDef op = grouped_gemm_op::define<GroupedGemmParams, DgradOperands, kDgrad>();
  return op;
}
SG_REGISTER_OP(grouped_linear_dgrad_op);

const OpDef& grouped_linear_wgrad_op() {
  static const OpDef op = grouped_gemm_op::define<GroupedGemmParams, WgradOperands, kWgrad>();
  return op;
}
SG_REGISTER_OP(grouped_linear_wgrad_op);

const OpDef& grouped_bias_grad_op() {
  static const OpDef op{
      .name = kBiasGrad,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> in) {
            const auto& p = params.as<GroupedGemmParams>();
            describe_bias_grad(p, bind_metas<BiasGradOperands>(kBiasGrad, p, in));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<BiasGradOperands, GroupedGemmParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<GroupedGemmParams>();
            const auto o = bind_args<BiasGradOperands>(p, a);
            kernels::launch_grouped_bias_grad(describe_bias_grad(p, o), o.dy.data, offsets_of(o.offsets),
                                              o.db.as<float>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<GroupedGemmParams>();
            const auto o = bind_args<BiasGradOperands>(p, a);
            kernels::host::grouped_bias_grad(describe_bias_grad(p, o), o.dy.data, offsets_of(o.offsets),
                                             o.db.as<float>());
          },
  };
  return op;
}
SG_REGISTER_OP(grouped_bias_grad_op);

Tensor grouped_linear_forward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& bias,
                              DType out_dtype) {
  const GroupedGemmParams params{.out_dtype = out_dtype, .bias = bias.defined()};
  return ctx
      .call(grouped_linear_forward_op(), params,
            flatten(kForward, params, ForwardOperands<Tensor>{.x = x, .w = w, .offsets = offsets, .bias = bias}))
      .front();
}

Tensor grouped_linear_dgrad(Context& ctx, const Tensor& dy, const Tensor& w, const Tensor& offsets, DType out_dtype) {
  const GroupedGemmParams params{.out_dtype = out_dtype};
  return ctx
      .call(grouped_linear_dgrad_op(), params,
            flatten(kDgrad, params, DgradOperands<Tensor>{.dy = dy, .w = w, .offsets = offsets}))
      .front();
}

void grouped_linear_wgrad_(Context& ctx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                           bool accumulate) {
  const GroupedGemmParams params{.out_dtype = DType::kFloat32, .accumulate = accumulate};
  ctx.call(grouped_linear_wgrad_op(), params,
           flatten(kWgrad, params, WgradOperands<Tensor>{.dw = dw, .dy = dy, .x = x, .offsets = offsets}));
}

void grouped_bias_grad_(Context& ctx, const Tensor& db, const Tensor& dy, const Tensor& offsets, bool accumulate) {
  const GroupedGemmParams params{.out_dtype = DType::kFloat32, .accumulate = accumulate};
  ctx.call(grouped_bias_grad_op(), params,
           flatten(kBiasGrad, params, BiasGradOperands<Tensor>{.db = db, .dy = dy, .offsets = offsets}));
}

}  // namespace stepgraph::ops
