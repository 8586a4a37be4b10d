#include "ops/activation_ops.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/activation.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

template <typename F>
struct GeluBackwardOperands {
  F dy;
  F x;  // the forward's input
};

template <typename F, typename V>
void visit_operands(const NoParams&, GeluBackwardOperands<F>& o, V& v) {
  v({"dy"}, o.dy);
  v({"x"}, o.x);
}

constexpr std::string_view kGelu = "gelu";
constexpr std::string_view kGeluBackward = "gelu_backward";
constexpr std::string_view kResidualAdd = "residual_add";

// One float dtype, and `other` (when given) like `first`; one output like them.
std::vector<TensorMeta> check_same(std::string_view op, const TensorMeta& first, const TensorMeta* other,
                                   std::string_view other_name) {
  const DType dtype = first.dtype;
  SG_CHECK_CODE(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                ErrorCode::kUnsupported, "op ", op, ": dtype ", dtype_name(dtype),
                " is not supported (bf16, fp16, fp32)");
  if (other != nullptr) {
    SG_CHECK(*other == first, "op ", op, ": ", other_name, " is ", other->shape, " ", dtype_name(other->dtype),
             " but it must match ", first.shape, " ", dtype_name(dtype));
  }
  return {first};
}

}  // namespace

const OpDef& gelu_op() {
  static const OpDef op{
      .name = kGelu,
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            return check_same(kGelu, bind_metas<ReadOperand>(kGelu, NoParams{}, in).x, nullptr, "");
          },
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const Operand x = bind_args<ReadOperand>(NoParams{}, a).x;
            kernels::launch_gelu_forward(x.dtype(), x.data, a.outputs[0], x.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const Operand x = bind_args<ReadOperand>(NoParams{}, a).x;
            kernels::host::gelu_forward(x.dtype(), x.data, a.outputs[0], x.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(gelu_op);

const OpDef& gelu_backward_op() {
  static const OpDef op{
      .name = kGeluBackward,
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            const auto o = bind_metas<GeluBackwardOperands>(kGeluBackward, NoParams{}, in);
            return check_same(kGeluBackward, o.dy, &o.x, "x");
          },
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<GeluBackwardOperands>(NoParams{}, a);
            kernels::launch_gelu_backward(o.dy.dtype(), o.dy.data, o.x.data, a.outputs[0], o.dy.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<GeluBackwardOperands>(NoParams{}, a);
            kernels::host::gelu_backward(o.dy.dtype(), o.dy.data, o.x.data, a.outputs[0], o.dy.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(gelu_backward_op);

const OpDef& residual_add_op() {
  static const OpDef op{
      .name = kResidualAdd,
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            const auto o = bind_metas<BinaryOperands>(kResidualAdd, NoParams{}, in);
            return check_same(kResidualAdd, o.a, &o.b, "b");
          },
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<BinaryOperands>(NoParams{}, a);
            kernels::launch_residual_add(o.a.dtype(), o.a.data, o.b.data, a.outputs[0], o.a.numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<BinaryOperands>(NoParams{}, a);
            kernels::host::residual_add(o.a.dtype(), o.a.data, o.b.data, a.outputs[0], o.a.numel());
          },
  };
  return op;
}
SG_REGISTER_OP(residual_add_op);

Tensor gelu(Context& ctx, const Tensor& x) {
  return ctx.call(gelu_op(), NoParams{}, flatten(kGelu, NoParams{}, ReadOperand<Tensor>{x})).front();
}

Tensor gelu_backward(Context& ctx, const Tensor& dy, const Tensor& x) {
  return ctx
      .call(gelu_backward_op(), NoParams{},
            flatten(kGeluBackward, NoParams{}, GeluBackwardOperands<Tensor>{.dy = dy, .x = x}))
      .front();
}

Tensor residual_add(Context& ctx, const Tensor& a, const Tensor& b) {
  return ctx
      .call(residual_add_op(), NoParams{},
            flatten(kResidualAdd, NoParams{}, BinaryOperands<Tensor>{.a = a, .b = b}))
      .front();
}

}  // namespace stepgraph::ops
