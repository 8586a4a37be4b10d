#include "ops/loss_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/cross_entropy.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::string CrossEntropyParams::to_string() const {
  char text[64];
  std::snprintf(text, sizeof(text), "ignore=%lld, scale=%g", static_cast<long long>(ignore_index),
                static_cast<double>(loss_scale));
  return text;
}

namespace {

kernels::CrossEntropyDesc describe(const CrossEntropyParams& p, std::span<const TensorMeta> inputs) {
  kernels::CrossEntropyDesc desc;
  desc.logits_type = inputs[0].dtype;
  desc.label_type = inputs[1].dtype;
  desc.tokens = inputs[0].shape.rank() == 2 ? inputs[0].shape.dim(0) : 0;
  desc.vocab = inputs[0].shape.rank() == 2 ? inputs[0].shape.dim(1) : 0;
  desc.ignore_index = p.ignore_index;
  desc.loss_scale = p.loss_scale;
  return desc;
}

// Inputs: logits [tokens, vocab], labels [tokens], error_flag int32 [1] (written).
std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 3, "op cross_entropy takes logits, labels and an error flag, got ", inputs.size(),
           " inputs");
  SG_CHECK(inputs[0].shape.rank() == 2, "op cross_entropy: logits must be [tokens, vocab], got ", inputs[0].shape);
  SG_CHECK(inputs[1].shape == Shape{inputs[0].shape.dim(0)}, "op cross_entropy: labels must be [",
           inputs[0].shape.dim(0), "] to match the logits ", inputs[0].shape, ", got ", inputs[1].shape);
  SG_CHECK(inputs[2] == (TensorMeta{Shape{1}, DType::kInt32}),
           "op cross_entropy: the error flag must be int32 [1], got ", inputs[2].shape, " ",
           dtype_name(inputs[2].dtype));
  const kernels::CrossEntropyDesc desc = describe(params.as<CrossEntropyParams>(), inputs);
  kernels::check_cross_entropy(desc);
  const auto scratch = static_cast<std::int64_t>((kernels::cross_entropy_workspace_bytes(desc) + 3) / 4);
  return {TensorMeta{Shape{}, DType::kFloat32}, inputs[0], TensorMeta{Shape{scratch}, DType::kFloat32}};
}

}  // namespace

const OpDef& cross_entropy_op() {
  static const OpDef op{
      .name = "cross_entropy",
      .check = check,
      .mutated_inputs = {2},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_cross_entropy(describe(params.as<CrossEntropyParams>(), a.input_metas), a.inputs[0],
                                          a.inputs[1], static_cast<float*>(a.outputs[0]), a.outputs[1], a.outputs[2],
                                          static_cast<std::int32_t*>(a.inputs[2]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::cross_entropy(describe(params.as<CrossEntropyParams>(), a.input_metas), a.inputs[0],
                                         a.inputs[1], static_cast<float*>(a.outputs[0]), a.outputs[1]);
          },
  };
  return op;
}
SG_REGISTER_OP(cross_entropy_op);

CrossEntropyResult cross_entropy(Context& ctx, const Tensor& logits, const Tensor& labels, const Tensor& error_flag,
                                 const CrossEntropyParams& params) {
  std::vector<Tensor> out = ctx.call(cross_entropy_op(), params, {logits, labels, error_flag});
  return {out[0], out[1]};
}

}  // namespace stepgraph::ops
