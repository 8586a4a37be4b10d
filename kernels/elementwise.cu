#include "kernels/elementwise.h"

#include <algorithm>

#include "engine/cuda_check.h"

namespace stepgraph::kernels {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops: a bounded grid covers any n; 4 waves of 132 SMs' worth
// of blocks keeps an H100 busy without launching millions of blocks.
constexpr std::int64_t kMaxBlocks = 4 * 132 * 8;

int blocks_for(std::int64_t n) {
  return static_cast<int>(std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

__global__ void fill_f32_kernel(float* out, float value, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

__global__ void axpy_f32_kernel(float* y, const float* x, float alpha, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    y[i] += alpha * x[i];
  }
}

}  // namespace

void launch_fill_f32(float* out, float value, std::int64_t n, cudaStream_t stream) {
  SG_CHECK(n >= 0, "fill_f32: element count must be >= 0, got ", n);
  if (n == 0) return;
  SG_CHECK(out != nullptr, "fill_f32: output pointer is null for ", n, " elements");
  fill_f32_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, value, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_axpy_f32(float* y, const float* x, float alpha, std::int64_t n, cudaStream_t stream) {
  SG_CHECK(n >= 0, "axpy_f32: element count must be >= 0, got ", n);
  if (n == 0) return;
  SG_CHECK(y != nullptr && x != nullptr, "axpy_f32: null pointer (y=", y, ", x=", x, ") for ", n, " elements");
  axpy_f32_kernel<<<blocks_for(n), kThreads, 0, stream>>>(y, x, alpha, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
