// Routing math shared by the CUDA kernels and the host references, so the
// expert choice (an integer result) is the same code on both sides. Compiled
// by nvcc (host and device) and by the host compiler.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "engine/dtype.h"
#include "engine/error.h"
#define SG_MOE_HD __host__ __device__ __forceinline__
#else
#define SG_MOE_HD inline
#endif

namespace stepgraph::kernels::moe {

// A NaN logit ranks below every number (See Note [Router top-k and gates]).
SG_MOE_HD float rank_value(float logit) { return logit != logit ? -INFINITY : logit; }

// True when (value a, expert a) ranks before (value b, expert b): larger
// value first, the lower expert index on ties. Expert -1 means "none yet".
SG_MOE_HD bool ranks_before(float a, std::int32_t expert_a, float b, std::int32_t expert_b) {
  if (expert_b < 0) return expert_a >= 0;
  if (expert_a < 0) return false;
  return a > b || (a == b && expert_a < expert_b);
}

// k = 2 gates from the two chosen logits: a softmax over the two. The
// exponent is taken of the smaller minus the larger, so finite math never
// overflows; without an expert bias l1 >= l2 (l1 ranks first), with one the
// biased choice may rank the smaller logit first.
SG_MOE_HD void top2_gates(float l1, float l2, float& g1, float& g2) {
  if (!(l2 > l1)) {
    const float e = expf(l2 - l1);
    g1 = 1.0f / (1.0f + e);
    g2 = e / (1.0f + e);
  } else {
    const float e = expf(l1 - l2);
    g1 = e / (1.0f + e);
    g2 = 1.0f / (1.0f + e);
  }
}

// d logits of the chosen experts for k = 2: dl_a = g_a (dg_a - sum_j dg_j g_j).
SG_MOE_HD void top2_backward(float g1, float g2, float dg1, float dg2, float& dl1, float& dl2) {
  const float mean = dg1 * g1 + dg2 * g2;
  dl1 = g1 * (dg1 - mean);
  dl2 = g2 * (dg2 - mean);
}

#if defined(__CUDACC__)
template <typename T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<T>{}) for a float dtype's element type (checked before).
template <typename F>
void with_float_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: return f(TypeTag<__nv_bfloat16>{});
    case DType::kFloat16: return f(TypeTag<__half>{});
    case DType::kFloat32: return f(TypeTag<float>{});
    default: SG_THROW(ErrorCode::kInternal, "moe routing: dtype ", dtype_name(dtype), " passed the checks");
  }
}
#endif

}  // namespace stepgraph::kernels::moe
