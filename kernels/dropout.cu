#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/dropout.h"
#include "kernels/launch_config.cuh"
#include "kernels/philox.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

// One thread per draw: four elements.
template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    dropout_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t count, std::uint32_t threshold,
                   float scale, const std::int64_t* __restrict__ state, std::int64_t offset) {
  const auto seed = static_cast<std::uint64_t>(state[0]);
  const auto first = static_cast<std::uint64_t>(state[1] + offset);
  grid_stride((count + 3) / 4, [&](std::int64_t d) {  // dropout_draws(count)
    const Philox4 r = philox4x32_10(first + static_cast<std::uint64_t>(d), 0, seed);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::int64_t i = 4 * d + k;
      if (i < count) y[i] = from_float<T>(r.v[k] >= threshold ? to_float(x[i]) * scale : 0.0f);
    }
  });
}

__global__ void rng_advance_kernel(std::int64_t* state, std::int64_t draws) { state[1] += draws; }

}  // namespace

void launch_dropout(const DropoutDesc& desc, const void* x, void* y, const std::int64_t* state, cudaStream_t stream) {
  check_dropout(desc);
  SG_CHECK(state != nullptr && (desc.count == 0 || (x != nullptr && y != nullptr)),
           "dropout: x, y and the device state {seed, counter} must be given");
  if (desc.count == 0) return;
  const std::uint32_t threshold = dropout_threshold(desc.p);
  const float scale = 1.0f / (1.0f - desc.p);
  const int blocks = blocks_for(dropout_draws(desc.count));
  auto launch = [&](auto zero) {
    using T = decltype(zero);
    dropout_kernel<T><<<blocks, kThreadsPerBlock, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), desc.count,
                                                               threshold, scale, state, desc.offset);
  };
  switch (desc.dtype) {
    case DType::kFloat32: launch(float{}); break;
    case DType::kBFloat16: launch(__nv_bfloat16{}); break;
    default: launch(__half{}); break;
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_rng_advance(std::int64_t* state, std::int64_t draws, cudaStream_t stream) {
  SG_CHECK(state != nullptr && draws >= 0, "rng_advance: needs the device state and draws >= 0, got ", draws);
  rng_advance_kernel<<<1, 1, 0, stream>>>(state, draws);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
