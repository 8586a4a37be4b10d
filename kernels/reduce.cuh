// Warp and block reductions shared by the kernels (sums and maxima in fp32).
// Fixed shuffle and tree orders: results are bitwise reproducible run to run.
#pragma once

namespace stepgraph::kernels {

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats
// of shared memory; blockDim.x must be a multiple of 32. Synchronizes the block.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = warp_sum(value);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / 32;
  value = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(value);
}

// Maximum over the block; as block_sum.
__device__ __forceinline__ float block_max(float value, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = warp_max(value);
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / 32;
  value = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(value);
}

}  // namespace stepgraph::kernels
