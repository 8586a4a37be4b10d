#include "ops/loss_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/cross_entropy.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string CrossEntropyParams::to_string() const {
  char text[64];
  std::snprintf(text, sizeof(text), "ignore=%lld, scale=%g", static_cast<long long>(ignore_index),
                static_cast<double>(loss_scale));
  return text;
}

namespace {

template <typename F>
struct CrossEntropyOperands {
  F logits;      // [tokens, vocab]
  F labels;      // [tokens]
  F error_flag;  // int32 [1], raised on a bad label
};

template <typename F, typename V>
void visit_operands(const CrossEntropyParams&, CrossEntropyOperands<F>& o, V& v) {
  v({"logits"}, o.logits);
  v({"labels"}, o.labels);
  v({.name = "error_flag", .use = Use::kWrite}, o.error_flag);
}

template <typename F>
struct CrossEntropyOutputs {
  F loss;     // fp32 []
  F dlogits;  // like the logits
  F scratch;  // fp32, the kernel's workspace
};

template <typename F, typename V>
void visit_operands(const CrossEntropyParams&, CrossEntropyOutputs<F>& o, V& v) {
  v({"loss"}, o.loss);
  v({"dlogits"}, o.dlogits);
  v({"scratch"}, o.scratch);
}

constexpr std::string_view kCrossEntropy = "cross_entropy";

kernels::CrossEntropyDesc describe(const CrossEntropyParams& p, const TensorMeta& logits, const TensorMeta& labels) {
  kernels::CrossEntropyDesc desc;
  desc.logits_type = logits.dtype;
  desc.label_type = labels.dtype;
  desc.tokens = logits.shape.rank() == 2 ? logits.shape.dim(0) : 0;
  desc.vocab = logits.shape.rank() == 2 ? logits.shape.dim(1) : 0;
  desc.ignore_index = p.ignore_index;
  desc.loss_scale = p.loss_scale;
  return desc;
}

std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<CrossEntropyParams>();
  const auto o = bind_metas<CrossEntropyOperands>(kCrossEntropy, p, inputs);
  SG_CHECK(o.logits.shape.rank() == 2, "op cross_entropy: logits must be [tokens, vocab], got ", o.logits.shape);
  SG_CHECK(o.labels.shape == Shape{o.logits.shape.dim(0)}, "op cross_entropy: labels must be [", o.logits.shape.dim(0),
           "] to match the logits ", o.logits.shape, ", got ", o.labels.shape);
  SG_CHECK(o.error_flag == (TensorMeta{Shape{1}, DType::kInt32}),
           "op cross_entropy: the error flag must be int32 [1], got ", o.error_flag.shape, " ",
           dtype_name(o.error_flag.dtype));
  const kernels::CrossEntropyDesc desc = describe(p, o.logits, o.labels);
  kernels::check_cross_entropy(desc);
  const auto scratch = static_cast<std::int64_t>((kernels::cross_entropy_workspace_bytes(desc) + 3) / 4);
  return output_metas(
      p, CrossEntropyOutputs<TensorMeta>{
             .loss = {Shape{}, DType::kFloat32}, .dlogits = o.logits, .scratch = {Shape{scratch}, DType::kFloat32}});
}

}  // namespace

const OpDef& cross_entropy_op() {
  static const OpDef op{
      .name = kCrossEntropy,
      .check = check,
      .mutated_inputs_for = written_inputs_of<CrossEntropyOperands, CrossEntropyParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<CrossEntropyParams>();
            const auto in = bind_args<CrossEntropyOperands>(p, a);
            const auto out = bind_outputs<CrossEntropyOutputs>(p, a);
            kernels::launch_cross_entropy(describe(p, *in.logits.meta, *in.labels.meta), in.logits.data, in.labels.data,
                                          out.loss.as<float>(), out.dlogits.data, out.scratch.data,
                                          in.error_flag.as<std::int32_t>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<CrossEntropyParams>();
            const auto in = bind_args<CrossEntropyOperands>(p, a);
            const auto out = bind_outputs<CrossEntropyOutputs>(p, a);
            kernels::host::cross_entropy(describe(p, *in.logits.meta, *in.labels.meta), in.logits.data, in.labels.data,
                                         out.loss.as<float>(), out.dlogits.data);
          },
  };
  return op;
}
SG_REGISTER_OP(cross_entropy_op);

CrossEntropyResult cross_entropy(Context& ctx, const Tensor& logits, const Tensor& labels, const Tensor& error_flag,
                                 const CrossEntropyParams& params) {
  const std::vector<Tensor> out =
      ctx.call(cross_entropy_op(), params,
               flatten(kCrossEntropy, params,
                       CrossEntropyOperands<Tensor>{.logits = logits, .labels = labels, .error_flag = error_flag}));
  const auto r = bind_results<CrossEntropyOutputs>(params, out);
  return {r.loss, r.dlogits};
}

}  // namespace stepgraph::ops
