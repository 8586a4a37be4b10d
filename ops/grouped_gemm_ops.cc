#include "ops/grouped_gemm_ops.h"

#include <cstdint>
#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/grouped_gemm.h"
#include "ops/op_registration.h"

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

// The kernel description of a call, after the checks of its shapes.
GroupedGemmDesc describe_call(GroupedGemmKind kind, const GroupedGemmParams& p, std::span<const TensorMeta> in) {
  GroupedGemmDesc d;
  d.kind = kind;
  switch (kind) {
    case GroupedGemmKind::kForward: {  // x [T,K], w [E,N,K], offsets[, bias [E,N]]
      constexpr std::string_view op = "grouped_linear_forward";
      SG_CHECK(in.size() == (p.bias ? 4u : 3u), "op ", op, " takes x, w, offsets", p.bias ? ", bias" : "", "; got ",
               in.size(), " inputs");
      const TensorMeta& x = in[0];
      const TensorMeta& w = in[1];
      expect_rank(op, "x", x, 2, "[T, K]");
      expect_rank(op, "w", w, 3, "[E, N, K]");
      d.experts = check_offsets(op, in[2]);
      const std::string context = "x " + describe(x) + ", w " + describe(w) + ", offsets " + describe(in[2]);
      expect_same(op, "K of x and of w", x.shape.dim(1), w.shape.dim(2), context);
      expect_same(op, "expert counts of w and offsets", w.shape.dim(0), d.experts, context);
      expect_dtype(op, "w", w, x.dtype);
      if (p.bias) {
        SG_CHECK(in[3].shape == (Shape{w.shape.dim(0), w.shape.dim(1)}) && in[3].dtype == w.dtype, "op ", op,
                 ": bias must be [E, N] = ", Shape{w.shape.dim(0), w.shape.dim(1)}, " ", dtype_name(w.dtype),
                 " (w's dtype), got ", describe(in[3]));
      }
      d.tokens = x.shape.dim(0);
      d.n = w.shape.dim(1);
      d.k = w.shape.dim(2);
      d.in_type = x.dtype;
      d.out_type = p.out_dtype;
      d.bias = p.bias;
      break;
    }
    case GroupedGemmKind::kDgrad: {  // dy [T,N], w [E,N,K], offsets
      constexpr std::string_view op = "grouped_linear_dgrad";
      SG_CHECK(in.size() == 3, "op ", op, " takes dy, w, offsets; got ", in.size(), " inputs");
      const TensorMeta& dy = in[0];
      const TensorMeta& w = in[1];
      expect_rank(op, "dy", dy, 2, "[T, N]");
      expect_rank(op, "w", w, 3, "[E, N, K]");
      d.experts = check_offsets(op, in[2]);
      const std::string context = "dy " + describe(dy) + ", w " + describe(w) + ", offsets " + describe(in[2]);
      expect_same(op, "N of dy and of w", dy.shape.dim(1), w.shape.dim(1), context);
      expect_same(op, "expert counts of w and offsets", w.shape.dim(0), d.experts, context);
      expect_dtype(op, "w", w, dy.dtype);
      d.tokens = dy.shape.dim(0);
      d.n = w.shape.dim(1);
      d.k = w.shape.dim(2);
      d.in_type = dy.dtype;
      d.out_type = p.out_dtype;
      break;
    }
    case GroupedGemmKind::kWgrad: {  // dw [E,N,K] fp32, dy [T,N], x [T,K], offsets
      constexpr std::string_view op = "grouped_linear_wgrad_";
      SG_CHECK(in.size() == 4, "op ", op, " takes dw, dy, x, offsets; got ", in.size(), " inputs");
      const TensorMeta& dw = in[0];
      const TensorMeta& dy = in[1];
      const TensorMeta& x = in[2];
      expect_rank(op, "dw", dw, 3, "[E, N, K]");
      expect_rank(op, "dy", dy, 2, "[T, N]");
      expect_rank(op, "x", x, 2, "[T, K]");
      d.experts = check_offsets(op, in[3]);
      const std::string context =
          "dw " + describe(dw) + ", dy " + describe(dy) + ", x " + describe(x) + ", offsets " + describe(in[3]);
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
      break;
    }
  }
  kernels::check_grouped_gemm(d);
  return d;
}

kernels::GroupedGemmOperands operands_of(GroupedGemmKind kind, const GroupedGemmParams& p, const KernelArgs& a) {
  kernels::GroupedGemmOperands o;
  switch (kind) {
    case GroupedGemmKind::kForward:
      o = {.x = a.inputs[0], .w = a.inputs[1], .offsets = static_cast<const std::int32_t*>(a.inputs[2])};
      if (p.bias) o.bias = a.inputs[3];
      o.out = a.outputs[0];
      break;
    case GroupedGemmKind::kDgrad:
      o = {.w = a.inputs[1], .dy = a.inputs[0], .offsets = static_cast<const std::int32_t*>(a.inputs[2])};
      o.out = a.outputs[0];
      break;
    case GroupedGemmKind::kWgrad:
      o = {.x = a.inputs[2], .dy = a.inputs[1], .offsets = static_cast<const std::int32_t*>(a.inputs[3])};
      o.out = a.inputs[0];
      break;
  }
  return o;
}

template <GroupedGemmKind kKind>
std::vector<TensorMeta> check_gemm(const OpParams& params, std::span<const TensorMeta> inputs) {
  const GroupedGemmParams& p = params.as<GroupedGemmParams>();
  const GroupedGemmDesc d = describe_call(kKind, p, inputs);
  switch (kKind) {
    case GroupedGemmKind::kForward: return {{Shape{d.tokens, d.n}, d.out_type}};
    case GroupedGemmKind::kDgrad: return {{Shape{d.tokens, d.k}, d.out_type}};
    case GroupedGemmKind::kWgrad: return {};
  }
  return {};
}

template <GroupedGemmKind kKind>
void launch_gemm(const OpParams& params, const KernelArgs& args, CUstream_st* stream) {
  const GroupedGemmParams& p = params.as<GroupedGemmParams>();
  kernels::launch_grouped_gemm(describe_call(kKind, p, args.input_metas), operands_of(kKind, p, args), stream);
}

template <GroupedGemmKind kKind>
void run_gemm_host(const OpParams& params, const KernelArgs& args) {
  const GroupedGemmParams& p = params.as<GroupedGemmParams>();
  kernels::host::grouped_gemm(describe_call(kKind, p, args.input_metas), operands_of(kKind, p, args));
}

// db [E,N] fp32, dy [T,N], offsets.
kernels::GroupedBiasGradDesc describe_bias_grad(const GroupedGemmParams& p, std::span<const TensorMeta> in) {
  constexpr std::string_view op = "grouped_bias_grad_";
  SG_CHECK(in.size() == 3, "op ", op, " takes db, dy, offsets; got ", in.size(), " inputs");
  const TensorMeta& db = in[0];
  const TensorMeta& dy = in[1];
  expect_rank(op, "db", db, 2, "[E, N]");
  expect_rank(op, "dy", dy, 2, "[T, N]");
  kernels::GroupedBiasGradDesc d;
  d.experts = check_offsets(op, in[2]);
  const std::string context = "db " + describe(db) + ", dy " + describe(dy) + ", offsets " + describe(in[2]);
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
  static const OpDef op{
      .name = "grouped_linear_forward",
      .check = check_gemm<GroupedGemmKind::kForward>,
      .launch_cuda = launch_gemm<GroupedGemmKind::kForward>,
      .run_host = run_gemm_host<GroupedGemmKind::kForward>,
  };
  return op;
}
SG_REGISTER_OP(grouped_linear_forward_op);

const OpDef& grouped_linear_dgrad_op() {
  static const OpDef op{
      .name = "grouped_linear_dgrad",
      .check = check_gemm<GroupedGemmKind::kDgrad>,
      .launch_cuda = launch_gemm<GroupedGemmKind::kDgrad>,
      .run_host = run_gemm_host<GroupedGemmKind::kDgrad>,
  };
  return op;
}
SG_REGISTER_OP(grouped_linear_dgrad_op);

const OpDef& grouped_linear_wgrad_op() {
  static const OpDef op{
      .name = "grouped_linear_wgrad_",
      .check = check_gemm<GroupedGemmKind::kWgrad>,
      .mutated_inputs = {0},
      .launch_cuda = launch_gemm<GroupedGemmKind::kWgrad>,
      .run_host = run_gemm_host<GroupedGemmKind::kWgrad>,
  };
  return op;
}
SG_REGISTER_OP(grouped_linear_wgrad_op);

const OpDef& grouped_bias_grad_op() {
  static const OpDef op{
      .name = "grouped_bias_grad_",
      .check =
          [](const OpParams& params, std::span<const TensorMeta> in) {
            describe_bias_grad(params.as<GroupedGemmParams>(), in);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_grouped_bias_grad(describe_bias_grad(params.as<GroupedGemmParams>(), a.input_metas),
                                              a.inputs[1], static_cast<const std::int32_t*>(a.inputs[2]),
                                              static_cast<float*>(a.inputs[0]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::grouped_bias_grad(describe_bias_grad(params.as<GroupedGemmParams>(), a.input_metas),
                                             a.inputs[1], static_cast<const std::int32_t*>(a.inputs[2]),
                                             static_cast<float*>(a.inputs[0]));
          },
  };
  return op;
}
SG_REGISTER_OP(grouped_bias_grad_op);

Tensor grouped_linear_forward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& bias,
                              DType out_dtype) {
  std::vector<Tensor> inputs{x, w, offsets};
  if (bias.defined()) inputs.push_back(bias);
  return ctx
      .call(grouped_linear_forward_op(), GroupedGemmParams{.out_dtype = out_dtype, .bias = bias.defined()},
            std::move(inputs))
      .front();
}

Tensor grouped_linear_dgrad(Context& ctx, const Tensor& dy, const Tensor& w, const Tensor& offsets, DType out_dtype) {
  return ctx.call(grouped_linear_dgrad_op(), GroupedGemmParams{.out_dtype = out_dtype}, {dy, w, offsets}).front();
}

void grouped_linear_wgrad_(Context& ctx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                           bool accumulate) {
  ctx.call(grouped_linear_wgrad_op(), GroupedGemmParams{.out_dtype = DType::kFloat32, .accumulate = accumulate},
           {dw, dy, x, offsets});
}

void grouped_bias_grad_(Context& ctx, const Tensor& db, const Tensor& dy, const Tensor& offsets, bool accumulate) {
  ctx.call(grouped_bias_grad_op(), GroupedGemmParams{.out_dtype = DType::kFloat32, .accumulate = accumulate},
           {db, dy, offsets});
}

}  // namespace stepgraph::ops
