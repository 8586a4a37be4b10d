// Mixture-of-experts load balancing on the device (See Note [MoE load
// balancing] in layers/moe_mlp.h), with host references:
//
//   router_aux_loss           logits [T, E], splits int32 [E] -> aux fp32 [1]
//   router_aux_loss_backward  dlogits_in [T, E] -> dlogits_out = dlogits_in + d aux / d logits
//   expert_bias_update        bias fp32 [E] += rate * sign(mean load - load_e), in place
//
// The Switch auxiliary loss over one call's T tokens routed to k experts each:
//   aux = coef E sum_e f_e P_e,   f_e = splits_e / (T k),   P_e = (1/T) sum_t p_te
// with p = softmax(logits) over the E experts (fp32 math). f carries no
// gradient, so d aux / d p_te = coef E f_e / T =: g_e, the same for every
// token, and through the softmax
//   d aux / d l_tm = p_tm (g_m - sum_e g_e p_te).
// The backward multiplies that by `grad_factor` (the loss's scale, e.g. 1/N
// over N data-parallel ranks) and, where given, by the dynamic loss scale
// state[0] (Note [Loss scaling] in kernels/step_guard.h), as the language
// model loss's gradient is.
//
// The value is a sum over tokens in a fixed order (one block, a fixed tree),
// so it is the same bits on every run; every d logits element is one token's.
//
// The bias update compares integers: sign(sum / E - load_e) is
// sign(sum - E load_e), exact for any counts, so every rank that holds the
// same counts moves the same biases by the same +-rate (0 at the mean).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

struct AuxLossDesc {
  DType logits_type = DType::kBFloat16;  // bf16, fp16 or fp32; d logits share it
  std::int64_t tokens = 0;
  std::int64_t experts = 0;
  int topk = 1;
  float coef = 0.0f;
};

// tokens in [1, 2^31 / topk), experts in [topk, kMaxExperts], topk in [1, kMaxTopk], coef finite and >= 0.
void check_aux_loss(const AuxLossDesc& desc);

// aux[0] = coef E / (T^2 k) sum_t sum_e splits_e p_te.
void launch_router_aux_loss(const AuxLossDesc& desc, const void* logits, const std::int32_t* splits, float* aux,
                            cudaStream_t stream);
// dlogits_out = dlogits_in + grad_factor (loss_scale ? loss_scale[0] : 1) d aux / d logits.
// dlogits_out may be dlogits_in.
void launch_router_aux_loss_backward(const AuxLossDesc& desc, float grad_factor, const void* logits,
                                     const std::int32_t* splits, const float* loss_scale, const void* dlogits_in,
                                     void* dlogits_out, cudaStream_t stream);

// bias[e] += rate * sign(sum(counts) - E counts[e]) for e in [0, experts).
void launch_expert_bias_update(std::int64_t experts, float rate, const std::int32_t* counts, float* bias,
                               cudaStream_t stream);

namespace host {
void router_aux_loss(const AuxLossDesc& desc, const void* logits, const std::int32_t* splits, float* aux);
void router_aux_loss_backward(const AuxLossDesc& desc, float grad_factor, const void* logits,
                              const std::int32_t* splits, const float* loss_scale, const void* dlogits_in,
                              void* dlogits_out);
void expert_bias_update(std::int64_t experts, float rate, const std::int32_t* counts, float* bias);
}  // namespace host

}  // namespace stepgraph::kernels
