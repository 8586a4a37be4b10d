// Elementwise fp32 kernels: fill and axpy. Each launcher checks its arguments,
// launches on the given stream (captured or not) and checks the launch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace stepgraph::kernels {

// out[i] = value for i in [0, n).
void launch_fill_f32(float* out, float value, std::int64_t n, cudaStream_t stream);

// y[i] += alpha * x[i] for i in [0, n).
void launch_axpy_f32(float* y, const float* x, float alpha, std::int64_t n, cudaStream_t stream);

}  // namespace stepgraph::kernels
