#include "ops/elementwise_ops.h"

#include <cstdio>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "kernels/elementwise_host.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

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

// --- operands ---------------------------------------------------------------------

template <typename F>
struct AxpyOperands {
  F y, x;  // y + alpha x
};

template <typename F, typename V>
void visit_operands(const AxpyParams&, AxpyOperands<F>& o, V& v) {
  v({"y"}, o.y);
  v({"x"}, o.x);
}

template <typename F>
struct AxpyIntoOperands {
  F y;  // y += alpha x, written
  F x;
};

template <typename F, typename V>
void visit_operands(const AxpyParams&, AxpyIntoOperands<F>& o, V& v) {
  v({.name = "y", .use = Use::kWrite}, o.y);
  v({"x"}, o.x);
}

// --- checks --------------------------------------------------------------------

struct Named {
  std::string_view name;
  const TensorMeta& meta;
};

// fp32 operands of one shape; returns `outputs` metas like the first.
std::vector<TensorMeta> check_fp32_alike(std::string_view op, std::initializer_list<Named> operands,
                                         std::size_t outputs) {
  const Named& first = *operands.begin();
  for (const Named& o : operands) {
    SG_CHECK_CODE(o.meta.dtype == DType::kFloat32, ErrorCode::kUnsupported, "op ", op, ": ", o.name, " is ",
                  dtype_name(o.meta.dtype), "; only fp32 is supported");
    SG_CHECK(o.meta.shape == first.meta.shape, "op ", op, ": ", o.name, " has shape ", o.meta.shape, " but ",
             first.name, " has shape ", first.meta.shape, "; elementwise inputs must have equal shapes");
  }
  return std::vector<TensorMeta>(outputs, first.meta);
}

std::vector<TensorMeta> check_fill(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<FillParams>();
  bind_metas<NoOperands>("fill", p, inputs);
  return check_fp32_alike("fill", {{"the filled tensor", p.meta}}, 1);
}

std::vector<TensorMeta> check_copy(const OpParams&, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<ReadOperand>("copy", NoParams{}, inputs);
  return check_fp32_alike("copy", {{"x", o.x}}, 1);
}

std::vector<TensorMeta> check_copy_into(const OpParams&, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<CopyOperands>("copy_", NoParams{}, inputs);
  return check_fp32_alike("copy_", {{"dst", o.dst}, {"src", o.src}}, 0);
}

template <const char* kName>
std::vector<TensorMeta> check_binary(const OpParams&, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<BinaryOperands>(kName, NoParams{}, inputs);
  return check_fp32_alike(kName, {{"a", o.a}, {"b", o.b}}, 1);
}

template <template <typename> class Operands, const char* kName>
std::vector<TensorMeta> check_axpy(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<Operands>(kName, params.as<AxpyParams>(), inputs);
  return check_fp32_alike(kName, {{"y", o.y}, {"x", o.x}}, std::is_same_v<Operands<int>, AxpyOperands<int>> ? 1 : 0);
}

std::vector<TensorMeta> check_sum(const OpParams&, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<ReadOperand>("sum", NoParams{}, inputs);
  check_fp32_alike("sum", {{"x", o.x}}, 0);
  return {TensorMeta{Shape{}, DType::kFloat32}};
}

std::vector<TensorMeta> check_column_sum(const OpParams&, std::span<const TensorMeta> inputs) {
  const TensorMeta x = bind_metas<ReadOperand>("column_sum", NoParams{}, inputs).x;
  SG_CHECK(x.shape.rank() == 2, "op column_sum: x must be 2-D [rows, cols], got ", x.shape);
  SG_CHECK(x.dtype == DType::kFloat32 || x.dtype == DType::kBFloat16 || x.dtype == DType::kFloat16,
           "op column_sum: x must be fp32, bf16 or fp16, got ", dtype_name(x.dtype));
  return {TensorMeta{Shape{x.shape.dim(1)}, DType::kFloat32}};
}

std::vector<TensorMeta> check_cast(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<CastParams>();
  const TensorMeta x = bind_metas<ReadOperand>("cast", p, inputs).x;
  for (DType dtype : {x.dtype, p.to}) {
    SG_CHECK_CODE(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                  ErrorCode::kUnsupported, "op cast: dtype ", dtype_name(dtype),
                  " is not supported (fp32, bf16, fp16)");
  }
  return {TensorMeta{x.shape, p.to}};
}

// --- launchers and host references ----------------------------------------------

float* out_f32(const KernelArgs& args) { return static_cast<float*>(args.outputs[0]); }
float* f32(const Operand& operand) { return operand.as<float>(); }

// The unary ops' x (NoParams).
Operand x_of(const KernelArgs& a) { return bind_args<ReadOperand>(NoParams{}, a).x; }

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
            kernels::launch_fill_f32(out_f32(a), p.as<FillParams>().value, a.output_metas[0].numel(), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::fill_f32(out_f32(a), p.as<FillParams>().value, a.output_metas[0].numel());
          },
  };
  return op;
}
SG_REGISTER_OP(fill_op);

const OpDef& copy_op() {
  static const OpDef op{
      .name = "copy",
      .check = check_copy,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const Operand x = x_of(a);
            kernels::launch_copy_f32(out_f32(a), f32(x), x.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const Operand x = x_of(a);
            kernels::host::copy_f32(out_f32(a), f32(x), x.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(copy_op);

const OpDef& copy_inplace_op() {
  static const OpDef op{
      .name = "copy_",
      .check = check_copy_into,
      .mutated_inputs_for = written_inputs_of<CopyOperands, NoParams>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<CopyOperands>(NoParams{}, a);
            kernels::launch_copy_f32(f32(o.dst), f32(o.src), o.dst.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<CopyOperands>(NoParams{}, a);
            kernels::host::copy_f32(f32(o.dst), f32(o.src), o.dst.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(copy_inplace_op);

const OpDef& axpy_op() {
  static const OpDef op{
      .name = kAxpy,
      .check = check_axpy<AxpyOperands, kAxpy>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<AxpyParams>();
            const auto o = bind_args<AxpyOperands>(p, a);
            kernels::launch_axpy_f32(out_f32(a), f32(o.y), f32(o.x), p.alpha, o.y.numel(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<AxpyParams>();
            const auto o = bind_args<AxpyOperands>(p, a);
            kernels::host::axpy_f32(out_f32(a), f32(o.y), f32(o.x), p.alpha, o.y.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(axpy_op);

const OpDef& axpy_inplace_op() {
  static const OpDef op{
      .name = kAxpyInplace,
      .check = check_axpy<AxpyIntoOperands, kAxpyInplace>,
      .mutated_inputs_for = written_inputs_of<AxpyIntoOperands, AxpyParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<AxpyParams>();
            const auto o = bind_args<AxpyIntoOperands>(p, a);
            kernels::launch_axpy_f32(f32(o.y), f32(o.y), f32(o.x), p.alpha, o.y.numel(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<AxpyParams>();
            const auto o = bind_args<AxpyIntoOperands>(p, a);
            kernels::host::axpy_f32(f32(o.y), f32(o.y), f32(o.x), p.alpha, o.y.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(axpy_inplace_op);

const OpDef& add_op() {
  static const OpDef op{
      .name = kAdd,
      .check = check_binary<kAdd>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<BinaryOperands>(NoParams{}, a);
            kernels::launch_add_f32(out_f32(a), f32(o.a), f32(o.b), o.a.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<BinaryOperands>(NoParams{}, a);
            kernels::host::add_f32(out_f32(a), f32(o.a), f32(o.b), o.a.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(add_op);

const OpDef& mul_op() {
  static const OpDef op{
      .name = kMul,
      .check = check_binary<kMul>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<BinaryOperands>(NoParams{}, a);
            kernels::launch_mul_f32(out_f32(a), f32(o.a), f32(o.b), o.a.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<BinaryOperands>(NoParams{}, a);
            kernels::host::mul_f32(out_f32(a), f32(o.a), f32(o.b), o.a.numel());
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
            const Operand x = x_of(a);
            kernels::launch_sum_f32(out_f32(a), f32(x), x.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const Operand x = x_of(a);
            kernels::host::sum_f32(out_f32(a), f32(x), x.numel());
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
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<CastParams>();
            const Operand x = bind_args<ReadOperand>(p, a).x;
            kernels::launch_cast(x.dtype(), p.to, x.data, a.outputs[0], x.numel(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<CastParams>();
            const Operand x = bind_args<ReadOperand>(p, a).x;
            kernels::host::cast(x.dtype(), p.to, x.data, a.outputs[0], x.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(cast_op);

const OpDef& column_sum_op() {
  static const OpDef op{
      .name = "column_sum",
      .check = check_column_sum,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const Operand x = x_of(a);
            kernels::launch_column_sum(x.dtype(), x.shape().dim(0), x.shape().dim(1), x.data, out_f32(a), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const Operand x = x_of(a);
            kernels::host::column_sum(x.dtype(), x.shape().dim(0), x.shape().dim(1), x.data, out_f32(a));
          },
  };
  return op;
}
SG_REGISTER_OP(column_sum_op);

namespace {

// One call of an elementwise op by its named operands; its first output.
template <template <typename> class Operands, typename Params>
Tensor call(Context& ctx, const OpDef& op, const Params& params, Operands<Tensor> operands) {
  return ctx.call(op, params, flatten(op.name, params, std::move(operands))).front();
}

}  // namespace

Tensor cast(Context& ctx, const Tensor& x, DType dtype) {
  return call(ctx, cast_op(), CastParams{dtype}, ReadOperand<Tensor>{x});
}

Tensor fill(Context& ctx, const TensorMeta& meta, float value) {
  return call(ctx, fill_op(), FillParams{meta, value}, NoOperands<Tensor>{});
}

Tensor copy(Context& ctx, const Tensor& x) { return call(ctx, copy_op(), NoParams{}, ReadOperand<Tensor>{x}); }

void copy_(Context& ctx, const Tensor& dst, const Tensor& src) {
  ctx.call(copy_inplace_op(), NoParams{},
           flatten("copy_", NoParams{}, CopyOperands<Tensor>{.dst = dst, .src = src}));
}

Tensor axpy(Context& ctx, const Tensor& y, const Tensor& x, float alpha) {
  return call(ctx, axpy_op(), AxpyParams{alpha}, AxpyOperands<Tensor>{.y = y, .x = x});
}

void axpy_(Context& ctx, const Tensor& y, const Tensor& x, float alpha) {
  const AxpyParams params{alpha};
  ctx.call(axpy_inplace_op(), params, flatten(kAxpyInplace, params, AxpyIntoOperands<Tensor>{.y = y, .x = x}));
}

Tensor add(Context& ctx, const Tensor& a, const Tensor& b) {
  return call(ctx, add_op(), NoParams{}, BinaryOperands<Tensor>{.a = a, .b = b});
}

Tensor mul(Context& ctx, const Tensor& a, const Tensor& b) {
  return call(ctx, mul_op(), NoParams{}, BinaryOperands<Tensor>{.a = a, .b = b});
}

Tensor sum(Context& ctx, const Tensor& x) { return call(ctx, sum_op(), NoParams{}, ReadOperand<Tensor>{x}); }

Tensor column_sum(Context& ctx, const Tensor& x) {
  return call(ctx, column_sum_op(), NoParams{}, ReadOperand<Tensor>{x});
}

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
