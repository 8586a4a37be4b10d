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
// A block of 256 threads quantizes a 128 x 128 tile, staged in shared memory
// as floats (rows padded to 129 floats, so a warp reading down a column hits
// 32 banks). Lane l of a warp always takes elements l, l + 32, l + 64, l + 96
// of a row or column: loads and stores coalesce, and shared memory has no
// bank conflicts either way. Scales: 1 x 128 takes one per tile row (a warp's
// max) for the row-wise copy and one per tile column (two threads' max) for
// the column-wise copy; 128 x 128 one for the whole tile. Each scale is
// device_fp8_scale of the amax, as fp8_scale computes it, so bytes and scales
// equal quantize_blocks_host's bit for bit.
constexpr int kBlockTile = 128;
constexpr int kBlockTileStride = kBlockTile + 1;
constexpr std::size_t kBlockTileBytes = sizeof(float) * kBlockTile * kBlockTileStride;

// The scale of an amax; a non-finite one raises the flag and scales by 1.
__device__ float block_scale(unsigned amax_bits, Fp8Format format, bool power_of_two, int* non_finite) {
  const float amax = __uint_as_float(amax_bits);
  if (!device_amax_usable(amax)) {
    atomicOr(non_finite, 1);
    return 1.0f;
  }
  return device_fp8_scale(amax, device_fp8_max(format), 0, power_of_two);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_block_tile_kernel(
    const T* __restrict__ x, std::int64_t rows, std::int64_t cols, BlockShape shape, Fp8Format format,
    bool power_of_two, std::uint8_t* __restrict__ rowwise, float* __restrict__ rowwise_scale_inv,
    std::uint8_t* __restrict__ columnwise, float* __restrict__ columnwise_scale_inv, int* __restrict__ non_finite) {
  extern __shared__ float tile[];  // [kBlockTile][kBlockTileStride]
  __shared__ unsigned column_bits[2][kBlockTile];
  __shared__ float column_scale[kBlockTile];
  __shared__ unsigned warp_bits[kThreads / 32];
  __shared__ float tile_scale;
  constexpr int kWarps = kThreads / 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kBlockTile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kBlockTile;
  // Only a 1 x 128 row-wise copy may end in a partial tile (check_block_quantize).
  const int valid_rows = rows - r0 < kBlockTile ? static_cast<int>(rows - r0) : kBlockTile;
  unsigned bits = 0;
  for (int r = warp; r < kBlockTile; r += kWarps) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = lane + 32 * j;
      const float value = r < valid_rows ? to_float(x[(r0 + r) * cols + c0 + c]) : 0.0f;
      tile[r * kBlockTileStride + c] = value;
      bits = max(bits, abs_bits(value));
    }
  }
  const bool one_row = shape == BlockShape::k1x128;
  if (!one_row) {  // one scale for the tile, both copies
    bits = warp_max_bits(bits);
    if (lane == 0) warp_bits[warp] = bits;
  }
  __syncthreads();
  if (!one_row && threadIdx.x == 0) {
    unsigned all = 0;
    for (int w = 0; w < kWarps; ++w) all = max(all, warp_bits[w]);
    const float scale = block_scale(all, format, power_of_two, non_finite);
    tile_scale = scale;
    if (rowwise != nullptr) store_block_scale(rowwise_scale_inv, {shape, rows, cols}, r0, c0, 1.0f / scale);
    if (columnwise != nullptr) store_block_scale(columnwise_scale_inv, {shape, cols, rows}, c0, r0, 1.0f / scale);
  }
  if (!one_row) __syncthreads();  // tile_scale
  if (rowwise != nullptr) {
    for (int r = warp; r < valid_rows; r += kWarps) {
      float values[4];
      unsigned row_bits = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        values[j] = tile[r * kBlockTileStride + lane + 32 * j];
        row_bits = max(row_bits, abs_bits(values[j]));
      }
      float scale;
      if (one_row) {
        scale = block_scale(warp_max_bits(row_bits), format, power_of_two, non_finite);  // the same on every lane
        if (lane == 0) rowwise_scale_inv[BlockScaleLayout{shape, rows, cols}.index(r0 + r, c0)] = 1.0f / scale;
      } else {
        scale = tile_scale;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) rowwise[(r0 + r) * cols + c0 + lane + 32 * j] = to_fp8(values[j] * scale, format);
    }
  }
  if (columnwise == nullptr) return;
  if (one_row) {  // column c's scale from its 128 rows: two threads of 64 rows each
    const int c = static_cast<int>(threadIdx.x) % kBlockTile;
    const int half = static_cast<int>(threadIdx.x) / kBlockTile;
    unsigned col = 0;
    for (int r = half * 64; r < half * 64 + 64; ++r) col = max(col, abs_bits(tile[r * kBlockTileStride + c]));
    column_bits[half][c] = col;
    __syncthreads();
    if (half == 0) {
      const float scale = block_scale(max(column_bits[0][c], column_bits[1][c]), format, power_of_two, non_finite);
      column_scale[c] = scale;
      columnwise_scale_inv[BlockScaleLayout{shape, cols, rows}.index(c0 + c, r0)] = 1.0f / scale;
    }
  }
  __syncthreads();
  for (int c = warp; c < kBlockTile; c += kWarps) {
    const float scale = one_row ? column_scale[c] : tile_scale;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = lane + 32 * j;
      columnwise[(c0 + c) * rows + r0 + r] = to_fp8(tile[r * kBlockTileStride + c] * scale, format);
    }
  }
}

template <typename T>
void launch_blocks(const T* x, const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const BlockOutputs& out,
                   int* non_finite, cudaStream_t stream) {
  if (desc.rows == 0 || desc.cols == 0) return;
  static const bool sized = [] {  // the tile is larger than the default 48 KiB of dynamic shared memory
    SG_CUDA_CHECK(cudaFuncSetAttribute(quantize_block_tile_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kBlockTileBytes)));
    return true;
  }();
  (void)sized;
  const std::int64_t row_tiles = (desc.rows + kBlockTile - 1) / kBlockTile;
  SG_CHECK(row_tiles <= 65535, "block quantize: at most ", 65535 * kBlockTile, " rows, got ", desc.rows);
  const dim3 grid(static_cast<unsigned>(desc.cols / kBlockTile), static_cast<unsigned>(row_tiles));
  quantize_block_tile_kernel<T><<<grid, kThreads, kBlockTileBytes, stream>>>(
      x, desc.rows, desc.cols, shape, desc.format, power_of_two, desc.rowwise ? out.rowwise : nullptr,
      desc.rowwise ? out.rowwise_scale_inv : nullptr, desc.columnwise ? out.columnwise : nullptr,
      desc.columnwise ? out.columnwise_scale_inv : nullptr, non_finite);
  SG_CUDA_CHECK(cudaGetLastError());
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
