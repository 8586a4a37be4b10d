// Mixture-of-experts load-balancing ops (kernels/moe_balance.h; See Note [MoE
// load balancing] in layers/moe_mlp.h), on the device and capturable:
//
//   Tensor aux = ops::router_aux_loss(ctx, logits, plan.splits, {.coef = 0.01f, .topk = 2});   // fp32 [1]
//   dlogits = ops::router_aux_loss_backward(ctx, dlogits, logits, plan.splits, loss_scale,
//                                           {.coef = 0.01f, .topk = 2, .grad_factor = 0.5f});
//   ops::expert_bias_update_(ctx, bias, counts, {.rate = 1e-3f});                             // in place
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

struct AuxLossParams {
  float coef = 0.0f;
  int topk = 1;
  // The backward's factor on d aux / d logits (the loss's scale: 1/N over N
  // data-parallel ranks); the forward ignores it.
  float grad_factor = 1.0f;
  bool operator==(const AuxLossParams&) const = default;
  std::string to_string() const;
};

struct BiasUpdateParams {
  float rate = 0.0f;
  bool operator==(const BiasUpdateParams&) const = default;
  std::string to_string() const;
};

// logits [T, E] (bf16, fp16, fp32), splits int32 [E] (the (token, slot)
// assignments per expert, adding up to T k) -> the Switch auxiliary loss,
// fp32 [1].
Tensor router_aux_loss(Context& ctx, const Tensor& logits, const Tensor& splits, const AuxLossParams& params);
// dlogits + grad_factor S d aux / d logits (logits' dtype and shape), S the
// dynamic loss scale state's [0] where `loss_scale` (fp32 [3]) is given.
Tensor router_aux_loss_backward(Context& ctx, const Tensor& dlogits, const Tensor& logits, const Tensor& splits,
                                const Tensor& loss_scale, const AuxLossParams& params);
// bias fp32 [E] += rate * sign(mean(counts) - counts[e]), in place; counts int32 [E].
void expert_bias_update_(Context& ctx, const Tensor& bias, const Tensor& counts, const BiasUpdateParams& params);

const OpDef& router_aux_loss_op();
const OpDef& router_aux_loss_backward_op();
const OpDef& expert_bias_update_op();

}  // namespace stepgraph::ops
