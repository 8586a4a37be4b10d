// Moving rows between token order and expert order: permute (a gather of
// rows), unpermute with gates (each token sums its k rows in slot order, in
// fp32) and unpermute's backward (a gated scatter plus the gate gradient, a
// dot product per entry). One warp per row, 16-byte accesses where the row
// length and the pointers allow, scalar ones otherwise; grid-stride over rows
// so the grid depends only on the row count.
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/moe_routing.cuh"
#include "kernels/moe_routing.h"
#include "kernels/reduce.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kWarps = 8;
constexpr std::int64_t kMaxGridBlocks = 132 * 16;

// N consecutive elements as fp32: one 16-byte access when N is the vector width.
template <typename T, int N>
__device__ __forceinline__ void load_n(const T* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = to_float(*p);
  } else {
    static_assert(N == Vec16<T>::kCount);
    load16(p).to_float(out);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_n(T* p, const float (&in)[N]) {
  if constexpr (N == 1) {
    *p = from_float<T>(in[0]);
  } else {
    store16(p, Vec16<T>::from_float(in));
  }
}

// for (row : this warp's rows in [0, rows)) body(row, lane)
template <typename Body>
__device__ __forceinline__ void warp_per_row(std::int64_t rows, Body&& body) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  const int lane = threadIdx.x % 32;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows; row += warps) {
    body(row, lane);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kWarps * 32)
    permute_kernel(const T* __restrict__ x, const std::int32_t* __restrict__ sources, T* __restrict__ x_perm,
                   std::int64_t rows, std::int64_t hidden) {
  warp_per_row(rows, [&](std::int64_t r, int lane) {
    const T* src = x + static_cast<std::int64_t>(sources[r]) * hidden;
    T* dst = x_perm + r * hidden;
    for (std::int64_t h = lane * N; h < hidden; h += 32 * N) {
      float v[N];
      load_n<T, N>(src + h, v);
      store_n<T, N>(dst + h, v);
    }
  });
}

template <typename T, int N>
__global__ void __launch_bounds__(kWarps * 32)
    unpermute_kernel(const T* __restrict__ y_perm, const std::int32_t* __restrict__ positions,
                     const float* __restrict__ gates, T* __restrict__ y, std::int64_t tokens, std::int64_t hidden,
                     int topk) {
  warp_per_row(tokens, [&](std::int64_t t, int lane) {
    const T* rows[2];
    float g[2];
    for (int j = 0; j < topk; ++j) {
      rows[j] = y_perm + static_cast<std::int64_t>(positions[t * topk + j]) * hidden;
      g[j] = gates != nullptr ? gates[t * topk + j] : 1.0f;
    }
    for (std::int64_t h = lane * N; h < hidden; h += 32 * N) {
      float sum[N] = {};
      for (int j = 0; j < topk; ++j) {
        float v[N];
        load_n<T, N>(rows[j] + h, v);
#pragma unroll
        for (int i = 0; i < N; ++i) sum[i] += g[j] * v[i];
      }
      store_n<T, N>(y + t * hidden + h, sum);
    }
  });
}

template <typename T, int N>
__global__ void __launch_bounds__(kWarps * 32)
    unpermute_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y_perm,
                              const std::int32_t* __restrict__ positions, const float* __restrict__ gates,
                              T* __restrict__ dy_perm, float* __restrict__ dgates, std::int64_t entries,
                              std::int64_t hidden, int topk) {
  warp_per_row(entries, [&](std::int64_t i, int lane) {
    const T* d = dy + (i / topk) * hidden;
    const std::int64_t row = static_cast<std::int64_t>(positions[i]) * hidden;
    const float g = gates[i];
    float dot = 0.0f;
    for (std::int64_t h = lane * N; h < hidden; h += 32 * N) {
      float dv[N], yv[N], out[N];
      load_n<T, N>(d + h, dv);
      load_n<T, N>(y_perm + row + h, yv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        dot += dv[k] * yv[k];
        out[k] = g * dv[k];
      }
      store_n<T, N>(dy_perm + row + h, out);
    }
    dot = warp_sum(dot);
    if (lane == 0) dgates[i] = dot;
  });
}

unsigned grid_for_rows(std::int64_t rows) {
  const std::int64_t blocks = (rows + kWarps - 1) / kWarps;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

// f(TypeTag<T>, std::integral_constant<int, N>) with N the vector width when
// every row start of every pointer is 16-byte aligned, else 1.
template <typename F>
void with_access(const PermuteDesc& desc, std::initializer_list<const void*> pointers, F&& f) {
  moe::with_float_type(desc.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = Vec16<T>::kCount;
    bool vector = desc.hidden % kVec == 0;
    for (const void* p : pointers) vector = vector && is_aligned16(p);
    if (vector) {
      f(tag, std::integral_constant<int, kVec>{});
    } else {
      f(tag, std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace

void launch_moe_permute(const PermuteDesc& desc, const void* x, const std::int32_t* sources, void* x_perm,
                        cudaStream_t stream) {
  check_permute(desc);
  SG_CHECK(x != nullptr && sources != nullptr && x_perm != nullptr,
           "moe_permute: x, sources and x_perm must not be null");
  with_access(desc, {x, x_perm}, [&](auto tag, auto width) {
    using T = typename decltype(tag)::type;
    permute_kernel<T, decltype(width)::value><<<grid_for_rows(desc.entries()), kWarps * 32, 0, stream>>>(
        static_cast<const T*>(x), sources, static_cast<T*>(x_perm), desc.entries(), desc.hidden);
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_moe_unpermute(const PermuteDesc& desc, const void* y_perm, const std::int32_t* positions,
                          const float* gates, void* y, cudaStream_t stream) {
  check_permute(desc);
  SG_CHECK(y_perm != nullptr && positions != nullptr && y != nullptr,
           "moe_unpermute: y_perm, positions and y must not be null");
  with_access(desc, {y_perm, y}, [&](auto tag, auto width) {
    using T = typename decltype(tag)::type;
    unpermute_kernel<T, decltype(width)::value><<<grid_for_rows(desc.tokens), kWarps * 32, 0, stream>>>(
        static_cast<const T*>(y_perm), positions, gates, static_cast<T*>(y), desc.tokens, desc.hidden, desc.topk);
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_moe_unpermute_backward(const PermuteDesc& desc, const void* dy, const void* y_perm,
                                   const std::int32_t* positions, const float* gates, void* dy_perm, float* dgates,
                                   cudaStream_t stream) {
  check_permute(desc);
  SG_CHECK(dy != nullptr && y_perm != nullptr && positions != nullptr && gates != nullptr && dy_perm != nullptr &&
               dgates != nullptr,
           "moe_unpermute_backward: dy, y_perm, positions, gates, dy_perm and dgates must not be null");
  with_access(desc, {dy, y_perm, dy_perm}, [&](auto tag, auto width) {
    using T = typename decltype(tag)::type;
    unpermute_backward_kernel<T, decltype(width)::value><<<grid_for_rows(desc.entries()), kWarps * 32, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(y_perm), positions, gates, static_cast<T*>(dy_perm), dgates,
        desc.entries(), desc.hidden, desc.topk);
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
