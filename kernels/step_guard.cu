#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/launch_config.cuh"
#include "kernels/loss_scale_rule.h"
#include "kernels/step_guard.h"
#include "kernels/vector_io.cuh"

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

__global__ void loss_scale_update_kernel(LossScaling scaling, float* state, const std::int32_t* flag) {
  loss_scale_step(scaling, state, *flag != 0);
}

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    scale_by_loss_scale_kernel(T* __restrict__ x, std::int64_t count, const float* __restrict__ state) {
  const float scale = state[0];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    x[i] = from_float<T>(to_float(x[i]) * scale);
  }
}

}  // namespace

void launch_loss_scale_update(const LossScaling& scaling, float* state, const std::int32_t* flag,
                              cudaStream_t stream) {
  check_loss_scaling(scaling);
  SG_CHECK(state != nullptr && flag != nullptr, "loss_scale_update: state and flag must be device pointers");
  loss_scale_update_kernel<<<1, 1, 0, stream>>>(scaling, state, flag);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_scale_by_loss_scale(DType dtype, void* x, std::int64_t count, const float* state, cudaStream_t stream) {
  SG_CHECK(count >= 0 && state != nullptr && (x != nullptr || count == 0),
           "scale_by_loss_scale: needs count >= 0, the values and the device state, got count ", count);
  if (count == 0) return;
  const std::int64_t blocks = std::min<std::int64_t>((count + kThreadsPerBlock - 1) / kThreadsPerBlock, 4096);
  const unsigned grid = static_cast<unsigned>(blocks);
  switch (dtype) {
    case DType::kFloat32:
      scale_by_loss_scale_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(static_cast<float*>(x), count, state);
      break;
    case DType::kBFloat16:
      scale_by_loss_scale_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(static_cast<__nv_bfloat16*>(x), count, state);
      break;
    case DType::kFloat16:
      scale_by_loss_scale_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(static_cast<__half*>(x), count, state);
      break;
    default:
      SG_THROW(ErrorCode::kInvalidArgument, "scale_by_loss_scale: fp32, bf16 or fp16 values, got ", dtype_name(dtype));
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

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
