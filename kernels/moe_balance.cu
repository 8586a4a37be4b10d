// Load-balancing kernels (See kernels/moe_balance.h):
//   aux loss:   one block; warp w takes tokens w, w + 32, ... in order, each
//               warp's sum in token order, then a fixed tree over the warps:
//               the same bits every run, no atomics.
//   backward:   a warp per token (its softmax, its dot with the splits).
//   bias:       one block, a thread per expert; the counts' sum by thread 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/moe_balance.h"
#include "kernels/moe_routing.cuh"
#include "kernels/moe_routing.h"
#include "kernels/reduce.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kAuxThreads = 1024;
constexpr int kWarpsPerBlock = 8;

// Token row's softmax pieces on every lane: the max logit, 1 / sum exp(l - max),
// and sum_e splits_e exp(l_e - max) / sum.
template <typename T>
__device__ void softmax_dot(const T* row, int experts, const std::int32_t* splits, int lane, float& max,
                            float& inv_sum, float& dot) {
  max = -INFINITY;
  for (int e = lane; e < experts; e += 32) max = fmaxf(max, to_float(row[e]));
  max = warp_max(max);
  float sum = 0.0f, weighted = 0.0f;
  for (int e = lane; e < experts; e += 32) {
    const float x = expf(to_float(row[e]) - max);
    sum += x;
    weighted += static_cast<float>(splits[e]) * x;
  }
  inv_sum = 1.0f / warp_sum(sum);
  dot = warp_sum(weighted) * inv_sum;
}

template <typename T>
__global__ void __launch_bounds__(kAuxThreads)
    aux_loss_kernel(const T* __restrict__ logits, const std::int32_t* __restrict__ splits, std::int64_t tokens,
                    int experts, float scale, float* __restrict__ aux) {
  __shared__ float scratch[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float sum = 0.0f;
  for (std::int64_t t = warp; t < tokens; t += kAuxThreads / 32) {
    float max, inv_sum, dot;
    softmax_dot(logits + t * experts, experts, splits, lane, max, inv_sum, dot);
    sum += dot;
  }
  // Lane 0 of each warp holds the warp's sum (every lane has it); add the warps in a fixed tree.
  const float total = block_sum(lane == 0 ? sum : 0.0f, scratch);
  if (threadIdx.x == 0) aux[0] = scale * total;
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    aux_loss_backward_kernel(const T* __restrict__ logits, const std::int32_t* __restrict__ splits,
                             std::int64_t tokens, int experts, float scale, const float* __restrict__ loss_scale,
                             const T* dlogits_in, T* dlogits_out) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= tokens) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const T* row = logits + t * experts;
  float max, inv_sum, dot;
  softmax_dot(row, experts, splits, lane, max, inv_sum, dot);
  const float s = loss_scale != nullptr ? scale * loss_scale[0] : scale;
  for (int m = lane; m < experts; m += 32) {
    const float p = expf(to_float(row[m]) - max) * inv_sum;
    const std::int64_t i = t * experts + m;
    dlogits_out[i] = from_float<T>(to_float(dlogits_in[i]) + s * p * (static_cast<float>(splits[m]) - dot));
  }
}

__global__ void __launch_bounds__(kMaxExperts)
    bias_update_kernel(int experts, float rate, const std::int32_t* __restrict__ counts, float* __restrict__ bias) {
  __shared__ long long total;
  if (threadIdx.x == 0) {
    long long sum = 0;
    for (int e = 0; e < experts; ++e) sum += counts[e];
    total = sum;
  }
  __syncthreads();
  const int e = threadIdx.x;
  if (e >= experts) return;
  const long long diff = total - static_cast<long long>(experts) * counts[e];
  bias[e] += diff > 0 ? rate : (diff < 0 ? -rate : 0.0f);
}

// coef E / (T^2 k): the value's and the gradient's common factor.
float aux_scale(const AuxLossDesc& desc) {
  const float T = static_cast<float>(desc.tokens);
  return desc.coef * static_cast<float>(desc.experts) / (T * T * static_cast<float>(desc.topk));
}

}  // namespace

void launch_router_aux_loss(const AuxLossDesc& desc, const void* logits, const std::int32_t* splits, float* aux,
                            cudaStream_t stream) {
  check_aux_loss(desc);
  SG_CHECK(logits != nullptr && splits != nullptr && aux != nullptr,
           "router_aux_loss: logits, splits and aux must not be null");
  moe::with_float_type(desc.logits_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    aux_loss_kernel<T><<<1, kAuxThreads, 0, stream>>>(static_cast<const T*>(logits), splits, desc.tokens,
                                                      static_cast<int>(desc.experts), aux_scale(desc), aux);
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_router_aux_loss_backward(const AuxLossDesc& desc, float grad_factor, const void* logits,
                                     const std::int32_t* splits, const float* loss_scale, const void* dlogits_in,
                                     void* dlogits_out, cudaStream_t stream) {
  check_aux_loss(desc);
  SG_CHECK(logits != nullptr && splits != nullptr && dlogits_in != nullptr && dlogits_out != nullptr,
           "router_aux_loss_backward: logits, splits, dlogits_in and dlogits_out must not be null");
  const auto blocks = static_cast<unsigned>((desc.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  moe::with_float_type(desc.logits_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    aux_loss_backward_kernel<T><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<const T*>(logits), splits, desc.tokens, static_cast<int>(desc.experts),
        grad_factor * aux_scale(desc), loss_scale, static_cast<const T*>(dlogits_in), static_cast<T*>(dlogits_out));
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_expert_bias_update(std::int64_t experts, float rate, const std::int32_t* counts, float* bias,
                               cudaStream_t stream) {
  SG_CHECK(experts >= 1 && experts <= kMaxExperts, "expert_bias_update: experts must be in [1, ", kMaxExperts,
           "], got ", experts);
  SG_CHECK(counts != nullptr && bias != nullptr, "expert_bias_update: counts and bias must not be null");
  bias_update_kernel<<<1, static_cast<unsigned>(kMaxExperts), 0, stream>>>(static_cast<int>(experts), rate, counts,
                                                                          bias);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
