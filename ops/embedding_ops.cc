#include "ops/embedding_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/embedding.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string EmbeddingParams::to_string() const {
  if (*this == EmbeddingParams{}) return "";
  char text[96];
  std::snprintf(text, sizeof(text), "vocab_offset=%lld, vocab=%lld", static_cast<long long>(vocab_offset),
                static_cast<long long>(vocab));
  return text;
}

namespace {

// tokens must be int32 [rows, width]; returns the kernel's description.
kernels::EmbeddingDesc describe(const char* op, const EmbeddingParams& params, const TensorMeta& table,
                                const TensorMeta& tokens) {
  SG_CHECK(table.shape.rank() == 2, "op ", op, ": the table must be [vocab, dim], got ", table.shape);
  SG_CHECK(tokens.shape.rank() == 2 && tokens.dtype == DType::kInt32, "op ", op,
           ": tokens must be int32 [rows, width], got ", tokens.shape, " ", dtype_name(tokens.dtype));
  kernels::EmbeddingDesc desc{.dtype = table.dtype,
                              .vocab = table.shape.dim(0),
                              .dim = table.shape.dim(1),
                              .rows = tokens.shape.dim(0),
                              .width = tokens.shape.dim(1),
                              .vocab_offset = params.vocab_offset,
                              .full_vocab = params.vocab};
  kernels::check_embedding(desc);
  return desc;
}

Shape out_shape(const kernels::EmbeddingDesc& desc) { return Shape{desc.rows, desc.width * desc.dim}; }

template <typename F>
struct EmbeddingOperands {
  F table;       // [vocab, dim]
  F tokens;      // int32 [rows, width]
  F error_flag;  // int32 [1], raised on a token outside the table
};

template <typename F, typename V>
void visit_operands(const EmbeddingParams&, EmbeddingOperands<F>& o, V& v) {
  v({"table"}, o.table);
  v({"tokens"}, o.tokens);
  v({.name = "error_flag", .use = Use::kWrite}, o.error_flag);
}

template <typename F>
struct EmbeddingBackwardOperands {
  F grad;    // fp32 [vocab, dim], accumulated into
  F dout;    // [rows, width * dim]
  F tokens;  // int32 [rows, width]
};

template <typename F, typename V>
void visit_operands(const EmbeddingParams&, EmbeddingBackwardOperands<F>& o, V& v) {
  v({.name = "grad", .use = Use::kWrite}, o.grad);
  v({"dout"}, o.dout);
  v({"tokens"}, o.tokens);
}

constexpr std::string_view kForward = "embedding";
constexpr std::string_view kBackward = "embedding_backward";

std::vector<TensorMeta> check_forward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const EmbeddingParams& p = params.as<EmbeddingParams>();
  const auto o = bind_metas<EmbeddingOperands>(kForward, p, inputs);
  SG_CHECK(o.error_flag == (TensorMeta{Shape{1}, DType::kInt32}),
           "op embedding: the error flag must be int32 [1], got ", o.error_flag.shape, " ",
           dtype_name(o.error_flag.dtype));
  const kernels::EmbeddingDesc desc = describe("embedding", p, o.table, o.tokens);
  return {TensorMeta{out_shape(desc), desc.dtype}};
}

std::vector<TensorMeta> check_backward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const EmbeddingParams& p = params.as<EmbeddingParams>();
  const auto o = bind_metas<EmbeddingBackwardOperands>(kBackward, p, inputs);
  SG_CHECK(o.grad.dtype == DType::kFloat32, "op embedding_backward: the table's grad must be fp32, got ",
           dtype_name(o.grad.dtype));
  kernels::EmbeddingDesc desc = describe("embedding_backward", p, o.grad, o.tokens);
  desc.dtype = o.dout.dtype;
  kernels::check_embedding(desc);
  SG_CHECK(o.dout.shape == out_shape(desc), "op embedding_backward: dout must be ", out_shape(desc),
           " (rows, width * dim) to match the tokens ", o.tokens.shape, " and the grad ", o.grad.shape, ", got ",
           o.dout.shape);
  return {};
}

kernels::EmbeddingDesc forward_desc(const EmbeddingParams& p, const EmbeddingOperands<Operand>& o) {
  return describe("embedding", p, *o.table.meta, *o.tokens.meta);
}

kernels::EmbeddingDesc backward_desc(const EmbeddingParams& p, const EmbeddingBackwardOperands<Operand>& o) {
  kernels::EmbeddingDesc desc = describe("embedding_backward", p, *o.grad.meta, *o.tokens.meta);
  desc.dtype = o.dout.dtype();
  return desc;
}

}  // namespace

const OpDef& embedding_op() {
  static const OpDef op{
      .name = kForward,
      .check = check_forward,
      .mutated_inputs_for = written_inputs_of<EmbeddingOperands, EmbeddingParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const EmbeddingParams& p = params.as<EmbeddingParams>();
            const auto o = bind_args<EmbeddingOperands>(p, a);
            kernels::launch_embedding_forward(forward_desc(p, o), o.table.data, o.tokens.as<const std::int32_t>(),
                                              a.outputs[0], o.error_flag.as<std::int32_t>(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const EmbeddingParams& p = params.as<EmbeddingParams>();
            const auto o = bind_args<EmbeddingOperands>(p, a);
            kernels::host::embedding_forward(forward_desc(p, o), o.table.data, o.tokens.as<const std::int32_t>(),
                                             a.outputs[0], o.error_flag.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(embedding_op);

const OpDef& embedding_backward_op() {
  static const OpDef op{
      .name = kBackward,
      .check = check_backward,
      .mutated_inputs_for = written_inputs_of<EmbeddingBackwardOperands, EmbeddingParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const EmbeddingParams& p = params.as<EmbeddingParams>();
            const auto o = bind_args<EmbeddingBackwardOperands>(p, a);
            kernels::launch_embedding_backward(backward_desc(p, o), o.dout.data, o.tokens.as<const std::int32_t>(),
                                               o.grad.as<float>(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const EmbeddingParams& p = params.as<EmbeddingParams>();
            const auto o = bind_args<EmbeddingBackwardOperands>(p, a);
            kernels::host::embedding_backward(backward_desc(p, o), o.dout.data, o.tokens.as<const std::int32_t>(),
                                              o.grad.as<float>());
          },
  };
  return op;
}
SG_REGISTER_OP(embedding_backward_op);

Tensor embedding(Context& ctx, const Tensor& table, const Tensor& tokens, const Tensor& error_flag,
                 const EmbeddingParams& params) {
  return ctx
      .call(embedding_op(), params,
            flatten(kForward, params,
                    EmbeddingOperands<Tensor>{.table = table, .tokens = tokens, .error_flag = error_flag}))
      .front();
}

void embedding_backward_(Context& ctx, const Tensor& grad, const Tensor& dout, const Tensor& tokens,
                         const EmbeddingParams& params) {
  ctx.call(
      embedding_backward_op(), params,
      flatten(kBackward, params, EmbeddingBackwardOperands<Tensor>{.grad = grad, .dout = dout, .tokens = tokens}));
}

}  // namespace stepgraph::ops
