// The CUDA side of kernels/fp8_fused.h.
//
// GeLU and its backward: one tile kernel over the elementwise functor
// (kernels/gelu.cuh, the very formulas of launch_gelu_forward/backward). A
// block of 256 threads takes a 64 x 64 tile: 16-byte vectors of the inputs
// (8 bf16/fp16), the result rounded to the dtype (written when asked), then
// those rounded values quantized: 8 row-wise bytes per vector in one store,
// staged in shared memory for the column-wise copy (Note [FP8 transpose tile]
// in kernels/fp8_device.cuh). amax is reduced per block, one atomicMax each
// (Note [Amax on bits]).
//
// The norms: the norm forward kernel itself with its FP8 epilogue
// (launch_norm_forward_fp8 in kernels/norm.cu: a row is reduced by a slice of
// threads, so the row-wise bytes come with y), then, for the column-wise
// copy, a transpose of those bytes through the same shared-memory tile: it
// reads 1 byte per element where requantizing y would read 2, and y may not
// be written at all.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/fp8_device.cuh"
#include "kernels/fp8_fused.h"
#include "kernels/gelu.cuh"
#include "kernels/norm.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

template <typename T>
struct MapFp8Args {
  const T* a;  // the functor's inputs (b unused with one input)
  const T* b;
  T* out16;  // the rounded result, or null
  const float* scale;  // null: amax alone
  std::uint8_t* rowwise;
  std::uint8_t* columnwise;
  unsigned* amax_bits;
  std::int64_t rows;
  std::int64_t cols;  // a multiple of 16
  Fp8Format format;
};

template <typename T, typename Op>
__global__ void __launch_bounds__(kFp8TileThreads) map_fp8_kernel(MapFp8Args<T> a) {
  constexpr int kCount = Vec16<T>::kCount;
  constexpr int kVectorsPerRow = kFp8Tile / kCount;
  __shared__ alignas(16) Fp8Tile tile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kFp8Tile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kFp8Tile;
  const bool quantize = a.scale != nullptr;
  const float scale = quantize ? *a.scale : 1.0f;
  unsigned amax = 0;
#pragma unroll 2
  for (int i = static_cast<int>(threadIdx.x); i < kFp8Tile * kVectorsPerRow; i += kFp8TileThreads) {
    const int r = i / kVectorsPerRow;
    const int c = i % kVectorsPerRow * kCount;
    if (r0 + r >= a.rows || c0 + c >= a.cols) continue;
    const std::int64_t offset = (r0 + r) * a.cols + c0 + c;
    float in_a[kCount];
    float in_b[kCount] = {};
    float result[kCount];
    load16(a.a + offset).to_float(in_a);
    if constexpr (Op::kInputs == 2) load16(a.b + offset).to_float(in_b);
#pragma unroll
    for (int k = 0; k < kCount; ++k) result[k] = Op::apply(in_a[k], in_b[k]);
    const Vec16<T> rounded = Vec16<T>::from_float(result);
    if (a.out16 != nullptr) store16(a.out16 + offset, rounded);
    float values[kCount];  // what the 16-bit output holds: fused == op then quantize
    rounded.to_float(values);
    if (quantize) {
      std::uint8_t q[kCount];
      quantize_values(values, scale, a.format, q, amax);
      if (a.rowwise != nullptr) store_bytes(a.rowwise + offset, q);
      if (a.columnwise != nullptr) store_bytes(&tile[r][c], q);
    } else {
#pragma unroll
      for (int k = 0; k < kCount; ++k) amax = max(amax, abs_bits(values[k]));
    }
  }
  if (a.columnwise != nullptr) {
    __syncthreads();
    store_transposed_tile(tile, a.columnwise, r0, c0, a.rows, a.cols);
  }
  block_amax_atomic(amax, a.amax_bits);
}

// q^T from q, [rows, cols] bytes with cols a multiple of 16: a 64 x 64 tile
// per block, read in 16-byte runs (one per thread) and written as in
// map_fp8_kernel.
__global__ void __launch_bounds__(kFp8TileThreads)
    transpose_fp8_kernel(const std::uint8_t* __restrict__ rowwise, std::uint8_t* __restrict__ columnwise,
                         std::int64_t rows, std::int64_t cols) {
  constexpr int kRun = 16;
  static_assert(kFp8Tile * kFp8Tile == kFp8TileThreads * kRun, "one run per thread");
  __shared__ alignas(16) Fp8Tile tile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kFp8Tile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kFp8Tile;
  const int r = static_cast<int>(threadIdx.x) / (kFp8Tile / kRun);
  const int c = static_cast<int>(threadIdx.x) % (kFp8Tile / kRun) * kRun;
  if (r0 + r < rows && c0 + c < cols) {
    const uint4 run = *reinterpret_cast<const uint4*>(rowwise + (r0 + r) * cols + c0 + c);
    // Tile rows are 8-byte aligned (kFp8TileStride): two 8-byte stores.
    *reinterpret_cast<uint2*>(&tile[r][c]) = make_uint2(run.x, run.y);
    *reinterpret_cast<uint2*>(&tile[r][c + 8]) = make_uint2(run.z, run.w);
  }
  __syncthreads();
  store_transposed_tile(tile, columnwise, r0, c0, rows, cols);
}

dim3 tile_grid(const char* op, std::int64_t rows, std::int64_t cols) {
  const std::int64_t row_tiles = (rows + kFp8Tile - 1) / kFp8Tile;
  SG_CHECK(row_tiles <= 65535, op, ": at most ", 65535LL * kFp8Tile, " rows, got [", rows, ", ", cols, "]");
  return dim3(static_cast<unsigned>((cols + kFp8Tile - 1) / kFp8Tile), static_cast<unsigned>(row_tiles));
}

// A device pointer the kernels access in 16-byte vectors: non-null (for a
// non-empty tensor) and 16-byte aligned.
void check_vector_pointer(const char* op, const char* name, const void* pointer, bool required) {
  SG_CHECK(pointer != nullptr || !required, op, ": ", name, " is null; pass a device pointer");
  SG_CHECK(pointer == nullptr || is_aligned16(pointer), op, ": ", name, " (", pointer,
           ") is not 16-byte aligned; allocate it with cudaMalloc or offset it by a multiple of 16 bytes");
}

// The outputs' checks, and amax zeroed (in stream order, so a captured step
// zeroes it on every replay).
void begin_fp8_output(const char* op, const Fp8Copies& out, cudaStream_t stream) {
  check_vector_pointer(op, "rowwise", out.rowwise, false);
  check_vector_pointer(op, "columnwise", out.columnwise, false);
  SG_CHECK(reinterpret_cast<std::uintptr_t>(out.amax) % sizeof(float) == 0, op, ": amax is not 4-byte aligned");
  SG_CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), stream));
}

template <typename Op>
void launch_map_fp8(const char* op, DType dtype, std::int64_t rows, std::int64_t cols,
                    std::initializer_list<std::pair<const void*, const char*>> inputs, void* out16,
                    const Fp8Copies& out, cudaStream_t stream) {
  check_fp8_fused(op, dtype, rows, cols, out);
  const bool empty = rows * cols == 0;
  for (const auto& [pointer, name] : inputs) check_vector_pointer(op, name, pointer, !empty);
  check_vector_pointer(op, "the 16-bit output", out16, false);
  begin_fp8_output(op, out, stream);
  if (empty) return;
  const dim3 grid = tile_grid(op, rows, cols);
  const void* a = inputs.begin()->first;
  const void* b = inputs.size() > 1 ? (inputs.begin() + 1)->first : nullptr;
  auto launch = [&]<typename T>() {
    const MapFp8Args<T> args{.a = static_cast<const T*>(a),
                             .b = static_cast<const T*>(b),
                             .out16 = static_cast<T*>(out16),
                             .scale = out.scale,
                             .rowwise = out.rowwise,
                             .columnwise = out.columnwise,
                             .amax_bits = reinterpret_cast<unsigned*>(out.amax),
                             .rows = rows,
                             .cols = cols,
                             .format = out.format};
    map_fp8_kernel<T, Op><<<grid, kFp8TileThreads, 0, stream>>>(args);
  };
  if (dtype == DType::kBFloat16) {
    launch.template operator()<__nv_bfloat16>();
  } else {
    launch.template operator()<__half>();
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_norm_fp8(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
                     float* rstd, const Fp8Copies& out, cudaStream_t stream) {
  check_norm_fp8(desc, out);
  const char* op = desc.kind == NormKind::kRMSNorm ? "rmsnorm_fp8" : "layernorm_fp8";
  begin_fp8_output(op, out, stream);
  if (desc.rows == 0) return;
  // Scale given but no copy asked for: amax alone.
  const NormFp8Epilogue epilogue{out.format, out.rowwise != nullptr ? out.scale : nullptr, out.rowwise, out.amax};
  launch_norm_forward_fp8(desc, x, gamma, beta, y, mean, rstd, epilogue, stream);
  if (out.columnwise != nullptr) {
    transpose_fp8_kernel<<<tile_grid(op, desc.rows, desc.hidden), kFp8TileThreads, 0, stream>>>(
        out.rowwise, out.columnwise, desc.rows, desc.hidden);
    SG_CUDA_CHECK(cudaGetLastError());
  }
}

namespace {

struct Identity {
  static constexpr int kInputs = 1;
  __device__ __forceinline__ static float apply(float x, float) { return x; }
};

}  // namespace

bool launch_quantize_vectorized(DType dtype, std::int64_t rows, std::int64_t cols, const void* x,
                                const Fp8Copies& out, cudaStream_t stream) {
  const bool sixteen_bit = dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  const bool aligned = is_aligned16(x) && is_aligned16(out.rowwise) && is_aligned16(out.columnwise);
  if (!sixteen_bit || cols % 16 != 0 || rows < 0 || !aligned || out.amax == nullptr) return false;
  launch_map_fp8<Identity>("quantize", dtype, rows, cols, {{x, "x"}}, nullptr, out, stream);
  return true;
}

void launch_gelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* pre, void* act,
                     const Fp8Copies& out, cudaStream_t stream) {
  launch_map_fp8<GeluForward>("gelu_fp8", dtype, rows, cols, {{pre, "pre"}}, act, out, stream);
}

void launch_dgelu_fp8(DType dtype, std::int64_t rows, std::int64_t cols, const void* dact, const void* pre,
                      void* d_pre, const Fp8Copies& out, cudaStream_t stream) {
  launch_map_fp8<GeluBackward>("dgelu_fp8", dtype, rows, cols, {{dact, "dact"}, {pre, "pre"}}, d_pre, out,
                               stream);
}

}  // namespace stepgraph::kernels
