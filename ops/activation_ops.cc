#include "ops/activation_ops.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/activation.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

// `arity` inputs of one float dtype and shape; one output like them.
template <std::size_t kArity>
std::vector<TensorMeta> check_same(std::string_view op, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == kArity, "op ", op, " takes ", kArity, " inputs, got ", inputs.size());
  const DType dtype = inputs[0].dtype;
  SG_CHECK_CODE(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
                ErrorCode::kUnsupported, "op ", op, ": dtype ", dtype_name(dtype),
                " is not supported (bf16, fp16, fp32)");
  for (std::size_t i = 1; i < inputs.size(); ++i) {
    SG_CHECK(inputs[i] == inputs[0], "op ", op, ": input ", i, " is ", inputs[i].shape, " ",
             dtype_name(inputs[i].dtype), " but input 0 is ", inputs[0].shape, " ", dtype_name(dtype));
  }
  return {inputs[0]};
}

}  // namespace

const OpDef& gelu_op() {
  static const OpDef op{
      .name = "gelu",
      .check = [](const OpParams&, std::span<const TensorMeta> in) { return check_same<1>("gelu", in); },
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_gelu_forward(a.input_metas[0].dtype, a.inputs[0], a.outputs[0], a.input_metas[0].numel(),
                                         s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::gelu_forward(a.input_metas[0].dtype, a.inputs[0], a.outputs[0], a.input_metas[0].numel());
          },
  };
  return op;
}
SG_REGISTER_OP(gelu_op);

// Inputs: dy, x.
const OpDef& gelu_backward_op() {
  static const OpDef op{
      .name = "gelu_backward",
      .check = [](const OpParams&, std::span<const TensorMeta> in) { return check_same<2>("gelu_backward", in); },
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_gelu_backward(a.input_metas[0].dtype, a.inputs[0], a.inputs[1], a.outputs[0],
                                          a.input_metas[0].numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::gelu_backward(a.input_metas[0].dtype, a.inputs[0], a.inputs[1], a.outputs[0],
                                         a.input_metas[0].numel());
          },
  };
  return op;
}
SG_REGISTER_OP(gelu_backward_op);

const OpDef& residual_add_op() {
  static const OpDef op{
      .name = "residual_add",
      .check = [](const OpParams&, std::span<const TensorMeta> in) { return check_same<2>("residual_add", in); },
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_residual_add(a.input_metas[0].dtype, a.inputs[0], a.inputs[1], a.outputs[0],
                                         a.input_metas[0].numel(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::residual_add(a.input_metas[0].dtype, a.inputs[0], a.inputs[1], a.outputs[0],
                                        a.input_metas[0].numel());
          },
  };
  return op;
}
SG_REGISTER_OP(residual_add_op);

Tensor gelu(Context& ctx, const Tensor& x) { return ctx.call(gelu_op(), NoParams{}, {x}).front(); }

Tensor gelu_backward(Context& ctx, const Tensor& dy, const Tensor& x) {
  return ctx.call(gelu_backward_op(), NoParams{}, {dy, x}).front();
}

Tensor residual_add(Context& ctx, const Tensor& a, const Tensor& b) {
  return ctx.call(residual_add_op(), NoParams{}, {a, b}).front();
}

}  // namespace stepgraph::ops
