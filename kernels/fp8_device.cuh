// Device helpers shared by the FP8 kernels (kernels/fp8_quantize.cu,
// kernels/fp8_fused.cu and the norm's FP8 epilogue in kernels/norm.cu): the
// saturating conversion, amax taken on float bits, and the shared-memory
// tile that turns row-wise bytes into the column-wise (transposed) copy.
//
// Note [Amax on bits]
// |x|'s largest value is taken on its bits: as unsigned integers,
// non-negative floats order like their bits, and NaN's bits lie above
// infinity's, so a NaN anywhere makes amax NaN (as the host references do).
// A block reduces its threads' maxima and adds them with one atomicMax on the
// amax (zeroed before the launch): a max, so the order of arrivals does not
// change the result, and the device amax equals the host's bit for bit
// (a NaN's payload aside: the device gives fabsf's).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/fp8.h"

namespace stepgraph::kernels {

// float_to_fp8 (engine/fp8.h) on the device: nearest even, saturating.
__device__ __forceinline__ std::uint8_t to_fp8(float value, Fp8Format format) {
  return static_cast<std::uint8_t>(
      __nv_cvt_float_to_fp8(value, __NV_SATFINITE, format == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2));
}

inline constexpr float kFloatMax = 3.402823466e38f;

// fp8_scale (kernels/fp8_quantize_host.cc) on the device, step for step: IEEE
// division, the overflow clamp, frexpf/ldexpf for the power of two.
__device__ __forceinline__ float device_fp8_scale(float amax, float fp8_max, int margin, bool power_of_two) {
  if (amax == 0.0f) return 1.0f;
  float scale = ldexpf(fp8_max / amax, -margin);
  if (!(scale <= kFloatMax)) scale = kFloatMax;
  if (power_of_two) {
    int exponent = 0;
    frexpf(scale, &exponent);
    scale = ldexpf(1.0f, exponent - 1);
  }
  return scale;
}

// amax_is_usable on the device: false for NaN and infinity.
__device__ __forceinline__ bool device_amax_usable(float amax) { return amax >= 0.0f && amax <= kFloatMax; }

__device__ __forceinline__ float device_fp8_max(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
}

// The bits of |value|, to be maxed as unsigned (Note [Amax on bits]).
__device__ __forceinline__ unsigned abs_bits(float value) { return __float_as_uint(fabsf(value)); }

__device__ __forceinline__ unsigned warp_max_bits(unsigned bits) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  return bits;
}

// Adds this thread's `bits` to *amax_bits, one atomicMax per block. Every
// thread of the block calls it (it synchronizes); blocks of up to 1024
// threads, a multiple of 32, any shape (flattened).
__device__ __forceinline__ void block_amax_atomic(unsigned bits, unsigned* amax_bits) {
  __shared__ unsigned warp_maxima[32];
  const unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned warps = blockDim.x * blockDim.y * blockDim.z / 32;
  bits = warp_max_bits(bits);
  if (thread % 32 == 0) warp_maxima[thread / 32] = bits;
  __syncthreads();
  if (thread < 32) {
    bits = warp_max_bits(thread < warps ? warp_maxima[thread] : 0u);
    if (thread == 0 && bits != 0) atomicMax(amax_bits, bits);
  }
}

// values -> fp8(values * scale) into q, and |values| into amax.
template <int kCount>
__device__ __forceinline__ void quantize_values(const float (&values)[kCount], float scale, Fp8Format format,
                                                std::uint8_t (&q)[kCount], unsigned& amax) {
#pragma unroll
  for (int k = 0; k < kCount; ++k) {
    amax = max(amax, abs_bits(values[k]));
    q[k] = to_fp8(values[k] * scale, format);
  }
}

// kCount consecutive bytes in one store (8 for a 16-byte vector of bf16/fp16,
// 4 for fp32, 1 for an element); `out` aligned to kCount bytes.
template <int kCount>
__device__ __forceinline__ void store_bytes(std::uint8_t* out, const std::uint8_t (&q)[kCount]) {
  if constexpr (kCount == 8) {
    uint2 word;
    word.x = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<unsigned>(q[3]) << 24);
    word.y = q[4] | (q[5] << 8) | (q[6] << 16) | (static_cast<unsigned>(q[7]) << 24);
    *reinterpret_cast<uint2*>(out) = word;
  } else if constexpr (kCount == 4) {
    *reinterpret_cast<unsigned*>(out) = q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<unsigned>(q[3]) << 24);
  } else {
#pragma unroll
    for (int k = 0; k < kCount; ++k) out[k] = q[k];
  }
}

// Note [FP8 transpose tile]
// The column-wise copy q^T [cols, rows] goes through shared memory: a block
// stages a kFp8Tile x kFp8Tile tile of bytes (row r, column c of the tile at
// tile[r][c]) as it writes the row-wise copy, then writes the tile's columns
// as rows of q^T. Each thread takes a 4 x 4 block of bytes: four 4-byte
// shared loads (rows r..r+3, columns c..c+3), a transpose in registers
// (byte permutes), four 4-byte stores into rows c..c+3 of q^T. A warp takes
// 8 blocks down by 4 across, so each of its stores fills one 32-byte sector
// in each of 4 rows of q^T. The 8 bytes of padding per tile row keep 8-byte
// stores into the tile aligned and leave the warp's 32 shared loads 2-way
// bank-conflicted. This beats a thread's 16 byte loads down a column (4-way
// conflicted), and a conflict-free XOR-swizzled tile measured no faster, so
// the banks are no longer what limits it (the numbers: docs/fp8_performance.md,
// "What falls short: FP8").
inline constexpr int kFp8Tile = 64;
inline constexpr int kFp8TileStride = kFp8Tile + 8;
inline constexpr int kFp8TileThreads = 256;

using Fp8Tile = std::uint8_t[kFp8Tile][kFp8TileStride];

// Rows of the 4 x 4 byte block a_0..a_3 (byte k of a_i is block[i][k]) into
// its columns: byte i of the result j is block[i][j].
__device__ __forceinline__ void transpose_4x4_bytes(const unsigned (&a)[4], unsigned (&out)[4]) {
  const unsigned t0 = __byte_perm(a[0], a[1], 0x5140);  // a0.b0 a1.b0 a0.b1 a1.b1
  const unsigned t1 = __byte_perm(a[0], a[1], 0x7362);  // a0.b2 a1.b2 a0.b3 a1.b3
  const unsigned t2 = __byte_perm(a[2], a[3], 0x5140);
  const unsigned t3 = __byte_perm(a[2], a[3], 0x7362);
  out[0] = __byte_perm(t0, t2, 0x5410);
  out[1] = __byte_perm(t0, t2, 0x7632);
  out[2] = __byte_perm(t1, t3, 0x5410);
  out[3] = __byte_perm(t1, t3, 0x7632);
}

// Writes the staged tile at rows [r0, r0 + kFp8Tile) and columns [c0, c0 +
// kFp8Tile) of the tensor (clipped to rows x cols) into q^T. Called by all
// kFp8TileThreads threads of the block after a __syncthreads().
__device__ __forceinline__ void store_transposed_tile(const Fp8Tile& tile, std::uint8_t* columnwise, std::int64_t r0,
                                                      std::int64_t c0, std::int64_t rows, std::int64_t cols) {
  constexpr int kBlock = 4;
  constexpr int kBlocks = kFp8Tile / kBlock;  // per tile side
  static_assert(kBlocks * kBlocks == kFp8TileThreads, "one 4 x 4 block per thread");
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  // Warp w: block rows [8 (w % 2), +8), block columns [4 (w / 2), +4).
  const int r = kBlock * ((warp % 2) * 8 + lane % 8);
  const int c = kBlock * ((warp / 2) * 4 + lane / 8);
  if (r0 + r >= rows || c0 + c >= cols) return;
  // Tile rows past `rows` hold stale bytes; they are never stored.
  unsigned a[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) a[i] = *reinterpret_cast<const unsigned*>(&tile[r + i][c]);
  unsigned t[kBlock];
  transpose_4x4_bytes(a, t);
  std::uint8_t* out = columnwise + (c0 + c) * rows + r0 + r;
  const bool whole_rows = r0 + r + kBlock <= rows && rows % kBlock == 0;  // 4-byte aligned runs inside q^T
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    if (c0 + c + j >= cols) break;
    std::uint8_t* run = out + j * rows;
    if (whole_rows) {
      *reinterpret_cast<unsigned*>(run) = t[j];
    } else {
      for (int k = 0; k < kBlock && r0 + r + k < rows; ++k) run[k] = static_cast<std::uint8_t>(t[j] >> (8 * k));
    }
  }
}

}  // namespace stepgraph::kernels
