// Top-k softmax router, forward and backward: one warp per token. The expert
// choice is a warp argmax under moe::ranks_before, a total order, so every
// lane ends with the same winner whatever the shuffle order (See Note [Router
// top-k and gates] in kernels/moe_routing.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/moe_routing.cuh"
#include "kernels/moe_routing.h"
#include "kernels/reduce.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

// The best expert of `row` other than `skip` (-1: none skipped), on every lane.
// `bias` (may be null) is added to each logit for the choice only.
template <typename T>
__device__ std::int32_t warp_best(const T* row, const float* bias, int experts, std::int32_t skip, int lane) {
  std::int32_t best = -1;
  float value = 0.0f;
  for (int e = lane; e < experts; e += 32) {
    if (e == skip) continue;
    const float v = moe::rank_value(bias != nullptr ? to_float(row[e]) + bias[e] : to_float(row[e]));
    if (moe::ranks_before(v, e, value, best)) {
      best = e;
      value = v;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
    const std::int32_t other = __shfl_xor_sync(0xffffffffu, best, offset);
    if (moe::ranks_before(other_value, other, value, best)) {
      best = other;
      value = other_value;
    }
  }
  return best;
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_topk_kernel(const T* __restrict__ logits, const float* __restrict__ bias, std::int64_t tokens,
                       int experts, int topk, std::int32_t* __restrict__ chosen, float* __restrict__ gates) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= tokens) return;  // whole warps leave together
  const int lane = threadIdx.x % 32;
  const T* row = logits + t * experts;
  const std::int32_t e1 = warp_best(row, bias, experts, -1, lane);
  const float l1 = to_float(row[e1]);
  if (topk == 1) {
    // The softmax's shift: the largest logit, which is l1 unless a bias chose.
    float max = l1;
    if (bias != nullptr) {
      for (int e = lane; e < experts; e += 32) max = fmaxf(max, to_float(row[e]));
      max = warp_max(max);
    }
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) sum += expf(to_float(row[e]) - max);
    sum = warp_sum(sum);
    if (lane == 0) {
      chosen[t] = e1;
      gates[t] = expf(l1 - max) / sum;
    }
    return;
  }
  const std::int32_t e2 = warp_best(row, bias, experts, e1, lane);
  if (lane == 0) {
    float g1, g2;
    moe::top2_gates(l1, to_float(row[e2]), g1, g2);
    chosen[2 * t] = e1;
    chosen[2 * t + 1] = e2;
    gates[2 * t] = g1;
    gates[2 * t + 1] = g2;
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_backward_kernel(const float* __restrict__ dgates, const T* __restrict__ logits,
                           const std::int32_t* __restrict__ chosen, const float* __restrict__ gates,
                           T* __restrict__ dlogits, std::int64_t tokens, int experts, int topk) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= tokens) return;
  const int lane = threadIdx.x % 32;
  const T* row = logits + t * experts;
  T* drow = dlogits + t * experts;
  if (topk == 1) {
    // dl_m = dg g (delta_im - p_m), p_m = exp(l_m - l_i) g.
    const std::int32_t i = chosen[t];
    const float g = gates[t];
    const float scale = dgates[t] * g;
    const float li = to_float(row[i]);
    for (int m = lane; m < experts; m += 32) {
      const float p = expf(to_float(row[m]) - li) * g;
      drow[m] = from_float<T>(scale * ((m == i ? 1.0f : 0.0f) - p));
    }
    return;
  }
  float dl1, dl2;
  moe::top2_backward(gates[2 * t], gates[2 * t + 1], dgates[2 * t], dgates[2 * t + 1], dl1, dl2);
  const std::int32_t i1 = chosen[2 * t];
  const std::int32_t i2 = chosen[2 * t + 1];
  for (int m = lane; m < experts; m += 32) drow[m] = from_float<T>(m == i1 ? dl1 : (m == i2 ? dl2 : 0.0f));
}

unsigned blocks_for_tokens(std::int64_t tokens) {
  return static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void launch_router_topk(const RouterDesc& desc, const void* logits, std::int32_t* experts, float* gates,
                        cudaStream_t stream, const float* bias) {
  check_router(desc);
  SG_CHECK(logits != nullptr && experts != nullptr && gates != nullptr,
           "router_topk: logits, experts and gates must not be null");
  moe::with_float_type(desc.logits_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    router_topk_kernel<T><<<blocks_for_tokens(desc.tokens), kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<const T*>(logits), bias, desc.tokens, static_cast<int>(desc.experts), desc.topk, experts, gates);
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_router_backward(const RouterDesc& desc, const float* dgates, const void* logits,
                            const std::int32_t* experts, const float* gates, void* dlogits, cudaStream_t stream) {
  check_router(desc);
  SG_CHECK(dgates != nullptr && logits != nullptr && experts != nullptr && gates != nullptr && dlogits != nullptr,
           "router_backward: dgates, logits, experts, gates and dlogits must not be null");
  moe::with_float_type(desc.logits_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    router_backward_kernel<T><<<blocks_for_tokens(desc.tokens), kWarpsPerBlock * 32, 0, stream>>>(
        dgates, static_cast<const T*>(logits), experts, gates, static_cast<T*>(dlogits), desc.tokens,
        static_cast<int>(desc.experts), desc.topk);
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
