// Host reference of kernels/gemm.h: the same GemmDesc and operands, computed
// in fp32 (bf16/fp16 inputs widened, FP8 inputs decoded and multiplied by
// their scale_inv, read from host memory here; outputs rounded to nearest even).
#pragma once

#include "kernels/gemm.h"

namespace stepgraph::kernels::host {

void gemm(const GemmDesc& desc, const GemmOperands& operands);

// gelu_tanh and its derivative, as the GPU epilogues and kernels compute them.
float gelu_tanh(float x);
float gelu_tanh_grad(float x);

}  // namespace stepgraph::kernels::host
