// The CUDA side of kernels/fp8_quantize.h: tensor-wise quantize with amax and
// the transposed copy.
//
// A block quantizes a 64 x 64 tile: 256 threads read it row by row (coalesced),
// write the row-wise bytes, stage them in shared memory and write the
// column-wise copy column by column (coalesced again). |x|'s largest value is
// taken on its bits (as unsigned integers, non-negative floats order like
// their bits, and NaN's bits lie above infinity's: a NaN anywhere makes amax
// NaN, as the host reference does), reduced over the warp and added by
// atomicMax: a max, so the order of arrivals does not change the result.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/fp8_quantize.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;

__device__ __forceinline__ std::uint8_t to_fp8(float value, Fp8Format format) {
  return static_cast<std::uint8_t>(
      __nv_cvt_float_to_fp8(value, __NV_SATFINITE, format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(const T* __restrict__ x, const float* __restrict__ scale_ptr,
                                                                 std::uint8_t* __restrict__ rowwise,
                                                                 std::uint8_t* __restrict__ columnwise,
                                                                 unsigned* __restrict__ amax_bits, std::int64_t rows,
                                                                 std::int64_t cols, Fp8Format format) {
  __shared__ std::uint8_t tile[kTile][kTile + 4];
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const float scale = *scale_ptr;
  unsigned local = 0;
#pragma unroll 4
  for (int i = static_cast<int>(threadIdx.x); i < kTile * kTile; i += kThreads) {
    const int r = i / kTile;
    const int c = i % kTile;
    if (r0 + r < rows && c0 + c < cols) {
      const float value = to_float(x[(r0 + r) * cols + c0 + c]);
      local = max(local, __float_as_uint(fabsf(value)));
      const std::uint8_t q = to_fp8(value * scale, format);
      if (rowwise != nullptr) rowwise[(r0 + r) * cols + c0 + c] = q;
      tile[r][c] = q;
    }
  }
  if (columnwise != nullptr) {
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < kTile * kTile; i += kThreads) {
      const int c = i / kTile;
      const int r = i % kTile;
      if (r0 + r < rows && c0 + c < cols) columnwise[(c0 + c) * rows + r0 + r] = tile[r][c];
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) local = max(local, __shfl_xor_sync(0xffffffffu, local, offset));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, local);
}

}  // namespace

void launch_quantize(const QuantizeDesc& desc, const void* x, const float* scale, std::uint8_t* rowwise,
                     std::uint8_t* columnwise, float* amax, cudaStream_t stream) {
  check_quantize(desc);
  SG_CHECK(x != nullptr || desc.rows * desc.cols == 0, "quantize: x is null");
  SG_CHECK(scale != nullptr && amax != nullptr, "quantize: scale and amax must be device pointers, got a null one");
  SG_CHECK((!desc.rowwise || rowwise != nullptr) && (!desc.columnwise || columnwise != nullptr),
           "quantize: an output asked for is null");
  SG_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (desc.rows == 0 || desc.cols == 0) return;
  SG_CHECK((desc.rows + kTile - 1) / kTile <= 65535, "quantize: at most ", 65535 * kTile, " rows, got ", desc.rows);
  const dim3 grid(static_cast<unsigned>((desc.cols + kTile - 1) / kTile),
                  static_cast<unsigned>((desc.rows + kTile - 1) / kTile));
  std::uint8_t* rows_out = desc.rowwise ? rowwise : nullptr;
  std::uint8_t* cols_out = desc.columnwise ? columnwise : nullptr;
  auto* bits = reinterpret_cast<unsigned*>(amax);
  switch (desc.in_dtype) {
    case DType::kFloat32:
      quantize_tile_kernel<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), scale, rows_out,
                                                                 cols_out, bits, desc.rows, desc.cols, desc.format);
      break;
    case DType::kBFloat16:
      quantize_tile_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(x), scale, rows_out, cols_out, bits, desc.rows, desc.cols, desc.format);
      break;
    case DType::kFloat16:
      quantize_tile_kernel<__half><<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), scale, rows_out,
                                                                  cols_out, bits, desc.rows, desc.cols, desc.format);
      break;
    default: SG_THROW(ErrorCode::kInvalidArgument, "quantize: unsupported dtype ", dtype_name(desc.in_dtype));
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
