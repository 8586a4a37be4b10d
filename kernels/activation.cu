// GeLU (tanh approximation) forward/backward and the residual add (contract
// in activation.h). One kernel template over the dtype and the elementwise
// operation: a grid-stride loop over 16-byte vectors (8 bf16/fp16 or 4 fp32
// elements per thread per step, fp32 arithmetic), then a grid-stride loop
// over the n % kCount tail elements, so any n works.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/activation.h"
#include "kernels/gelu.cuh"
#include "kernels/launch_config.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

// out = a + b.
struct Add {
  static constexpr int kInputs = 2;
  __device__ __forceinline__ static float apply(float a, float b) { return a + b; }
};

// out[i] = Op::apply(a[i], b[i]) (b unused for one input). No __restrict__:
// out may alias a or b; each element is read before it is written, by the
// same thread.
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreadsPerBlock) map_kernel(T* out, const T* a, const T* b, std::int64_t n) {
  constexpr int kCount = Vec16<T>::kCount;
  const std::int64_t vectors = n / kCount;
  grid_stride(vectors, [&](std::int64_t v) {
    float fa[kCount];
    float fb[kCount] = {};
    float result[kCount];
    load16(a + v * kCount).to_float(fa);
    if constexpr (Op::kInputs == 2) load16(b + v * kCount).to_float(fb);
#pragma unroll
    for (int k = 0; k < kCount; ++k) result[k] = Op::apply(fa[k], fb[k]);
    store16(out + v * kCount, Vec16<T>::from_float(result));
  });
  const std::int64_t tail_start = vectors * kCount;
  grid_stride(n - tail_start, [&](std::int64_t t) {
    const std::int64_t i = tail_start + t;
    float fb = 0.0f;
    if constexpr (Op::kInputs == 2) fb = to_float(b[i]);
    out[i] = from_float<T>(Op::apply(to_float(a[i]), fb));
  });
}

template <typename Pointer>
struct Named {
  Pointer pointer;
  const char* name;
};

void check_operand(const char* op, std::int64_t n, const void* pointer, const char* name) {
  SG_CHECK(pointer != nullptr, op, ": ", name, " is null (", n, " elements); pass a device pointer");
  SG_CHECK(is_aligned16(pointer), op, ": ", name, " (", pointer,
           ") is not 16-byte aligned; the kernel uses 16-byte vectors, so allocate it with cudaMalloc or offset it "
           "by a multiple of 16 bytes");
}

template <typename Op>
void launch_map(const char* op, DType dtype, Named<void*> out, Named<const void*> a, Named<const void*> b,
                std::int64_t n, cudaStream_t stream) {
  SG_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16, op, ": dtype ",
           dtype_name(dtype), " is not supported; use bf16, fp16 or fp32");
  SG_CHECK(n >= 0, op, ": element count must be >= 0, got ", n);
  if (n == 0) return;
  check_operand(op, n, out.pointer, out.name);
  check_operand(op, n, a.pointer, a.name);
  if constexpr (Op::kInputs == 2) check_operand(op, n, b.pointer, b.name);
  const std::int64_t vectors = n / (16 / static_cast<std::int64_t>(dtype_size(dtype)));
  const int blocks = blocks_for(std::max<std::int64_t>(vectors, 1));
  auto launch = [&]<typename T>() {
    map_kernel<T, Op><<<blocks, kThreadsPerBlock, 0, stream>>>(
        static_cast<T*>(out.pointer), static_cast<const T*>(a.pointer), static_cast<const T*>(b.pointer), n);
  };
  switch (dtype) {
    case DType::kFloat32: launch.template operator()<float>(); break;
    case DType::kBFloat16: launch.template operator()<__nv_bfloat16>(); break;
    case DType::kFloat16: launch.template operator()<__half>(); break;
    default: SG_THROW(ErrorCode::kInternal, op, ": dtype ", dtype_name(dtype), " passed the check");
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_gelu_forward(DType dtype, const void* x, void* y, std::int64_t n, cudaStream_t stream) {
  launch_map<GeluForward>("gelu_forward", dtype, {y, "y"}, {x, "x"}, {nullptr, ""}, n, stream);
}

void launch_gelu_backward(DType dtype, const void* dy, const void* x, void* dx, std::int64_t n, cudaStream_t stream) {
  launch_map<GeluBackward>("gelu_backward", dtype, {dx, "dx"}, {dy, "dy"}, {x, "x"}, n, stream);
}

void launch_residual_add(DType dtype, const void* a, const void* b, void* out, std::int64_t n, cudaStream_t stream) {
  launch_map<Add>("residual_add", dtype, {out, "out"}, {a, "a"}, {b, "b"}, n, stream);
}

}  // namespace stepgraph::kernels
