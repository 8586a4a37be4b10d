#include "ops/moe_balance_ops.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/moe_balance.h"
#include "kernels/moe_routing.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string AuxLossParams::to_string() const {
  char text[96];
  std::snprintf(text, sizeof(text), "coef=%g, k=%d, grad_factor=%g", static_cast<double>(coef), topk,
                static_cast<double>(grad_factor));
  return text;
}

std::string BiasUpdateParams::to_string() const {
  char text[48];
  std::snprintf(text, sizeof(text), "rate=%g", static_cast<double>(rate));
  return text;
}

namespace {

constexpr std::string_view kAuxLoss = "router_aux_loss";
constexpr std::string_view kAuxLossBackward = "router_aux_loss_backward";
constexpr std::string_view kBiasUpdate = "expert_bias_update_";

template <typename F>
struct AuxLossOperands {
  F logits;  // [T, E]
  F splits;  // int32 [E]
};

template <typename F, typename V>
void visit_operands(const AuxLossParams&, AuxLossOperands<F>& o, V& v) {
  v({"logits"}, o.logits);
  v({"splits"}, o.splits);
}

template <typename F>
struct AuxLossBackwardOperands {
  F dlogits;     // [T, E]
  F logits;      // [T, E]
  F splits;      // int32 [E]
  F loss_scale;  // fp32 [3], optional
};

template <typename F, typename V>
void visit_operands(const AuxLossParams&, AuxLossBackwardOperands<F>& o, V& v) {
  v({"dlogits"}, o.dlogits);
  v({"logits"}, o.logits);
  v({"splits"}, o.splits);
  v.optional_last({"loss_scale"}, o.loss_scale);
}

template <typename F>
struct BiasUpdateOperands {
  F bias;    // fp32 [E], written
  F counts;  // int32 [E]
};

template <typename F, typename V>
void visit_operands(const BiasUpdateParams&, BiasUpdateOperands<F>& o, V& v) {
  v({.name = "bias", .use = Use::kWrite}, o.bias);
  v({"counts"}, o.counts);
}

kernels::AuxLossDesc aux_desc(const AuxLossParams& p, const TensorMeta& logits) {
  return {logits.dtype, logits.shape.dim(0), logits.shape.dim(1), p.topk, p.coef};
}

// logits [T, E] and splits int32 [E]; returns the desc.
kernels::AuxLossDesc check_logits_and_splits(std::string_view op, const AuxLossParams& p, const TensorMeta& logits,
                                             const TensorMeta& splits) {
  SG_CHECK(logits.shape.rank() == 2, "op ", op, ": logits must be a matrix [tokens, experts], got ", logits.shape);
  const kernels::AuxLossDesc desc = aux_desc(p, logits);
  kernels::check_aux_loss(desc);
  const TensorMeta want{Shape{desc.experts}, DType::kInt32};
  SG_CHECK(splits == want, "op ", op, ": splits must be [",
           desc.experts, "] int32 (one count per expert), got ", splits.shape, " ", dtype_name(splits.dtype));
  return desc;
}

std::vector<TensorMeta> check_aux_loss(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<AuxLossParams>();
  const auto o = bind_metas<AuxLossOperands>(kAuxLoss, p, in);
  check_logits_and_splits(kAuxLoss, p, o.logits, o.splits);
  return {TensorMeta{Shape{1}, DType::kFloat32}};
}

std::vector<TensorMeta> check_aux_loss_backward(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<AuxLossParams>();
  const auto o = bind_metas<AuxLossBackwardOperands>(kAuxLossBackward, p, in);
  check_logits_and_splits(kAuxLossBackward, p, o.logits, o.splits);
  SG_CHECK(o.dlogits == o.logits, "op router_aux_loss_backward: dlogits must be ", o.logits.shape, " ",
           dtype_name(o.logits.dtype), " (the logits'), got ", o.dlogits.shape, " ", dtype_name(o.dlogits.dtype));
  SG_CHECK(std::isfinite(p.grad_factor), "op router_aux_loss_backward: grad_factor must be finite, got ",
           p.grad_factor);
  if (operand_layout<AuxLossBackwardOperands>(p, in.size()).at.loss_scale >= 0) {
    SG_CHECK(o.loss_scale.dtype == DType::kFloat32 && o.loss_scale.shape.rank() == 1 &&
                 o.loss_scale.shape.dim(0) >= 1,
             "op router_aux_loss_backward: loss_scale must be the fp32 loss-scale state {S, 1/S, good steps}, got ",
             o.loss_scale.shape, " ", dtype_name(o.loss_scale.dtype));
  }
  return {o.logits};
}

std::vector<TensorMeta> check_bias_update(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<BiasUpdateParams>();
  const auto o = bind_metas<BiasUpdateOperands>(kBiasUpdate, p, in);
  SG_CHECK(o.bias.shape.rank() == 1 && o.bias.dtype == DType::kFloat32 && o.bias.shape.dim(0) >= 1 &&
               o.bias.shape.dim(0) <= kernels::kMaxExperts,
           "op expert_bias_update_: bias must be fp32 [E] with 1 <= E <= ", kernels::kMaxExperts, ", got ",
           o.bias.shape, " ", dtype_name(o.bias.dtype));
  const TensorMeta counts{o.bias.shape, DType::kInt32};
  SG_CHECK(o.counts == counts, "op expert_bias_update_: counts must be ",
           o.bias.shape, " int32 (tokens per expert), got ", o.counts.shape, " ", dtype_name(o.counts.dtype));
  SG_CHECK(std::isfinite(p.rate) && p.rate >= 0.0f, "op expert_bias_update_: rate must be finite and >= 0, got ",
           p.rate);
  return {};
}

}  // namespace

const OpDef& router_aux_loss_op() {
  static const OpDef op{
      .name = kAuxLoss,
      .check = check_aux_loss,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<AuxLossParams>();
            const auto o = bind_args<AuxLossOperands>(p, a);
            kernels::launch_router_aux_loss(aux_desc(p, *o.logits.meta), o.logits.data, o.splits.as<std::int32_t>(),
                                            static_cast<float*>(a.outputs[0]), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<AuxLossParams>();
            const auto o = bind_args<AuxLossOperands>(p, a);
            kernels::host::router_aux_loss(aux_desc(p, *o.logits.meta), o.logits.data, o.splits.as<std::int32_t>(),
                                           static_cast<float*>(a.outputs[0]));
          },
  };
  return op;
}
SG_REGISTER_OP(router_aux_loss_op);

const OpDef& router_aux_loss_backward_op() {
  static const OpDef op{
      .name = kAuxLossBackward,
      .check = check_aux_loss_backward,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<AuxLossParams>();
            const auto o = bind_args<AuxLossBackwardOperands>(p, a);
            kernels::launch_router_aux_loss_backward(aux_desc(p, *o.logits.meta), p.grad_factor, o.logits.data,
                                                     o.splits.as<std::int32_t>(), o.loss_scale.as<const float>(),
                                                     o.dlogits.data, a.outputs[0], s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<AuxLossParams>();
            const auto o = bind_args<AuxLossBackwardOperands>(p, a);
            kernels::host::router_aux_loss_backward(aux_desc(p, *o.logits.meta), p.grad_factor, o.logits.data,
                                                    o.splits.as<std::int32_t>(), o.loss_scale.as<const float>(),
                                                    o.dlogits.data, a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(router_aux_loss_backward_op);

const OpDef& expert_bias_update_op() {
  static const OpDef op{
      .name = kBiasUpdate,
      .check = check_bias_update,
      .mutated_inputs_for = written_inputs_of<BiasUpdateOperands, BiasUpdateParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<BiasUpdateParams>();
            const auto o = bind_args<BiasUpdateOperands>(p, a);
            kernels::launch_expert_bias_update(o.bias.numel(), p.rate, o.counts.as<std::int32_t>(), o.bias.as<float>(),
                                               s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<BiasUpdateParams>();
            const auto o = bind_args<BiasUpdateOperands>(p, a);
            kernels::host::expert_bias_update(o.bias.numel(), p.rate, o.counts.as<std::int32_t>(), o.bias.as<float>());
          },
  };
  return op;
}
SG_REGISTER_OP(expert_bias_update_op);

Tensor router_aux_loss(Context& ctx, const Tensor& logits, const Tensor& splits, const AuxLossParams& params) {
  Tensor out = ctx.call(router_aux_loss_op(), params,
                        flatten(kAuxLoss, params, AuxLossOperands<Tensor>{logits, splits}))
                   .front();
  out.set_name("moe.aux_loss");
  return out;
}

Tensor router_aux_loss_backward(Context& ctx, const Tensor& dlogits, const Tensor& logits, const Tensor& splits,
                                const Tensor& loss_scale, const AuxLossParams& params) {
  return ctx
      .call(router_aux_loss_backward_op(), params,
            flatten(kAuxLossBackward, params,
                    AuxLossBackwardOperands<Tensor>{dlogits, logits, splits, loss_scale}))
      .front();
}

void expert_bias_update_(Context& ctx, const Tensor& bias, const Tensor& counts, const BiasUpdateParams& params) {
  ctx.call(expert_bias_update_op(), params, flatten(kBiasUpdate, params, BiasUpdateOperands<Tensor>{bias, counts}));
}

}  // namespace stepgraph::ops
