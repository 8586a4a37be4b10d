#include "ops/fp8_fused_ops.h"

#include <cstdint>
#include <vector>

#include "engine/error.h"
#include "kernels/fp8_fused.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::string FusedFp8Params::to_string() const {
  if (amax_only) return "amax only";
  return std::string(fp8_format_name(format)) + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "") +
         (keep_16bit ? " keep_16bit" : "");
}

std::string NormFp8Params::to_string() const { return norm.to_string() + ", " + fp8.to_string(); }

namespace {

const TensorMeta kScalar{Shape{1}, DType::kFloat32};

// Checks what every fused op shares: `x` the 16-bit [rows, cols] input whose
// shape the result takes, the scale input when not amax_only, and which
// copies. Appends the fused outputs ([value] [rowwise] [columnwise] amax).
void check_fused(std::string_view op, const FusedFp8Params& p, const TensorMeta& x, std::span<const TensorMeta> scale,
                 std::vector<TensorMeta>& out) {
  SG_CHECK(x.shape.rank() == 2, "op ", op, ": the input must be 2-D [rows, cols], got ", x.shape);
  SG_CHECK(p.amax_only == scale.empty(), "op ", op, ": ",
           p.amax_only ? "amax_only takes no scale" : "takes the scale ([1] fp32) as its last input");
  if (!scale.empty()) {
    SG_CHECK(scale[0] == kScalar, "op ", op, ": scale must be [1] fp32, got ", scale[0].shape, " ",
             dtype_name(scale[0].dtype));
  }
  SG_CHECK(p.amax_only || p.rowwise || p.columnwise || p.keep_16bit, "op ", op,
           ": asks for nothing; set rowwise, columnwise or keep_16bit, or amax_only");
  SG_CHECK(!p.columnwise || p.rowwise, "op ", op,
           ": the column-wise copy is transposed from the row-wise one; ask for rowwise too");
  const std::int64_t rows = x.shape.dim(0), cols = x.shape.dim(1);
  // The kernels' own checks (dtype, cols a multiple of 16), with stand-in pointers.
  float placeholder = 0;
  std::uint8_t byte = 0;
  kernels::check_fp8_fused(std::string(op).c_str(), x.dtype, rows, cols,
                           {p.format, p.amax_only ? nullptr : &placeholder, p.amax_only ? nullptr : &byte, nullptr,
                            &placeholder});
  const bool copies = !p.amax_only;
  const DType q = fp8_dtype(p.format);
  if (copies && p.keep_16bit) out.push_back(x);
  if (copies && p.rowwise) out.push_back({Shape{rows, cols}, q});
  if (copies && p.columnwise) out.push_back({Shape{cols, rows}, q});
  out.push_back(kScalar);
}

// The fused outputs from `first` on, and where the kernels write them.
struct FusedPointers {
  void* value = nullptr;
  kernels::Fp8Copies copies;
};

FusedPointers fused_pointers(const FusedFp8Params& p, const KernelArgs& a, std::size_t first, const void* scale) {
  FusedPointers f;
  f.copies.format = p.format;
  std::size_t next = first;
  if (!p.amax_only) {
    f.copies.scale = static_cast<const float*>(scale);
    if (p.keep_16bit) f.value = a.outputs[next++];
    if (p.rowwise) f.copies.rowwise = static_cast<std::uint8_t*>(a.outputs[next++]);
    if (p.columnwise) f.copies.columnwise = static_cast<std::uint8_t*>(a.outputs[next++]);
  }
  f.copies.amax = static_cast<float*>(a.outputs[next]);
  return f;
}

FusedFp8 fused_result(const FusedFp8Params& p, const std::vector<Tensor>& out, std::size_t first) {
  FusedFp8 r;
  std::size_t next = first;
  if (!p.amax_only) {
    if (p.keep_16bit) r.value = out[next++];
    if (p.rowwise) r.rowwise = out[next++];
    if (p.columnwise) r.columnwise = out[next++];
  }
  r.amax = out[next];
  return r;
}

// The scale, the last input (device memory for the kernels, host memory for
// the host references, which read it there).
const void* scale_input(const FusedFp8Params& p, const KernelArgs& a) {
  return p.amax_only ? nullptr : a.inputs.back();
}

bool layernorm(const NormParams& p) { return p.kind == kernels::NormKind::kLayerNorm; }

kernels::NormDesc norm_desc(const NormParams& p, const TensorMeta& x) {
  return {p.kind, x.dtype, x.shape.dim(0), x.shape.dim(1), p.eps};
}

// Inputs: x, gamma, [beta], [scale]. Outputs: [mean], rstd, then the fused ones.
std::vector<TensorMeta> check_norm(const OpParams& params, std::span<const TensorMeta> inputs) {
  const NormFp8Params& p = params.as<NormFp8Params>();
  const std::size_t arity = (layernorm(p.norm) ? 3 : 2) + (p.fp8.amax_only ? 0 : 1);
  SG_CHECK(inputs.size() == arity, "op norm_fp8 (", p.to_string(), ") takes ", arity, " inputs, got ",
           inputs.size());
  SG_CHECK(inputs[0].shape.rank() == 2, "op norm_fp8: x must be 2-D [rows, hidden], got ", inputs[0].shape);
  const TensorMeta param{Shape{inputs[0].shape.dim(1)}, inputs[0].dtype};
  const std::size_t params_end = layernorm(p.norm) ? 3 : 2;
  for (std::size_t i = 1; i < params_end; ++i) {
    SG_CHECK(inputs[i] == param, "op norm_fp8: ", i == 1 ? "gamma" : "beta", " must be ", param.shape, " ",
             dtype_name(param.dtype), ", got ", inputs[i].shape, " ", dtype_name(inputs[i].dtype));
  }
  float placeholder = 0;
  kernels::check_norm_fp8(norm_desc(p.norm, inputs[0]), {p.fp8.format, nullptr, nullptr, nullptr, &placeholder});
  const TensorMeta stat{Shape{inputs[0].shape.dim(0)}, DType::kFloat32};
  std::vector<TensorMeta> out;
  if (layernorm(p.norm)) out.push_back(stat);
  out.push_back(stat);
  check_fused("norm_fp8", p.fp8, inputs[0], inputs.subspan(params_end), out);
  return out;
}

struct NormPointers {
  const void* beta = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  FusedPointers fused;
};

NormPointers norm_pointers(const NormFp8Params& p, const KernelArgs& a) {
  NormPointers n;
  if (layernorm(p.norm)) n.beta = a.inputs[2];
  std::size_t next = 0;
  if (layernorm(p.norm)) n.mean = static_cast<float*>(a.outputs[next++]);
  n.rstd = static_cast<float*>(a.outputs[next++]);
  n.fused = fused_pointers(p.fp8, a, next, scale_input(p.fp8, a));
  return n;
}

// GeLU: inputs pre, [scale]; dGeLU: d_act, pre, [scale]. Outputs: the fused ones.
template <std::size_t kTensors>
std::vector<TensorMeta> check_activation(std::string_view op, const OpParams& params,
                                         std::span<const TensorMeta> inputs) {
  const FusedFp8Params& p = params.as<FusedFp8Params>();
  const std::size_t arity = kTensors + (p.amax_only ? 0 : 1);
  SG_CHECK(inputs.size() == arity, "op ", op, " (", p.to_string(), ") takes ", arity, " inputs, got ",
           inputs.size());
  for (std::size_t i = 1; i < kTensors; ++i) {
    SG_CHECK(inputs[i] == inputs[0], "op ", op, ": its tensors must match, got ", inputs[0].shape, " ",
             dtype_name(inputs[0].dtype), " and ", inputs[i].shape, " ", dtype_name(inputs[i].dtype));
  }
  std::vector<TensorMeta> out;
  check_fused(op, p, inputs[0], inputs.subspan(kTensors), out);
  return out;
}

}  // namespace

const OpDef& norm_fp8_op() {
  static const OpDef op{
      .name = "norm_fp8",
      .check = check_norm,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const NormFp8Params& p = params.as<NormFp8Params>();
            const NormPointers n = norm_pointers(p, a);
            kernels::launch_norm_fp8(norm_desc(p.norm, a.input_metas[0]), a.inputs[0], a.inputs[1], n.beta,
                                     n.fused.value, n.mean, n.rstd, n.fused.copies, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const NormFp8Params& p = params.as<NormFp8Params>();
            const NormPointers n = norm_pointers(p, a);
            kernels::host::norm_fp8(norm_desc(p.norm, a.input_metas[0]), a.inputs[0], a.inputs[1], n.beta,
                                    n.fused.value, n.mean, n.rstd, n.fused.copies);
          },
  };
  return op;
}
SG_REGISTER_OP(norm_fp8_op);

const OpDef& gelu_fp8_op() {
  static const OpDef op{
      .name = "gelu_fp8",
      .check = [](const OpParams& params,
                  std::span<const TensorMeta> inputs) { return check_activation<1>("gelu_fp8", params, inputs); },
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const FusedPointers f = fused_pointers(p, a, 0, scale_input(p, a));
            const TensorMeta& pre = a.input_metas[0];
            kernels::launch_gelu_fp8(pre.dtype, pre.shape.dim(0), pre.shape.dim(1), a.inputs[0], f.value, f.copies,
                                     stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const FusedPointers f = fused_pointers(p, a, 0, scale_input(p, a));
            const TensorMeta& pre = a.input_metas[0];
            kernels::host::gelu_fp8(pre.dtype, pre.shape.dim(0), pre.shape.dim(1), a.inputs[0], f.value, f.copies);
          },
  };
  return op;
}
SG_REGISTER_OP(gelu_fp8_op);

const OpDef& dgelu_fp8_op() {
  static const OpDef op{
      .name = "dgelu_fp8",
      .check = [](const OpParams& params,
                  std::span<const TensorMeta> inputs) { return check_activation<2>("dgelu_fp8", params, inputs); },
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const FusedPointers f = fused_pointers(p, a, 0, scale_input(p, a));
            const TensorMeta& d = a.input_metas[0];
            kernels::launch_dgelu_fp8(d.dtype, d.shape.dim(0), d.shape.dim(1), a.inputs[0], a.inputs[1], f.value,
                                      f.copies, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const FusedFp8Params& p = params.as<FusedFp8Params>();
            const FusedPointers f = fused_pointers(p, a, 0, scale_input(p, a));
            const TensorMeta& d = a.input_metas[0];
            kernels::host::dgelu_fp8(d.dtype, d.shape.dim(0), d.shape.dim(1), a.inputs[0], a.inputs[1], f.value,
                                     f.copies);
          },
  };
  return op;
}
SG_REGISTER_OP(dgelu_fp8_op);

NormFp8 norm_fp8(Context& ctx, const NormFp8Params& params, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                 const Tensor& scale) {
  std::vector<Tensor> inputs{x, gamma};
  if (layernorm(params.norm)) inputs.push_back(beta);
  if (!params.fp8.amax_only) inputs.push_back(scale);
  const std::vector<Tensor> out = ctx.call(norm_fp8_op(), params, inputs);
  NormFp8 r;
  std::size_t next = 0;
  if (layernorm(params.norm)) r.mean = out[next++];
  r.rstd = out[next++];
  r.out = fused_result(params.fp8, out, next);
  return r;
}

FusedFp8 gelu_fp8(Context& ctx, const Tensor& pre, const Tensor& scale, const FusedFp8Params& params) {
  std::vector<Tensor> inputs{pre};
  if (!params.amax_only) inputs.push_back(scale);
  return fused_result(params, ctx.call(gelu_fp8_op(), params, inputs), 0);
}

FusedFp8 dgelu_fp8(Context& ctx, const Tensor& d_act, const Tensor& pre, const Tensor& scale,
                   const FusedFp8Params& params) {
  std::vector<Tensor> inputs{d_act, pre};
  if (!params.amax_only) inputs.push_back(scale);
  return fused_result(params, ctx.call(dgelu_fp8_op(), params, inputs), 0);
}

}  // namespace stepgraph::ops
