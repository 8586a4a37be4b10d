#include "ops/fp8_fused_ops.h"

#include <cstdint>
#include <vector>

#include "engine/error.h"
#include "kernels/fp8_fused.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string FusedFp8Params::to_string() const {
  if (amax_only) return "amax only";
  return std::string(fp8_format_name(format)) + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "") +
         (keep_16bit ? " keep_16bit" : "");
}

std::string NormFp8Params::to_string() const { return norm.to_string() + ", " + fp8.to_string(); }

namespace {

const TensorMeta kScalar{Shape{1}, DType::kFloat32};

// --- operands ---------------------------------------------------------------------

// What every fused op writes: the 16-bit result, its FP8 copies, the amax.
template <typename F>
struct FusedOutputs {
  F value;       // the 16-bit result: keep_16bit
  F rowwise;     // FP8 [rows, cols]: rowwise
  F columnwise;  // FP8 [cols, rows]: columnwise
  F amax;        // fp32 [1]
};

template <typename F, typename V>
void visit_operands(const FusedFp8Params& p, FusedOutputs<F>& o, V& v) {
  const bool copies = !p.amax_only;
  v({.name = "value", .present = copies && p.keep_16bit}, o.value);
  v({.name = "rowwise", .present = copies && p.rowwise}, o.rowwise);
  v({.name = "columnwise", .present = copies && p.columnwise}, o.columnwise);
  v({"amax"}, o.amax);
}

bool layernorm(const NormParams& p) { return p.kind == kernels::NormKind::kLayerNorm; }

template <typename F>
struct NormFp8Inputs {
  F x;      // [rows, hidden], 16-bit
  F gamma;  // [hidden]
  F beta;   // [hidden]: LayerNorm only
  F scale;  // fp32 [1]: unless amax_only
};

template <typename F, typename V>
void visit_operands(const NormFp8Params& p, NormFp8Inputs<F>& o, V& v) {
  v({"x"}, o.x);
  v({"gamma"}, o.gamma);
  v({.name = "beta", .present = layernorm(p.norm)}, o.beta);
  v({.name = "scale", .present = !p.fp8.amax_only}, o.scale);
}

template <typename F>
struct NormFp8Outputs {
  F mean;  // fp32 [rows]: LayerNorm only
  F rstd;  // fp32 [rows]
  FusedOutputs<F> fused;
};

template <typename F, typename V>
void visit_operands(const NormFp8Params& p, NormFp8Outputs<F>& o, V& v) {
  v({.name = "mean", .present = layernorm(p.norm)}, o.mean);
  v({"rstd"}, o.rstd);
  visit_operands(p.fp8, o.fused, v);
}

template <typename F>
struct GeluFp8Inputs {
  F pre;    // [rows, cols], 16-bit
  F scale;  // fp32 [1]: unless amax_only
};

template <typename F, typename V>
void visit_operands(const FusedFp8Params& p, GeluFp8Inputs<F>& o, V& v) {
  v({"pre"}, o.pre);
  v({.name = "scale", .present = !p.amax_only}, o.scale);
}

template <typename F>
struct DgeluFp8Inputs {
  F d_act;  // [rows, cols], 16-bit
  F pre;    // like d_act
  F scale;  // fp32 [1]: unless amax_only
};

template <typename F, typename V>
void visit_operands(const FusedFp8Params& p, DgeluFp8Inputs<F>& o, V& v) {
  v({"d_act"}, o.d_act);
  v({"pre"}, o.pre);
  v({.name = "scale", .present = !p.amax_only}, o.scale);
}

constexpr std::string_view kNormFp8 = "norm_fp8";
constexpr std::string_view kGeluFp8 = "gelu_fp8";
constexpr std::string_view kDgeluFp8 = "dgelu_fp8";

// --- checks and pointers -------------------------------------------------------------

// Checks what every fused op shares: `x` the 16-bit [rows, cols] input whose
// shape the result takes, the scale (bound unless amax_only), and which
// copies; returns the fused outputs' metas.
FusedOutputs<TensorMeta> check_fused(std::string_view op, const FusedFp8Params& p, const TensorMeta& x,
                                     const TensorMeta& scale) {
  SG_CHECK(x.shape.rank() == 2, "op ", op, ": the input must be 2-D [rows, cols], got ", x.shape);
  if (!p.amax_only) {
    SG_CHECK(scale == kScalar, "op ", op, ": scale must be [1] fp32, got ", scale.shape, " ", dtype_name(scale.dtype));
  }
  SG_CHECK(p.amax_only || p.rowwise || p.columnwise || p.keep_16bit, "op ", op,
           ": asks for nothing; set rowwise, columnwise or keep_16bit, or amax_only");
  SG_CHECK(!p.columnwise || p.rowwise, "op ", op,
           ": the column-wise copy is transposed from the row-wise one; ask for rowwise too");
  const std::int64_t rows = x.shape.dim(0), cols = x.shape.dim(1);
  // The kernels' own checks (dtype, cols a multiple of 16), with stand-in pointers.
  float placeholder = 0;
  std::uint8_t byte = 0;
  kernels::check_fp8_fused(
      std::string(op).c_str(), x.dtype, rows, cols,
      {p.format, p.amax_only ? nullptr : &placeholder, p.amax_only ? nullptr : &byte, nullptr, &placeholder});
  const DType q = fp8_dtype(p.format);
  return {.value = x, .rowwise = {Shape{rows, cols}, q}, .columnwise = {Shape{cols, rows}, q}, .amax = kScalar};
}

// Where the kernels write the fused outputs; the scale is device memory for
// the kernels, host memory for the host references, which read it there.
struct FusedPointers {
  void* value = nullptr;
  kernels::Fp8Copies copies;
};

FusedPointers fused_pointers(const FusedFp8Params& p, const FusedOutputs<Operand>& out, const Operand& scale) {
  return {.value = out.value.data,
          .copies = {.format = p.format,
                     .scale = scale.as<const float>(),
                     .rowwise = out.rowwise.as<std::uint8_t>(),
                     .columnwise = out.columnwise.as<std::uint8_t>(),
                     .amax = out.amax.as<float>()}};
}

FusedFp8 fused_result(const FusedOutputs<Tensor>& r) {
  return {.value = r.value, .rowwise = r.rowwise, .columnwise = r.columnwise, .amax = r.amax};
}

kernels::NormDesc norm_desc(const NormParams& p, const TensorMeta& x) {
  return {p.kind, x.dtype, x.shape.dim(0), x.shape.dim(1), p.eps};
}

std::vector<TensorMeta> check_norm(const OpParams& params, std::span<const TensorMeta> inputs) {
  const NormFp8Params& p = params.as<NormFp8Params>();
  const auto o = bind_metas<NormFp8Inputs>(kNormFp8, p, inputs);
  SG_CHECK(o.x.shape.rank() == 2, "op norm_fp8: x must be 2-D [rows, hidden], got ", o.x.shape);
  const TensorMeta param{Shape{o.x.shape.dim(1)}, o.x.dtype};
  auto expect_param = [&](const char* name, const TensorMeta& got) {
    SG_CHECK(got == param, "op norm_fp8: ", name, " must be ", param.shape, " ", dtype_name(param.dtype), ", got ",
             got.shape, " ", dtype_name(got.dtype));
  };
  expect_param("gamma", o.gamma);
  if (layernorm(p.norm)) expect_param("beta", o.beta);
  float placeholder = 0;
  kernels::check_norm_fp8(norm_desc(p.norm, o.x), {p.fp8.format, nullptr, nullptr, nullptr, &placeholder});
  const TensorMeta stat{Shape{o.x.shape.dim(0)}, DType::kFloat32};
  return output_metas(
      p, NormFp8Outputs<TensorMeta>{.mean = stat, .rstd = stat, .fused = check_fused(kNormFp8, p.fp8, o.x, o.scale)});
}

template <template <typename> class Inputs>
std::vector<TensorMeta> check_activation(std::string_view op, const OpParams& params,
                                         std::span<const TensorMeta> inputs) {
  const FusedFp8Params& p = params.as<FusedFp8Params>();
  const auto o = bind_metas<Inputs>(op, p, inputs);
  if constexpr (requires { o.d_act; }) {
    SG_CHECK(o.pre == o.d_act, "op ", op, ": its tensors must match, got ", o.d_act.shape, " ",
             dtype_name(o.d_act.dtype), " and ", o.pre.shape, " ", dtype_name(o.pre.dtype));
  }
  return output_metas(p, check_fused(op, p, o.pre, o.scale));
}

}  // namespace

const OpDef& norm_fp8_op() {
  static const OpDef op{
      .name = kNormFp8,
      .check = check_norm,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const NormFp8Params& p = params.as<NormFp8Params>();
            const auto in = bind_args<NormFp8Inputs>(p, a);
            const auto out = bind_outputs<NormFp8Outputs>(p, a);
            const FusedPointers f = fused_pointers(p.fp8, out.fused, in.scale);
            kernels::launch_norm_fp8(norm_desc(p.norm, *in.x.meta), in.x.data, in.gamma.data, in.beta.data, f.value,
                                     out.mean.as<float>(), out.rstd.as<float>(), f.copies, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const NormFp8Params& p = params.as<NormFp8Params>();
            const auto in = bind_args<NormFp8Inputs>(p, a);
            const auto out = bind_outputs<NormFp8Outputs>(p, a);
            const FusedPointers f = fused_pointers(p.fp8, out.fused, in.scale);
            kernels::host::norm_fp8(norm_desc(p.norm, *in.x.meta), in.x.data, in.gamma.data, in.beta.data, f.value,
                                    out.mean.as<float>(), out.rstd.as<float>(), f.copies);
          },
  };
  return op;
}
SG_REGISTER_OP(norm_fp8_op);

const OpDef& gelu_fp8_op() {
  static const OpDef op{
      .name = kGeluFp8,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> inputs) {
            return check_activation<GeluFp8Inputs>(kGeluFp8, params, inputs);
          },
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const auto in = bind_args<GeluFp8Inputs>(p, a);
            const FusedPointers f = fused_pointers(p, bind_outputs<FusedOutputs>(p, a), in.scale);
            kernels::launch_gelu_fp8(in.pre.dtype(), in.pre.shape().dim(0), in.pre.shape().dim(1), in.pre.data, f.value,
                                     f.copies, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const auto in = bind_args<GeluFp8Inputs>(p, a);
            const FusedPointers f = fused_pointers(p, bind_outputs<FusedOutputs>(p, a), in.scale);
            kernels::host::gelu_fp8(in.pre.dtype(), in.pre.shape().dim(0), in.pre.shape().dim(1), in.pre.data, f.value,
                                    f.copies);
          },
  };
  return op;
}
SG_REGISTER_OP(gelu_fp8_op);

const OpDef& dgelu_fp8_op() {
  static const OpDef op{
      .name = kDgeluFp8,
      .check =
          [](const OpParams& params, std::span<const TensorMeta> inputs) {
            return check_activation<DgeluFp8Inputs>(kDgeluFp8, params, inputs);
          },
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const auto in = bind_args<DgeluFp8Inputs>(p, a);
            const FusedPointers f = fused_pointers(p, bind_outputs<FusedOutputs>(p, a), in.scale);
            kernels::launch_dgelu_fp8(in.d_act.dtype(), in.d_act.shape().dim(0), in.d_act.shape().dim(1), in.d_act.data,
                                      in.pre.data, f.value, f.copies, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const auto in = bind_args<DgeluFp8Inputs>(p, a);
            const FusedPointers f = fused_pointers(p, bind_outputs<FusedOutputs>(p, a), in.scale);
            kernels::host::dgelu_fp8(in.d_act.dtype(), in.d_act.shape().dim(0), in.d_act.shape().dim(1), in.d_act.data,
                                     in.pre.data, f.value, f.copies);
          },
  };
  return op;
}
SG_REGISTER_OP(dgelu_fp8_op);

NormFp8 norm_fp8(Context& ctx, const NormFp8Params& params, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                 const Tensor& scale) {
  const NormFp8Inputs<Tensor> in{.x = x,
                                 .gamma = gamma,
                                 .beta = layernorm(params.norm) ? beta : Tensor(),
                                 .scale = params.fp8.amax_only ? Tensor() : scale};
  const auto r = bind_results<NormFp8Outputs>(params, ctx.call(norm_fp8_op(), params, flatten(kNormFp8, params, in)));
  return {.out = fused_result(r.fused), .mean = r.mean, .rstd = r.rstd};
}

FusedFp8 gelu_fp8(Context& ctx, const Tensor& pre, const Tensor& scale, const FusedFp8Params& params) {
  const GeluFp8Inputs<Tensor> in{.pre = pre, .scale = params.amax_only ? Tensor() : scale};
  return fused_result(
      bind_results<FusedOutputs>(params, ctx.call(gelu_fp8_op(), params, flatten(kGeluFp8, params, in))));
}

FusedFp8 dgelu_fp8(Context& ctx, const Tensor& d_act, const Tensor& pre, const Tensor& scale,
                   const FusedFp8Params& params) {
  const DgeluFp8Inputs<Tensor> in{.d_act = d_act, .pre = pre, .scale = params.amax_only ? Tensor() : scale};
  return fused_result(
      bind_results<FusedOutputs>(params, ctx.call(dgelu_fp8_op(), params, flatten(kDgeluFp8, params, in))));
}

}  // namespace stepgraph::ops
