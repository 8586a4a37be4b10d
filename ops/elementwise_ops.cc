#include "ops/elementwise_ops.h"

#include <cstdio>
#include <string>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "kernels/elementwise_host.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

std::string format_float(float value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
  return text;
}

struct FillParams {
  TensorMeta meta;
  float value = 0.0f;
  bool operator==(const FillParams&) const = default;
  std::string to_string() const { return "value=" + format_float(value); }
};

struct CastParams {
  DType to = DType::kFloat32;
  bool operator==(const CastParams&) const = default;
  std::string to_string() const { return "to=" + std::string(dtype_name(to)); }
};

struct AxpyParams {
  float alpha = 1.0f;
  bool operator==(const AxpyParams&) const = default;
  std::string to_string() const { return "alpha=" + format_float(alpha); }
};

// --- checks --------------------------------------------------------------------

void check_arity(std::string_view op, std::span<const TensorMeta> inputs, std::size_t expected) {
  SG_CHECK(inputs.size() == expected, "op ", op, " takes ", expected, " input(s), got ", inputs.size());
}

void check_fp32(std::string_view op, std::span<const TensorMeta> inputs) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    SG_CHECK_CODE(inputs[i].dtype == DType::kFloat32, ErrorCode::kUnsupported, "op ", op, ": input ", i, " is ",
                  dtype_name(inputs[i].dtype), "; only fp32 is supported");
  }
}

void check_same_shapes(std::string_view op, std::span<const TensorMeta> inputs) {
  for (std::size_t i = 1; i < inputs.size(); ++i) {
    SG_CHECK(inputs[i].shape == inputs[0].shape, "op ", op, ": input ", i, " has shape ", inputs[i].shape,
             " but input 0 has shape ", inputs[0].shape, "; elementwise inputs must have equal shapes");
  }
}

// fp32 inputs of one shape, `arity` of them; returns `outputs` metas like input 0.
template <std::size_t kArity, std::size_t kOutputs, const char* kName>
std::vector<TensorMeta> check_elementwise(const OpParams&, std::span<const TensorMeta> inputs) {
  check_arity(kName, inputs, kArity);
  check_fp32(kName, inputs);
  check_same_shapes(kName, inputs);
  return std::vector<TensorMeta>(kOutputs, inputs[0]);
}

std::vector<TensorMeta> check_fill(const OpParams& params, std::span<const TensorMeta> inputs) {
  check_arity("fill", inputs, 0);
  const TensorMeta& meta = params.as<FillParams>().meta;
  check_fp32("fill", std::span(&meta, 1));
  return {meta};
}

std::vector<TensorMeta> check_sum(const OpParams&, std::span<const TensorMeta> inputs) {
  check_arity("sum", inputs, 1);
  check_fp32("sum", inputs);
  return {TensorMeta{Shape{}, DType::kFloat32}};
}

std::vector<TensorMeta> check_column_sum(const OpParams&, std::span<const TensorMeta> inputs) {
  check_arity("column_sum", inputs, 1);
  const TensorMeta& x = inputs[0];
  SG_CHECK(x.shape.rank() == 2, "op column_sum: x must be 2-D [rows, cols], got ", x.shape);
  SG_CHECK(x.dtype == DType::kFloat32 || x.dtype == DType::kBFloat16 || x.dtype == DType::kFloat16,
           "op column_sum: x must be fp32, bf16 or fp16, got ", dtype_name(x.dtype));
  return {TensorMeta{Shape{x.shape.dim(1)}, DType::kFloat32}};
}

std::vector<TensorMeta> check_cast(const OpParams& params, std::span<const TensorMeta> inputs) {
  check_arity("cast", inputs, 1);
  const DType to = params.as<CastParams>().to;
  for (DType dtype : {inputs[0].dtype, to}) {
    SG_CHECK_CODE(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                  ErrorCode::kUnsupported, "op cast: dtype ", dtype_name(dtype),
                  " is not supported (fp32, bf16, fp16)");
  }
  return {TensorMeta{inputs[0].shape, to}};
}

// --- launchers and host references ----------------------------------------------

float* out_f32(const KernelArgs& args, std::size_t i) { return static_cast<float*>(args.outputs[i]); }
float* in_f32(const KernelArgs& args, std::size_t i) { return static_cast<float*>(args.inputs[i]); }
std::int64_t count(const KernelArgs& args) {
  return args.input_metas.empty() ? args.output_metas[0].numel() : args.input_metas[0].numel();
}

constexpr char kCopy[] = "copy";
constexpr char kCopyInplace[] = "copy_";
constexpr char kAxpy[] = "axpy";
constexpr char kAxpyInplace[] = "axpy_";
constexpr char kAdd[] = "add";
constexpr char kMul[] = "mul";

}  // namespace

const OpDef& fill_op() {
  static const OpDef op{
      .name = "fill",
      .check = check_fill,
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_fill_f32(out_f32(a, 0), p.as<FillParams>().value, count(a), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::fill_f32(out_f32(a, 0), p.as<FillParams>().value, count(a));
          },
  };
  return op;
}
SG_REGISTER_OP(fill_op);

const OpDef& copy_op() {
  static const OpDef op{
      .name = kCopy,
      .check = check_elementwise<1, 1, kCopy>,
      .launch_cuda = [](const OpParams&, const KernelArgs& a,
                        CUstream_st* s) { kernels::launch_copy_f32(out_f32(a, 0), in_f32(a, 0), count(a), s); },
      .run_host = [](const OpParams&,
                     const KernelArgs& a) { kernels::host::copy_f32(out_f32(a, 0), in_f32(a, 0), count(a)); },
  };
  return op;
}
SG_REGISTER_OP(copy_op);

// copy_(dst, src): writes input 0.
const OpDef& copy_inplace_op() {
  static const OpDef op{
      .name = kCopyInplace,
      .check = check_elementwise<2, 0, kCopyInplace>,
      .mutated_inputs = {0},
      .launch_cuda = [](const OpParams&, const KernelArgs& a,
                        CUstream_st* s) { kernels::launch_copy_f32(in_f32(a, 0), in_f32(a, 1), count(a), s); },
      .run_host = [](const OpParams&,
                     const KernelArgs& a) { kernels::host::copy_f32(in_f32(a, 0), in_f32(a, 1), count(a)); },
  };
  return op;
}
SG_REGISTER_OP(copy_inplace_op);

const OpDef& axpy_op() {
  static const OpDef op{
      .name = kAxpy,
      .check = check_elementwise<2, 1, kAxpy>,
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_axpy_f32(out_f32(a, 0), in_f32(a, 0), in_f32(a, 1), p.as<AxpyParams>().alpha, count(a), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::axpy_f32(out_f32(a, 0), in_f32(a, 0), in_f32(a, 1), p.as<AxpyParams>().alpha, count(a));
          },
  };
  return op;
}
SG_REGISTER_OP(axpy_op);

// axpy_(y, x): writes input 0.
const OpDef& axpy_inplace_op() {
  static const OpDef op{
      .name = kAxpyInplace,
      .check = check_elementwise<2, 0, kAxpyInplace>,
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_axpy_f32(in_f32(a, 0), in_f32(a, 0), in_f32(a, 1), p.as<AxpyParams>().alpha, count(a), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::axpy_f32(in_f32(a, 0), in_f32(a, 0), in_f32(a, 1), p.as<AxpyParams>().alpha, count(a));
          },
  };
  return op;
}
SG_REGISTER_OP(axpy_inplace_op);

const OpDef& add_op() {
  static const OpDef op{
      .name = kAdd,
      .check = check_elementwise<2, 1, kAdd>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_add_f32(out_f32(a, 0), in_f32(a, 0), in_f32(a, 1), count(a), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::add_f32(out_f32(a, 0), in_f32(a, 0), in_f32(a, 1), count(a));
          },
  };
  return op;
}
SG_REGISTER_OP(add_op);

const OpDef& mul_op() {
  static const OpDef op{
      .name = kMul,
      .check = check_elementwise<2, 1, kMul>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_mul_f32(out_f32(a, 0), in_f32(a, 0), in_f32(a, 1), count(a), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::mul_f32(out_f32(a, 0), in_f32(a, 0), in_f32(a, 1), count(a));
          },
  };
  return op;
}
SG_REGISTER_OP(mul_op);

const OpDef& sum_op() {
  static const OpDef op{
      .name = "sum",
      .check = check_sum,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_sum_f32(out_f32(a, 0), in_f32(a, 0), a.input_metas[0].numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::sum_f32(out_f32(a, 0), in_f32(a, 0), a.input_metas[0].numel());
          },
  };
  return op;
}
SG_REGISTER_OP(sum_op);

const OpDef& cast_op() {
  static const OpDef op{
      .name = "cast",
      .check = check_cast,
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_cast(a.input_metas[0].dtype, p.as<CastParams>().to, a.inputs[0], a.outputs[0], count(a), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::cast(a.input_metas[0].dtype, p.as<CastParams>().to, a.inputs[0], a.outputs[0], count(a));
          },
  };
  return op;
}
SG_REGISTER_OP(cast_op);

Tensor cast(Context& ctx, const Tensor& x, DType dtype) { return ctx.call(cast_op(), CastParams{dtype}, {x}).front(); }

Tensor fill(Context& ctx, const TensorMeta& meta, float value) {
  return ctx.call(fill_op(), FillParams{meta, value}, {}).front();
}

Tensor copy(Context& ctx, const Tensor& x) { return ctx.call(copy_op(), NoParams{}, {x}).front(); }

void copy_(Context& ctx, const Tensor& dst, const Tensor& src) { ctx.call(copy_inplace_op(), NoParams{}, {dst, src}); }

Tensor axpy(Context& ctx, const Tensor& y, const Tensor& x, float alpha) {
  return ctx.call(axpy_op(), AxpyParams{alpha}, {y, x}).front();
}

void axpy_(Context& ctx, const Tensor& y, const Tensor& x, float alpha) {
  ctx.call(axpy_inplace_op(), AxpyParams{alpha}, {y, x});
}

Tensor add(Context& ctx, const Tensor& a, const Tensor& b) { return ctx.call(add_op(), NoParams{}, {a, b}).front(); }

Tensor mul(Context& ctx, const Tensor& a, const Tensor& b) { return ctx.call(mul_op(), NoParams{}, {a, b}).front(); }

Tensor sum(Context& ctx, const Tensor& x) { return ctx.call(sum_op(), NoParams{}, {x}).front(); }

const OpDef& column_sum_op() {
  static const OpDef op{
      .name = "column_sum",
      .check = check_column_sum,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const TensorMeta& x = a.input_metas[0];
            kernels::launch_column_sum(x.dtype, x.shape.dim(0), x.shape.dim(1), a.inputs[0], out_f32(a, 0), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const TensorMeta& x = a.input_metas[0];
            kernels::host::column_sum(x.dtype, x.shape.dim(0), x.shape.dim(1), a.inputs[0], out_f32(a, 0));
          },
  };
  return op;
}
SG_REGISTER_OP(column_sum_op);

Tensor column_sum(Context& ctx, const Tensor& x) { return ctx.call(column_sum_op(), NoParams{}, {x}).front(); }

float item(Context& ctx, const Tensor& x) {
  SG_CHECK_CODE(!ctx.tracing(), ErrorCode::kInvalidState, "op item reads tensor '", x.name(),
                "' on the host (a device-to-host copy), which cannot be captured; return the tensor as an output "
                "of the step and read it after replay");
  SG_CHECK(x.numel() == 1 && x.dtype() == DType::kFloat32, "op item needs a one-element fp32 tensor, got '", x.name(),
           "' ", x.shape(), " ", dtype_name(x.dtype()));
  float value = 0.0f;
  ctx.copy_to_host(x, &value, sizeof(value));
  return value;
}

}  // namespace stepgraph::ops
