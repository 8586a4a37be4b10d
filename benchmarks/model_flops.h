// Model FLOPs of one training step, counted the way MFU is usually counted:
// matmuls only, 6 FLOPs per token per matmul parameter a token passes
// through (2 forward, 2 for the input gradient, 2 for the weight gradient).
// Norms, GeLU, biases, softmax, the loss and the optimizer count nothing.
//
// Per token, the matmul parameters a token passes through are:
//   dense block   2 * hidden * ffn                      (fc1 and fc2)
//   MoE block     hidden * experts                      (the router)
//                 + topk * 2 * hidden * ffn             (its k experts)
//   LM head       hidden * vocab
// Which blocks are MoE follows ResidualStackConfig: with experts > 0, blocks
// moe_every-1, 2*moe_every-1, ...
#pragma once

#include <cstdint>

#include "layers/residual_stack.h"

namespace stepgraph::bench {

// Dense bf16 peak of an H100 SXM (TFLOP/s), the denominator of MFU.
inline constexpr double kH100PeakTflops = 989.0;

// Matmul parameters one token passes through (see above).
std::int64_t matmul_params_per_token(const ResidualStackConfig& config);

// 6 * tokens * matmul_params_per_token(config).
double step_flops(const ResidualStackConfig& config, std::int64_t tokens);

// TFLOP/s of `flops` done in `seconds`, and its fraction of kH100PeakTflops.
double tflops_per_s(double flops, double seconds);
double mfu(double tflops);

}  // namespace stepgraph::bench
