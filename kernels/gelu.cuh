// GeLU (tanh approximation) as device functors over fp32, shared by the
// activation kernels (kernels/activation.cu) and the fused FP8 ones
// (kernels/fp8_fused.cu): one formula, so a fused kernel's 16-bit result
// equals the unfused one's bit for bit. apply(a, b): a and b are the
// functor's inputs (b unused with one input).
#pragma once

namespace stepgraph::kernels {

inline constexpr float kSqrt2OverPi = 0.7978845608028654f;
inline constexpr float kGeluCubic = 0.044715f;

// y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))). Inputs a = x.
struct GeluForward {
  static constexpr int kInputs = 1;
  __device__ __forceinline__ static float apply(float x, float) {
    const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
    return 0.5f * x * (1.0f + t);
  }
};

// dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2)).
// Inputs a = dy, b = x. Where t = +-1 (|x| > ~10) the second term is zero;
// selecting it keeps x^2 = inf (|x| > 1.8e19) from making 0 * inf = NaN.
struct GeluBackward {
  static constexpr int kInputs = 2;
  __device__ __forceinline__ static float apply(float dy, float x) {
    const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
    const float sech2 = 1.0f - t * t;
    const float inner = sech2 == 0.0f ? 0.0f : 0.5f * x * sech2 * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    return dy * (0.5f * (1.0f + t) + inner);
  }
};

}  // namespace stepgraph::kernels
