#include "ops/fp8_ops.h"

#include <vector>

#include "engine/error.h"
#include "kernels/fp8_quantize.h"

namespace stepgraph::ops {

std::string QuantizeParams::to_string() const {
  return std::string(fp8_format_name(format)) + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "");
}

namespace {

kernels::QuantizeDesc describe(const QuantizeParams& p, const TensorMeta& x) {
  kernels::QuantizeDesc desc;
  desc.in_dtype = x.dtype;
  desc.format = p.format;
  desc.rows = x.shape.dim(0);
  desc.cols = x.shape.dim(1);
  desc.rowwise = p.rowwise;
  desc.columnwise = p.columnwise;
  return desc;
}

std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const QuantizeParams& p = params.as<QuantizeParams>();
  SG_CHECK(inputs.size() == 2, "op quantize takes x and scale, got ", inputs.size(), " inputs");
  SG_CHECK(inputs[0].shape.rank() == 2, "op quantize: x must be 2-D [rows, cols], got ", inputs[0].shape);
  SG_CHECK(inputs[1] == (TensorMeta{Shape{1}, DType::kFloat32}), "op quantize: scale must be [1] fp32, got ",
           inputs[1].shape, " ", dtype_name(inputs[1].dtype));
  const kernels::QuantizeDesc desc = describe(p, inputs[0]);
  kernels::check_quantize(desc);
  const DType q = fp8_dtype(p.format);
  std::vector<TensorMeta> out;
  if (p.rowwise) out.push_back({Shape{desc.rows, desc.cols}, q});
  if (p.columnwise) out.push_back({Shape{desc.cols, desc.rows}, q});
  out.push_back({Shape{1}, DType::kFloat32});
  return out;
}

struct Pointers {
  std::uint8_t* rowwise = nullptr;
  std::uint8_t* columnwise = nullptr;
  float* amax = nullptr;
};

Pointers pointers(const QuantizeParams& p, const KernelArgs& a) {
  Pointers out;
  std::size_t next = 0;
  if (p.rowwise) out.rowwise = static_cast<std::uint8_t*>(a.outputs[next++]);
  if (p.columnwise) out.columnwise = static_cast<std::uint8_t*>(a.outputs[next++]);
  out.amax = static_cast<float*>(a.outputs[next]);
  return out;
}

}  // namespace

const OpDef& quantize_op() {
  static const OpDef op{
      .name = "quantize",
      .check = check,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const QuantizeParams& p = params.as<QuantizeParams>();
            const Pointers out = pointers(p, a);
            kernels::launch_quantize(describe(p, a.input_metas[0]), a.inputs[0],
                                     static_cast<const float*>(a.inputs[1]), out.rowwise, out.columnwise, out.amax,
                                     stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const QuantizeParams& p = params.as<QuantizeParams>();
            const Pointers out = pointers(p, a);
            kernels::quantize_host(describe(p, a.input_metas[0]), a.inputs[0],
                                   *static_cast<const float*>(a.inputs[1]), out.rowwise, out.columnwise, out.amax);
          },
  };
  return op;
}

Quantized quantize(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params) {
  std::vector<Tensor> out = ctx.call(quantize_op(), params, {x, scale});
  Quantized result;
  std::size_t next = 0;
  if (params.rowwise) result.rowwise = out[next++];
  if (params.columnwise) result.columnwise = out[next++];
  result.amax = out[next];
  return result;
}

}  // namespace stepgraph::ops
