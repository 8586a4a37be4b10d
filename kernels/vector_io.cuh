// 16-byte vector loads and stores and fp32 conversions shared by the
// memory-bound kernels (norms, activations, cross-entropy, AdamW): one
// 128-bit access per thread, coalesced across the warp, and the elements
// widened to fp32 in registers.
//
//   Vec16<__nv_bfloat16> v = load16(x + i);        // 8 bf16 values
//   float f[Vec16<__nv_bfloat16>::kCount];
//   v.to_float(f);
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace stepgraph::kernels {

// fp32 <-> T for the element types the kernels read: one specialisation per
// type holds both directions (round to nearest even on the way down).
template <typename T>
struct FloatConvert;
template <>
struct FloatConvert<float> {
  __device__ __forceinline__ static float widen(float value) { return value; }
  __device__ __forceinline__ static float narrow(float value) { return value; }
};
template <>
struct FloatConvert<__nv_bfloat16> {
  __device__ __forceinline__ static float widen(__nv_bfloat16 value) { return __bfloat162float(value); }
  __device__ __forceinline__ static __nv_bfloat16 narrow(float value) { return __float2bfloat16_rn(value); }
};
template <>
struct FloatConvert<__half> {
  __device__ __forceinline__ static float widen(__half value) { return __half2float(value); }
  __device__ __forceinline__ static __half narrow(float value) { return __float2half_rn(value); }
};

template <typename T>
__device__ __forceinline__ float to_float(T value) {
  return FloatConvert<T>::widen(value);
}

template <typename T>
__device__ __forceinline__ T from_float(float value) {
  return FloatConvert<T>::narrow(value);
}

// 16 bytes of T: 4 fp32, or 8 bf16/fp16.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kCount = 16 / sizeof(T);
  T values[kCount];

  __device__ __forceinline__ void to_float(float (&out)[kCount]) const {
#pragma unroll
    for (int i = 0; i < kCount; ++i) out[i] = stepgraph::kernels::to_float(values[i]);
  }
  __device__ __forceinline__ static Vec16 from_float(const float (&in)[kCount]) {
    Vec16 v;
#pragma unroll
    for (int i = 0; i < kCount; ++i) v.values[i] = stepgraph::kernels::from_float<T>(in[i]);
    return v;
  }
};

// `pointer` must be 16-byte aligned (launchers check: see is_aligned16).
template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* pointer) {
  return *reinterpret_cast<const Vec16<T>*>(pointer);
}

template <typename T>
__device__ __forceinline__ void store16(T* pointer, const Vec16<T>& value) {
  *reinterpret_cast<Vec16<T>*>(pointer) = value;
}

// Host side: may a kernel use 16-byte accesses on this pointer?
inline bool is_aligned16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

}  // namespace stepgraph::kernels
