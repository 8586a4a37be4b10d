#include <algorithm>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/launch_config.cuh"
#include "kernels/step_guard.h"

namespace stepgraph::kernels {
namespace {

__global__ void __launch_bounds__(kThreadsPerBlock)
    flag_nonfinite_kernel(const float* __restrict__ x, std::int64_t count, std::int32_t* flag) {
  bool bad = false;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    bad |= !isfinite(x[i]);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

__global__ void count_and_clear_flag_kernel(std::int32_t* flag, std::int64_t* skipped) {
  if (*flag != 0) *skipped += 1;
  *flag = 0;
}

}  // namespace

void launch_flag_nonfinite(const float* x, std::int64_t count, std::int32_t* flag, cudaStream_t stream) {
  SG_CHECK(count >= 0 && flag != nullptr && (x != nullptr || count == 0),
           "flag_nonfinite: needs count >= 0, a device int32 flag and the values, got count ", count);
  if (count == 0) return;
  const std::int64_t blocks = std::min<std::int64_t>((count + kThreadsPerBlock - 1) / kThreadsPerBlock, 1024);
  flag_nonfinite_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(x, count, flag);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_count_and_clear_flag(std::int32_t* flag, std::int64_t* skipped, cudaStream_t stream) {
  SG_CHECK(flag != nullptr && skipped != nullptr, "count_and_clear_flag: flag and skipped must be device pointers");
  count_and_clear_flag_kernel<<<1, 1, 0, stream>>>(flag, skipped);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
