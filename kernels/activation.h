// GeLU (tanh approximation) forward and backward where it is not fused into a
// GEMM epilogue, and the residual add. x, y, dy, dx share one dtype (bf16,
// fp16 or fp32); n elements; 16-byte vector access with a scalar tail, so any
// n works, but pointers must be 16-byte aligned (Error otherwise).
//
//   gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

void launch_gelu_forward(DType dtype, const void* x, void* y, std::int64_t n, cudaStream_t stream);
// dx = dy * gelu_tanh'(x)
void launch_gelu_backward(DType dtype, const void* dy, const void* x, void* dx, std::int64_t n, cudaStream_t stream);
// out = a + b (out may alias a or b)
void launch_residual_add(DType dtype, const void* a, const void* b, void* out, std::int64_t n, cudaStream_t stream);

namespace host {
void gelu_forward(DType dtype, const void* x, void* y, std::int64_t n);
void gelu_backward(DType dtype, const void* dy, const void* x, void* dx, std::int64_t n);
void residual_add(DType dtype, const void* a, const void* b, void* out, std::int64_t n);
}  // namespace host

}  // namespace stepgraph::kernels
