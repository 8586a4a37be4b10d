#include "ops/embedding_ops.h"

#include <vector>

#include "engine/error.h"
#include "kernels/embedding.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {
namespace {

// tokens must be int32 [rows, width]; returns the kernel's description.
kernels::EmbeddingDesc describe(const char* op, const TensorMeta& table, const TensorMeta& tokens) {
  SG_CHECK(table.shape.rank() == 2, "op ", op, ": the table must be [vocab, dim], got ", table.shape);
  SG_CHECK(tokens.shape.rank() == 2 && tokens.dtype == DType::kInt32, "op ", op,
           ": tokens must be int32 [rows, width], got ", tokens.shape, " ", dtype_name(tokens.dtype));
  kernels::EmbeddingDesc desc{.dtype = table.dtype,
                              .vocab = table.shape.dim(0),
                              .dim = table.shape.dim(1),
                              .rows = tokens.shape.dim(0),
                              .width = tokens.shape.dim(1)};
  kernels::check_embedding(desc);
  return desc;
}

Shape out_shape(const kernels::EmbeddingDesc& desc) { return Shape{desc.rows, desc.width * desc.dim}; }

// Inputs: table, tokens, error_flag (written).
std::vector<TensorMeta> check_forward(const OpParams&, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 3, "op embedding takes a table, tokens and an error flag, got ", inputs.size(), " inputs");
  SG_CHECK(inputs[2] == (TensorMeta{Shape{1}, DType::kInt32}), "op embedding: the error flag must be int32 [1], got ",
           inputs[2].shape, " ", dtype_name(inputs[2].dtype));
  const kernels::EmbeddingDesc desc = describe("embedding", inputs[0], inputs[1]);
  return {TensorMeta{out_shape(desc), desc.dtype}};
}

// Inputs: grad (written), dout, tokens.
std::vector<TensorMeta> check_backward(const OpParams&, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 3, "op embedding_backward takes the table's grad, dout and tokens, got ", inputs.size(),
           " inputs");
  const TensorMeta& grad = inputs[0];
  const TensorMeta& dout = inputs[1];
  SG_CHECK(grad.dtype == DType::kFloat32, "op embedding_backward: the table's grad must be fp32, got ",
           dtype_name(grad.dtype));
  kernels::EmbeddingDesc desc = describe("embedding_backward", grad, inputs[2]);
  desc.dtype = dout.dtype;
  kernels::check_embedding(desc);
  SG_CHECK(dout.shape == out_shape(desc), "op embedding_backward: dout must be ", out_shape(desc),
           " (rows, width * dim) to match the tokens ", inputs[2].shape, " and the grad ", grad.shape, ", got ",
           dout.shape);
  return {};
}

kernels::EmbeddingDesc forward_desc(const KernelArgs& a) {
  return describe("embedding", a.input_metas[0], a.input_metas[1]);
}

kernels::EmbeddingDesc backward_desc(const KernelArgs& a) {
  kernels::EmbeddingDesc desc = describe("embedding_backward", a.input_metas[0], a.input_metas[2]);
  desc.dtype = a.input_metas[1].dtype;
  return desc;
}

const std::int32_t* tokens_of(const KernelArgs& a, std::size_t index) {
  return static_cast<const std::int32_t*>(a.inputs[index]);
}

}  // namespace

const OpDef& embedding_op() {
  static const OpDef op{
      .name = "embedding",
      .check = check_forward,
      .mutated_inputs = {2},
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_embedding_forward(forward_desc(a), a.inputs[0], tokens_of(a, 1), a.outputs[0],
                                              static_cast<std::int32_t*>(a.inputs[2]), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::embedding_forward(forward_desc(a), a.inputs[0], tokens_of(a, 1), a.outputs[0],
                                             static_cast<std::int32_t*>(a.inputs[2]));
          },
  };
  return op;
}
SG_REGISTER_OP(embedding_op);

const OpDef& embedding_backward_op() {
  static const OpDef op{
      .name = "embedding_backward",
      .check = check_backward,
      .mutated_inputs = {0},
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_embedding_backward(backward_desc(a), a.inputs[1], tokens_of(a, 2),
                                               static_cast<float*>(a.inputs[0]), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::embedding_backward(backward_desc(a), a.inputs[1], tokens_of(a, 2),
                                              static_cast<float*>(a.inputs[0]));
          },
  };
  return op;
}
SG_REGISTER_OP(embedding_backward_op);

Tensor embedding(Context& ctx, const Tensor& table, const Tensor& tokens, const Tensor& error_flag) {
  return ctx.call(embedding_op(), NoParams{}, {table, tokens, error_flag}).front();
}

void embedding_backward_(Context& ctx, const Tensor& grad, const Tensor& dout, const Tensor& tokens) {
  ctx.call(embedding_backward_op(), NoParams{}, {grad, dout, tokens});
}

}  // namespace stepgraph::ops
