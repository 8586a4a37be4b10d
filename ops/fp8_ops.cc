#include "ops/fp8_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/error.h"
#include "kernels/fp8_fused.h"
#include "kernels/fp8_quantize.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::string QuantizeParams::to_string() const {
  return std::string(fp8_format_name(format)) + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "");
}

std::string ScaleFromAmaxParams::to_string() const {
  return std::string(fp8_format_name(format)) + (power_of_two ? " power_of_two" : "");
}

std::string DelayedScalingParams::to_string() const {
  return std::string(fp8_format_name(format)) + " " + recipe.to_string();
}

namespace {

// Tensor-wise quantize and amax read x of rank >= 2 as the matrix [rows,
// cols] of its last dimension and the product of the others (a GroupedLinear
// weight [E, N, K] as [E * N, K]).
std::int64_t matrix_cols(const Shape& shape) { return shape.dim(shape.rank() - 1); }
std::int64_t matrix_rows(const Shape& shape) { return shape.numel() / std::max<std::int64_t>(1, matrix_cols(shape)); }

kernels::QuantizeDesc describe(const QuantizeParams& p, const TensorMeta& x) {
  kernels::QuantizeDesc desc;
  desc.in_dtype = x.dtype;
  desc.format = p.format;
  desc.rows = matrix_rows(x.shape);
  desc.cols = matrix_cols(x.shape);
  desc.rowwise = p.rowwise;
  desc.columnwise = p.columnwise;
  return desc;
}

std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const QuantizeParams& p = params.as<QuantizeParams>();
  SG_CHECK(inputs.size() == 2, "op quantize takes x and scale, got ", inputs.size(), " inputs");
  SG_CHECK(inputs[0].shape.rank() >= 2, "op quantize: x must be [rows, cols] (or [..., cols], read as rows of its last "
           "dimension), got ", inputs[0].shape);
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
            const kernels::QuantizeDesc desc = describe(p, a.input_metas[0]);
            const auto* scale = static_cast<const float*>(a.inputs[1]);
            // The vectorised tile kernel where it applies (16-bit x), the general one otherwise: the same bytes.
            if (!kernels::launch_quantize_vectorized(desc.in_dtype, desc.rows, desc.cols, a.inputs[0],
                                                     {desc.format, scale, out.rowwise, out.columnwise, out.amax},
                                                     stream)) {
              kernels::launch_quantize(desc, a.inputs[0], scale, out.rowwise, out.columnwise, out.amax, stream);
            }
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
SG_REGISTER_OP(quantize_op);

namespace {

// quantize_into_: inputs x, scale, then the copies asked for and amax, written in place.
std::vector<TensorMeta> check_into(const OpParams& params, std::span<const TensorMeta> inputs) {
  const QuantizeParams& p = params.as<QuantizeParams>();
  const std::size_t copies = (p.rowwise ? 1u : 0u) + (p.columnwise ? 1u : 0u);
  SG_CHECK(inputs.size() == 3 + copies, "op quantize_into_ takes x, scale, ", copies, " destination copies and amax, got ",
           inputs.size(), " inputs");
  const std::vector<TensorMeta> want = check(params, inputs.subspan(0, 2));
  for (std::size_t i = 0; i < want.size(); ++i) {
    SG_CHECK(inputs[2 + i] == want[i], "op quantize_into_: destination ", i, " must be ", want[i].shape, " ",
             dtype_name(want[i].dtype), ", got ", inputs[2 + i].shape, " ", dtype_name(inputs[2 + i].dtype));
  }
  return {};
}

std::vector<int> into_mutated(const OpParams& params, std::size_t input_count) {
  (void)params;
  std::vector<int> out;
  for (std::size_t i = 2; i < input_count; ++i) out.push_back(static_cast<int>(i));
  return out;
}

// The destination pointers of quantize_into_ as quantize's outputs.
KernelArgs as_outputs(const KernelArgs& a) {
  return {a.inputs.subspan(0, 2), a.input_metas.subspan(0, 2), a.inputs.subspan(2), a.input_metas.subspan(2)};
}

}  // namespace

const OpDef& quantize_into_op() {
  static const OpDef op{
      .name = "quantize_into_",
      .check = check_into,
      .mutated_inputs_for = into_mutated,
      .launch_cuda = [](const OpParams& params, const KernelArgs& a,
                        CUstream_st* stream) { quantize_op().launch_cuda(params, as_outputs(a), stream); },
      .run_host = [](const OpParams& params, const KernelArgs& a) { quantize_op().run_host(params, as_outputs(a)); },
  };
  return op;
}
SG_REGISTER_OP(quantize_into_op);

std::string BlockQuantizeParams::to_string() const {
  return std::string(fp8_format_name(format)) + (shape == kernels::BlockShape::k1x128 ? " 1x128" : " 128x128") +
         (power_of_two ? " power_of_two" : "") + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "");
}

namespace {

kernels::QuantizeDesc describe_blocks(const BlockQuantizeParams& p, const TensorMeta& x) {
  return {x.dtype, p.format, x.shape.dim(0), x.shape.dim(1), p.rowwise, p.columnwise};
}

// Outputs: [rowwise, its scales], [columnwise, its scales], non_finite.
std::vector<TensorMeta> check_blocks(const OpParams& params, std::span<const TensorMeta> inputs) {
  const BlockQuantizeParams& p = params.as<BlockQuantizeParams>();
  SG_CHECK(inputs.size() == 1, "op quantize_blocks takes x, got ", inputs.size(), " inputs");
  SG_CHECK(inputs[0].shape.rank() == 2, "op quantize_blocks: x must be 2-D [rows, cols], got ", inputs[0].shape);
  const kernels::QuantizeDesc desc = describe_blocks(p, inputs[0]);
  kernels::check_block_quantize(desc, p.shape);
  const DType q = fp8_dtype(p.format);
  auto scales = [&](std::int64_t outer, std::int64_t k) {
    return TensorMeta{Shape{kernels::BlockScaleLayout{p.shape, outer, k}.count()}, DType::kFloat32};
  };
  std::vector<TensorMeta> out;
  if (p.rowwise) {
    out.push_back({Shape{desc.rows, desc.cols}, q});
    out.push_back(scales(desc.rows, desc.cols));
  }
  if (p.columnwise) {
    out.push_back({Shape{desc.cols, desc.rows}, q});
    out.push_back(scales(desc.cols, desc.rows));
  }
  out.push_back({Shape{1}, DType::kInt32});
  return out;
}

kernels::BlockOutputs block_outputs(const BlockQuantizeParams& p, const KernelArgs& a) {
  kernels::BlockOutputs out;
  std::size_t next = 0;
  if (p.rowwise) {
    out.rowwise = static_cast<std::uint8_t*>(a.outputs[next++]);
    out.rowwise_scale_inv = static_cast<float*>(a.outputs[next++]);
  }
  if (p.columnwise) {
    out.columnwise = static_cast<std::uint8_t*>(a.outputs[next++]);
    out.columnwise_scale_inv = static_cast<float*>(a.outputs[next++]);
  }
  return out;
}

}  // namespace

const OpDef& quantize_blocks_op() {
  static const OpDef op{
      .name = "quantize_blocks",
      .check = check_blocks,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const BlockQuantizeParams& p = params.as<BlockQuantizeParams>();
            kernels::launch_quantize_blocks(describe_blocks(p, a.input_metas[0]), p.shape, p.power_of_two,
                                            a.inputs[0], block_outputs(p, a), static_cast<int*>(a.outputs.back()),
                                            stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const BlockQuantizeParams& p = params.as<BlockQuantizeParams>();
            const bool ok = kernels::quantize_blocks_host(describe_blocks(p, a.input_metas[0]), p.shape,
                                                          p.power_of_two, a.inputs[0], block_outputs(p, a));
            *static_cast<std::int32_t*>(a.outputs.back()) = ok ? 0 : 1;
          },
  };
  return op;
}
SG_REGISTER_OP(quantize_blocks_op);

BlockQuantized quantize_blocks(Context& ctx, const Tensor& x, const BlockQuantizeParams& params) {
  std::vector<Tensor> out = ctx.call(quantize_blocks_op(), params, {x});
  BlockQuantized result;
  std::size_t next = 0;
  if (params.rowwise) {
    result.rowwise = out[next++];
    result.rowwise_scale_inv = out[next++];
  }
  if (params.columnwise) {
    result.columnwise = out[next++];
    result.columnwise_scale_inv = out[next++];
  }
  result.non_finite = out[next];
  return result;
}

namespace {

const TensorMeta kScalar{Shape{1}, DType::kFloat32};
const TensorMeta kFlag{Shape{1}, DType::kInt32};

void expect_scalar(std::string_view op, std::string_view role, const TensorMeta& got) {
  SG_CHECK(got == kScalar, "op ", op, ": ", role, " must be [1] fp32, got ", got.shape, " ", dtype_name(got.dtype));
}

std::vector<TensorMeta> check_amax(const OpParams&, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 1, "op amax takes x, got ", inputs.size(), " inputs");
  SG_CHECK(inputs[0].shape.rank() >= 2, "op amax: x must be [rows, cols] (or [..., cols]), got ", inputs[0].shape);
  kernels::check_quantize({inputs[0].dtype, Fp8Format::kE4M3, matrix_rows(inputs[0].shape),
                           matrix_cols(inputs[0].shape), true, false});
  return {kScalar};
}

std::vector<TensorMeta> check_scale_from_amax(const OpParams&, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 1, "op scale_from_amax takes amax, got ", inputs.size(), " inputs");
  expect_scalar("scale_from_amax", "amax", inputs[0]);
  return {kScalar, kScalar, kFlag};
}

// Inputs: amax, history, scale, scale_inv (the last three written in place).
std::vector<TensorMeta> check_delayed(const OpParams& params, std::span<const TensorMeta> inputs) {
  const DelayedScalingParams& p = params.as<DelayedScalingParams>();
  p.recipe.check();
  SG_CHECK(p.recipe.scaling == Fp8Scaling::kDelayed, "op delayed_scaling_update_: the recipe's scaling is ",
           fp8_scaling_name(p.recipe.scaling), ", not delayed");
  SG_CHECK(inputs.size() == 4, "op delayed_scaling_update_ takes amax, history, scale and scale_inv, got ",
           inputs.size(), " inputs");
  expect_scalar("delayed_scaling_update_", "amax", inputs[0]);
  const TensorMeta history{Shape{p.recipe.amax_history_len}, DType::kFloat32};
  SG_CHECK(inputs[1] == history, "op delayed_scaling_update_: history must be ", history.shape, " fp32 (the recipe's ",
           "amax_history_len), got ", inputs[1].shape, " ", dtype_name(inputs[1].dtype));
  expect_scalar("delayed_scaling_update_", "scale", inputs[2]);
  expect_scalar("delayed_scaling_update_", "scale_inv", inputs[3]);
  return {kFlag};
}

}  // namespace

const OpDef& amax_op() {
  static const OpDef op{
      .name = "amax",
      .check = check_amax,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            const TensorMeta& x = a.input_metas[0];
            const std::int64_t rows = matrix_rows(x.shape), cols = matrix_cols(x.shape);
            auto* amax = static_cast<float*>(a.outputs[0]);
            if (!kernels::launch_quantize_vectorized(x.dtype, rows, cols, a.inputs[0], {.amax = amax}, stream)) {
              kernels::launch_amax(x.dtype, rows, cols, a.inputs[0], amax, stream);
            }
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const TensorMeta& x = a.input_metas[0];
            *static_cast<float*>(a.outputs[0]) =
                kernels::amax_host(x.dtype, matrix_rows(x.shape), matrix_cols(x.shape), a.inputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(amax_op);

const OpDef& scale_from_amax_op() {
  static const OpDef op{
      .name = "scale_from_amax",
      .check = check_scale_from_amax,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const ScaleFromAmaxParams& p = params.as<ScaleFromAmaxParams>();
            kernels::launch_scale_from_amax(static_cast<const float*>(a.inputs[0]), p.format, p.power_of_two,
                                            static_cast<float*>(a.outputs[0]), static_cast<float*>(a.outputs[1]),
                                            static_cast<int*>(a.outputs[2]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const ScaleFromAmaxParams& p = params.as<ScaleFromAmaxParams>();
            const float amax = *static_cast<const float*>(a.inputs[0]);
            const bool ok = kernels::amax_is_usable(amax);
            const float scale = ok ? kernels::fp8_scale(amax, p.format, 0, p.power_of_two) : 1.0f;
            *static_cast<float*>(a.outputs[0]) = scale;
            *static_cast<float*>(a.outputs[1]) = 1.0f / scale;
            *static_cast<std::int32_t*>(a.outputs[2]) = ok ? 0 : 1;
          },
  };
  return op;
}
SG_REGISTER_OP(scale_from_amax_op);

const OpDef& delayed_scaling_update_op() {
  static const OpDef op{
      .name = "delayed_scaling_update_",
      .check = check_delayed,
      .mutated_inputs = {1, 2, 3},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const DelayedScalingParams& p = params.as<DelayedScalingParams>();
            kernels::launch_delayed_scaling_update(
                p.recipe, p.format, static_cast<const float*>(a.inputs[0]), static_cast<float*>(a.inputs[1]),
                static_cast<float*>(a.inputs[2]), static_cast<float*>(a.inputs[3]), static_cast<int*>(a.outputs[0]),
                stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const DelayedScalingParams& p = params.as<DelayedScalingParams>();
            const bool ok = kernels::delayed_scaling_update_host(
                p.recipe, p.format, *static_cast<const float*>(a.inputs[0]),
                {static_cast<float*>(a.inputs[1]), static_cast<float*>(a.inputs[2]), static_cast<float*>(a.inputs[3])});
            *static_cast<std::int32_t*>(a.outputs[0]) = ok ? 0 : 1;
          },
  };
  return op;
}
SG_REGISTER_OP(delayed_scaling_update_op);

const OpDef& count_flags_op() {
  static const OpDef op{
      .name = "count_flags_",
      .check =
          [](const OpParams&, std::span<const TensorMeta> inputs) {
            SG_CHECK(inputs.size() >= 1 && inputs.size() <= 1 + kernels::kMaxCountedFlags,
                     "op count_flags_ takes the counter and 0 to ", kernels::kMaxCountedFlags, " flags, got ",
                     inputs.size(), " inputs");
            for (const TensorMeta& t : inputs) {
              SG_CHECK(t == kFlag, "op count_flags_: counter and flags must be [1] int32, got ", t.shape, " ",
                       dtype_name(t.dtype));
            }
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            std::vector<const int*> flags;
            for (std::size_t i = 1; i < a.inputs.size(); ++i) flags.push_back(static_cast<const int*>(a.inputs[i]));
            kernels::launch_count_flags(flags.data(), static_cast<int>(flags.size()),
                                        static_cast<int*>(a.inputs[0]), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            auto* counter = static_cast<std::int32_t*>(a.inputs[0]);
            for (std::size_t i = 1; i < a.inputs.size(); ++i) *counter += *static_cast<const std::int32_t*>(a.inputs[i]);
          },
  };
  return op;
}
SG_REGISTER_OP(count_flags_op);

void count_flags_(Context& ctx, const Tensor& counter, const std::vector<Tensor>& flags) {
  std::vector<Tensor> inputs{counter};
  inputs.insert(inputs.end(), flags.begin(), flags.end());
  ctx.call(count_flags_op(), NoParams{}, std::move(inputs));
}

Tensor amax(Context& ctx, const Tensor& x) { return ctx.call(amax_op(), NoParams{}, {x}).front(); }

Scales scale_from_amax(Context& ctx, const Tensor& amax, const ScaleFromAmaxParams& params) {
  std::vector<Tensor> out = ctx.call(scale_from_amax_op(), params, {amax});
  return {out[0], out[1], out[2]};
}

Tensor delayed_scaling_update_(Context& ctx, const DelayedScalingParams& params, const Tensor& amax,
                               const Tensor& history, const Tensor& scale, const Tensor& scale_inv) {
  return ctx.call(delayed_scaling_update_op(), params, {amax, history, scale, scale_inv}).front();
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

void quantize_into_(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params,
                    const Tensor& rowwise, const Tensor& columnwise, const Tensor& amax) {
  std::vector<Tensor> inputs{x, scale};
  if (params.rowwise) inputs.push_back(rowwise);
  if (params.columnwise) inputs.push_back(columnwise);
  inputs.push_back(amax);
  ctx.call(quantize_into_op(), params, std::move(inputs));
}

}  // namespace stepgraph::ops
