// Where each block's scale_inv lives for block-scaled FP8: the
// layout cuBLASLt reads (cuBLAS docs, "128-element 1D and 128x128 2D block
// scaling for FP8 data types"), so the quantize kernels write what the GEMM
// takes with no reshuffle between them. Host and device code share it.
//
// Every FP8 GEMM operand on Hopper is K-major, [outer, k] row-major (A
// [m, k], B [n, k]; Note [FP8 GEMMs] in kernels/gemm.h). Its scales:
//   1 x 128    one per row and 128 consecutive k: [k / 128, outer], outer
//              contiguous (cuBLASLt's VEC128_32F, "M-major");
//   128 x 128  one per 128 x 128 tile: [outer / 128, round_up(k / 128, 4)],
//              k contiguous, each row padded to 4 floats (BLK128x128_32F).
// A quantized tensor x [rows, cols] is the operand [rows, cols] as its
// row-wise copy and [cols, rows] as its column-wise copy (x^T), each with
// its own layout.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SG_BLOCK_SCALES_HD __host__ __device__
#else
#define SG_BLOCK_SCALES_HD
#endif

namespace stepgraph::kernels {

enum class BlockShape : std::uint8_t {
  k1x128,    // activations and gradients: a scale per row and 128 columns
  k128x128,  // weights: a scale per 128 x 128 tile
};

inline constexpr std::int64_t kScaleBlock = 128;

struct BlockScaleLayout {
  BlockShape shape = BlockShape::k1x128;
  std::int64_t outer = 0;  // the operand's rows (m or n)
  std::int64_t k = 0;      // its reduced dimension, a multiple of 128

  SG_BLOCK_SCALES_HD std::int64_t k_blocks() const { return k / kScaleBlock; }
  // 128 x 128's row stride: cuBLASLt wants it a multiple of 4.
  SG_BLOCK_SCALES_HD std::int64_t padded_k_blocks() const { return (k_blocks() + 3) / 4 * 4; }
  // Floats to allocate.
  SG_BLOCK_SCALES_HD std::int64_t count() const {
    return shape == BlockShape::k1x128 ? k_blocks() * outer : (outer / kScaleBlock) * padded_k_blocks();
  }
  // The scale of element (o, kk) of the operand.
  SG_BLOCK_SCALES_HD std::int64_t index(std::int64_t o, std::int64_t kk) const {
    const std::int64_t b = kk / kScaleBlock;
    return shape == BlockShape::k1x128 ? b * outer + o : (o / kScaleBlock) * padded_k_blocks() + b;
  }
};

}  // namespace stepgraph::kernels
