// The CUDA side of kernels/fp8_quantize.h: tensor-wise quantize with amax and
// the transposed copy, and block-scaled quantize (Note [Block quantize kernel]).
//
// A block quantizes a 64 x 64 tile: 256 threads read it row by row (coalesced),
// write the row-wise bytes, stage them in shared memory and write the
// column-wise copy column by column (coalesced again). amax is taken on the
// bits of |x| and added once per block (Note [Amax on bits] in
// kernels/fp8_device.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/fp8_device.cuh"
#include "kernels/fp8_quantize.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kTile = 64;
constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(const T* __restrict__ x, const float* __restrict__ scale_ptr,
                                                                 std::uint8_t* __restrict__ rowwise,
                                                                 std::uint8_t* __restrict__ columnwise,
                                                                 unsigned* __restrict__ amax_bits, std::int64_t rows,
                                                                 std::int64_t cols, Fp8Format format) {
  __shared__ std::uint8_t tile[kTile][kTile + 4];
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;  // null: amax only (launch_amax)
  unsigned local = 0;
#pragma unroll 4
  for (int i = static_cast<int>(threadIdx.x); i < kTile * kTile; i += kThreads) {
    const int r = i / kTile;
    const int c = i % kTile;
    if (r0 + r < rows && c0 + c < cols) {
      const float value = to_float(x[(r0 + r) * cols + c0 + c]);
      local = max(local, abs_bits(value));
      if (rowwise != nullptr || columnwise != nullptr) {
        const std::uint8_t q = to_fp8(value * scale, format);
        if (rowwise != nullptr) rowwise[(r0 + r) * cols + c0 + c] = q;
        tile[r][c] = q;
      }
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
  block_amax_atomic(local, amax_bits);
}

// The scale_inv of the block at (o, kk) of an operand; the last block of a
// 128 x 128 row also zeroes its row's padding.
__device__ void store_block_scale(float* scales, const BlockScaleLayout& layout, std::int64_t o, std::int64_t kk,
                                  float scale_inv) {
  scales[layout.index(o, kk)] = scale_inv;
  if (layout.shape == BlockShape::k128x128 && kk / kScaleBlock == layout.k_blocks() - 1) {
    for (std::int64_t pad = layout.k_blocks(); pad < layout.padded_k_blocks(); ++pad) {
      scales[(o / kScaleBlock) * layout.padded_k_blocks() + pad] = 0.0f;
    }
  }
}

// Note [Block quantize kernel]
// One block of threads per scaling block (1 x 128, 128 x 1 for the 1 x 128
// column-wise copy, or 128 x 128): a first pass takes the block's amax (its
// bits: Note [Amax on bits]), thread 0 turns it into the scale exactly as fp8_scale does
// (IEEE division, frexpf/ldexpf for the power of two), and a second pass
// quantizes, writing row-wise or transposed bytes. Simple and exact; its
// speed is not tuned yet.
template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_blocks_kernel(
    const T* __restrict__ x, std::int64_t rows, std::int64_t cols, int block_rows, int block_cols, Fp8Format format,
    bool power_of_two, std::uint8_t* __restrict__ rowwise, std::uint8_t* __restrict__ columnwise,
    float* __restrict__ rowwise_scale_inv, float* __restrict__ columnwise_scale_inv, int* __restrict__ non_finite) {
  __shared__ unsigned warp_max[kThreads / 32];
  __shared__ float shared_scale;
  const std::int64_t blocks_across = cols / block_cols;
  const std::int64_t bi = static_cast<std::int64_t>(blockIdx.x) / blocks_across;
  const std::int64_t bj = static_cast<std::int64_t>(blockIdx.x) % blocks_across;
  const std::int64_t r0 = bi * block_rows;
  const std::int64_t c0 = bj * block_cols;
  const int count = block_rows * block_cols;
  unsigned local = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x)) {
    const float value = to_float(x[(r0 + i / block_cols) * cols + c0 + i % block_cols]);
    local = max(local, abs_bits(value));
  }
  local = warp_max_bits(local);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned bits = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) bits = max(bits, warp_max[w]);
    const float amax = __uint_as_float(bits);
    float scale = 1.0f;
    if (!(amax <= 3.402823466e38f)) {
      atomicOr(non_finite, 1);
    } else if (amax > 0.0f) {
      scale = (format == Fp8Format::kE4M3 ? 448.0f : 57344.0f) / amax;
      if (!(scale <= 3.402823466e38f)) scale = 3.402823466e38f;
      if (power_of_two) {
        int exponent = 0;
        frexpf(scale, &exponent);
        scale = ldexpf(1.0f, exponent - 1);
      }
    }
    shared_scale = scale;
    const float scale_inv = 1.0f / scale;
    // 1 x 128 runs row-wise (1 x 128 blocks) or column-wise (128 x 1); 128 x 128 serves both copies.
    const BlockShape shape = block_rows == block_cols ? BlockShape::k128x128 : BlockShape::k1x128;
    if (rowwise_scale_inv != nullptr) store_block_scale(rowwise_scale_inv, {shape, rows, cols}, r0, c0, scale_inv);
    if (columnwise_scale_inv != nullptr) store_block_scale(columnwise_scale_inv, {shape, cols, rows}, c0, r0, scale_inv);
  }
  __syncthreads();
  const float scale = shared_scale;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x)) {
    const std::int64_t r = r0 + i / block_cols;
    const std::int64_t c = c0 + i % block_cols;
    const std::uint8_t q = to_fp8(to_float(x[r * cols + c]) * scale, format);
    if (rowwise != nullptr) rowwise[r * cols + c] = q;
    if (columnwise != nullptr) columnwise[c * rows + r] = q;
  }
}

template <typename T>
void launch_blocks(const T* x, const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const BlockOutputs& out,
                   int* non_finite, cudaStream_t stream) {
  auto run = [&](int block_rows, int block_cols, std::uint8_t* rows_out, std::uint8_t* cols_out, float* rows_scale,
                 float* cols_scale) {
    const std::int64_t blocks = (desc.rows / block_rows) * (desc.cols / block_cols);
    if (blocks == 0) return;
    SG_CHECK(blocks <= 0x7fffffff, "block quantize: too many blocks (", blocks, ")");
    quantize_blocks_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, desc.rows, desc.cols, block_rows, block_cols, desc.format, power_of_two, rows_out, cols_out, rows_scale,
        cols_scale, non_finite);
    SG_CUDA_CHECK(cudaGetLastError());
  };
  if (shape == BlockShape::k128x128) {
    run(128, 128, desc.rowwise ? out.rowwise : nullptr, desc.columnwise ? out.columnwise : nullptr,
        desc.rowwise ? out.rowwise_scale_inv : nullptr, desc.columnwise ? out.columnwise_scale_inv : nullptr);
    return;
  }
  if (desc.rowwise) run(1, 128, out.rowwise, nullptr, out.rowwise_scale_inv, nullptr);
  if (desc.columnwise) run(128, 1, nullptr, out.columnwise, nullptr, out.columnwise_scale_inv);
}

}  // namespace

void launch_quantize_blocks(const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const void* x,
                            const BlockOutputs& out, int* non_finite, cudaStream_t stream) {
  check_block_quantize(desc, shape);
  SG_CHECK(x != nullptr || desc.rows * desc.cols == 0, "block quantize: x is null");
  SG_CHECK(non_finite != nullptr, "block quantize: non_finite must be a device int");
  SG_CHECK((!desc.rowwise || (out.rowwise != nullptr && out.rowwise_scale_inv != nullptr)) &&
               (!desc.columnwise || (out.columnwise != nullptr && out.columnwise_scale_inv != nullptr)),
           "block quantize: an output asked for is null");
  SG_CUDA_CHECK(cudaMemsetAsync(non_finite, 0, sizeof(int), stream));
  switch (desc.in_dtype) {
    case DType::kFloat32:
      launch_blocks(static_cast<const float*>(x), desc, shape, power_of_two, out, non_finite, stream);
      break;
    case DType::kBFloat16:
      launch_blocks(static_cast<const __nv_bfloat16*>(x), desc, shape, power_of_two, out, non_finite, stream);
      break;
    case DType::kFloat16:
      launch_blocks(static_cast<const __half*>(x), desc, shape, power_of_two, out, non_finite, stream);
      break;
    default: SG_THROW(ErrorCode::kInvalidArgument, "block quantize: unsupported dtype ", dtype_name(desc.in_dtype));
  }
}

namespace {

// The tile kernel over the whole tensor; null outputs (and scale) give amax alone.
void launch_tiles(const QuantizeDesc& desc, const void* x, const float* scale, std::uint8_t* rowwise,
                  std::uint8_t* columnwise, float* amax, cudaStream_t stream) {
  SG_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (desc.rows == 0 || desc.cols == 0) return;
  SG_CHECK((desc.rows + kTile - 1) / kTile <= 65535, "quantize: at most ", 65535 * kTile, " rows, got ", desc.rows);
  const dim3 grid(static_cast<unsigned>((desc.cols + kTile - 1) / kTile),
                  static_cast<unsigned>((desc.rows + kTile - 1) / kTile));
  std::uint8_t* rows_out = rowwise;
  std::uint8_t* cols_out = columnwise;
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

}  // namespace

void launch_quantize(const QuantizeDesc& desc, const void* x, const float* scale, std::uint8_t* rowwise,
                     std::uint8_t* columnwise, float* amax, cudaStream_t stream) {
  check_quantize(desc);
  SG_CHECK(x != nullptr || desc.rows * desc.cols == 0, "quantize: x is null");
  SG_CHECK(scale != nullptr && amax != nullptr, "quantize: scale and amax must be device pointers, got a null one");
  SG_CHECK((!desc.rowwise || rowwise != nullptr) && (!desc.columnwise || columnwise != nullptr),
           "quantize: an output asked for is null");
  launch_tiles(desc, x, scale, desc.rowwise ? rowwise : nullptr, desc.columnwise ? columnwise : nullptr, amax,
               stream);
}

void launch_amax(DType dtype, std::int64_t rows, std::int64_t cols, const void* x, float* amax, cudaStream_t stream) {
  const QuantizeDesc desc{dtype, Fp8Format::kE4M3, rows, cols, true, false};
  check_quantize(desc);
  SG_CHECK((x != nullptr || rows * cols == 0) && amax != nullptr, "amax: x and amax must be device pointers");
  launch_tiles(desc, x, nullptr, nullptr, nullptr, amax, stream);
}

}  // namespace stepgraph::kernels
