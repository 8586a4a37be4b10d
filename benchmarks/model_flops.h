// Model FLOPs of one training step, counted the way MFU is usually counted:
// matmuls only, 6 FLOPs per token per matmul parameter a token passes
// through (2 forward, 2 for the input gradient, 2 for the weight gradient),
// plus the attention core (QK^T and PV), which has no parameters. Norms,
// GeLU, rotary, biases, softmax, the loss and the optimizer count nothing.
//
// Per token, the matmul parameters a token passes through are:
//   attention     hidden * (H + 2 Hkv) * D              (the QKV projection)
//   (heads > 0)   + H * D * hidden                      (the output projection)
//   dense MLP     2 * hidden * ffn                      (fc1 and fc2)
//   MoE MLP       hidden * experts                      (the router)
//                 + topk * 2 * hidden * ffn             (its k experts)
//   LM head       hidden * vocab
// (H heads, Hkv key/value heads, D = hidden / H.) Which MLPs are MoE follows
// ResidualStackConfig: with experts > 0, blocks moe_every-1, 2*moe_every-1, ...
//
// Note [Attention core FLOPs]
// Per layer and sequence of L tokens, QK^T and PV are each 2 * L * L * H * D
// FLOPs computed in full; causal attention counts half of each (L^2 / 2
// query-key pairs: FlashAttention's convention, the diagonal's L / 2 pairs
// ignored), so the forward is
//   2 * 2 * (L^2 / 2) * H * D = 2 * L^2 * H * D
// and the backward 2.5 x the forward (FlashAttention's convention: dV, dP,
// dQ, dK and the recomputed QK^T, five matmuls against the forward's two), a
// step 3.5 x the forward:
//   attention core = layers * sum over sequences of 7 * L^2 * H * D.
// With `sequences` equal sequences of L = tokens / sequences, that is
// layers * sequences * 7 * L^2 * H * D.
#pragma once

#include <cstdint>

#include "layers/residual_stack.h"

namespace stepgraph::bench {

// Dense bf16 peak of an H100 SXM (TFLOP/s), the denominator of MFU.
inline constexpr double kH100PeakTflops = 989.0;

// Matmul parameters one token passes through (see above).
std::int64_t matmul_params_per_token(const ResidualStackConfig& config);

// The attention core's FLOPs of one step (Note [Attention core FLOPs]) over
// `sequences` equal sequences of tokens / sequences (which must divide);
// 0 without attention (heads = 0).
double attention_core_flops(const ResidualStackConfig& config, std::int64_t tokens, std::int64_t sequences);

// 6 * tokens * matmul_params_per_token(config)
//   + attention_core_flops(config, tokens, sequences).
double step_flops(const ResidualStackConfig& config, std::int64_t tokens, std::int64_t sequences = 1);

// TFLOP/s of `flops` done in `seconds`, and its fraction of kH100PeakTflops.
double tflops_per_s(double flops, double seconds);
double mfu(double tflops);

}  // namespace stepgraph::bench
