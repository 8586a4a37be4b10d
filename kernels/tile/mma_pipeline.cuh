// Tensor-core tile helpers of the grouped wgrad kernel (grouped_gemm.cu):
// cp.async multi-stage loading of bf16 operand tiles into swizzled shared
// memory, ldmatrix.trans fragment loads, mma.sync m16n8k16 with fp32
// accumulators, and the block's main loop over the reduction dimension.
//
// The product is computed as C[m, n] = sum_k A[m, k] B[n, k] with both
// operands MN-major (m or n contiguous in memory): dw_e = dy_e^T x_e without
// copies or transposes. (The forward and dgrad, whose operands are K-major,
// run on wgmma: wgmma_pipeline.cuh.)
//
// Note [Swizzled operand tiles]: an MN-major tile is [64][rows] bf16 (rows / 8
// chunks of 16 bytes per k row). Chunk c of row r is stored at chunk
// c ^ (r & 7), so the 8 rows one ldmatrix reads, and the chunks one cp.async
// wave writes, fall on distinct banks.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace stepgraph::kernels::tile {

// Block tile 128 x 128 x 64, 8 warps as 2 (m) x 4 (n), warp tile 64 x 32,
// 4 pipeline stages (128 KiB of shared memory).
struct MmaConfig {
  static constexpr int kM = 128;
  static constexpr int kN = 128;
  static constexpr int kK = 64;
  static constexpr int kStages = 4;
  static constexpr int kWarpsM = 2;
  static constexpr int kWarpsN = 4;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWarpTileM = kM / kWarpsM;  // 64
  static constexpr int kWarpTileN = kN / kWarpsN;  // 32
  static constexpr int kFragsM = kWarpTileM / 16;  // m16 fragments per warp
  static constexpr int kFragsN = kWarpTileN / 8;   // n8 fragments per warp
  static constexpr int kTileBytesA = kM * kK * 2;
  static constexpr int kTileBytesB = kN * kK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kPipelineBytes = kStageBytes * kStages;
};

__device__ __forceinline__ std::uint32_t smem_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, asynchronously; when !valid nothing is read and
// the 16 bytes are zero-filled (the source size operand is 0).
__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices, transposed on the way from shared memory to registers.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Four 8x8 b16 matrices from shared memory to registers, as stored (lane l
// gives the address of row l % 8 of matrix l / 8; each row is 16 bytes).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a * b for one m16n8k16 fp16 tile, fp32 accumulators.
__device__ __forceinline__ void mma_fp16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a * b for one m16n8k16 bf16 tile, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One MN-major operand of a block product in global memory: element (mn, k)
// is at base[k * ld + mn]. Loads outside mn < extent and k < depth read
// nothing and give zeros. Needs extent % 8 == 0 (16-byte chunks).
struct GlobalOperand {
  const __nv_bfloat16* base = nullptr;
  std::int64_t ld = 0;
  int extent = 0;
  int depth = 0;
};

// A [kRows x kK] tile of one operand in shared memory (see Note [Swizzled operand tiles]).
template <int kRows>
struct OperandTile {
  static constexpr int kK = MmaConfig::kK;
  static constexpr int kChunksPerRow = kRows / 8;
  static constexpr int kRowBytes = kChunksPerRow * 16;
  static constexpr int kChunks = kRows * kK / 8;

  __device__ __forceinline__ static std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
  }

  // Issues this thread's share of the cp.async copies of the tile at (mn0, k0).
  __device__ __forceinline__ static void load(std::uint32_t tile, const GlobalOperand& g, int mn0, int k0) {
    for (int i = static_cast<int>(threadIdx.x); i < kChunks; i += MmaConfig::kThreads) {
      const int row = i / kChunksPerRow;
      const int chunk = i % kChunksPerRow;
      const int mn = mn0 + chunk * 8;
      const int k = k0 + row;
      const bool valid = mn < g.extent && k < g.depth;
      const std::int64_t element = k * g.ld + mn;
      cp_async16(tile + offset(row, chunk), valid ? g.base + element : g.base, valid);
    }
  }

  // A operand fragment (m16 x k16) at tile row/col origin mn0, k step ks:
  // registers (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
  __device__ __forceinline__ static void load_a(std::uint32_t (&a)[4], std::uint32_t tile, int mn0, int ks, int lane) {
    const int row = ks * 16 + (lane & 7) + (lane >> 4) * 8;
    ldmatrix_x4_trans(a, tile + offset(row, mn0 / 8 + ((lane >> 3) & 1)));
  }

  // B operand fragments of two n8 tiles (n 0-7 and n 8-15 from mn0), k step ks:
  // b[j] = {k 0-7, k 8-15} of n8 tile j.
  __device__ __forceinline__ static void load_b(std::uint32_t (&b)[2][2], std::uint32_t tile, int mn0, int ks,
                                                int lane) {
    std::uint32_t r[4];
    const int row = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    ldmatrix_x4_trans(r, tile + offset(row, mn0 / 8 + (lane >> 4)));
    b[0][0] = r[0];
    b[0][1] = r[1];
    b[1][0] = r[2];
    b[1][1] = r[3];
  }
};

// The warp's accumulators: [m16 fragment][n8 fragment][4]. Element v of
// fragment (i, j) is at warp-tile row i * 16 + lane / 4 + (v / 2) * 8 and
// column j * 8 + (lane % 4) * 2 + v % 2.
using Accumulators = float[MmaConfig::kFragsM][MmaConfig::kFragsN][4];

// C tile (m0, n0) = sum over k < depth of A[m, k] B[n, k], through the
// kStages-deep cp.async pipeline in `smem` (kPipelineBytes). Every thread of
// the block calls it; on return the pipeline is drained and reusable.
__device__ __forceinline__ void block_mma(Accumulators& acc, unsigned char* smem, const GlobalOperand& a,
                                          const GlobalOperand& b, int m0, int n0, int depth) {
  using C = MmaConfig;
  using TileA = OperandTile<C::kM>;
  using TileB = OperandTile<C::kN>;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warp_m = (warp / C::kWarpsN) * C::kWarpTileM;
  const int warp_n = (warp % C::kWarpsN) * C::kWarpTileN;
  const std::uint32_t base = smem_address(smem);
  auto tile_a = [&](int stage) { return base + stage * C::kStageBytes; };
  auto tile_b = [&](int stage) { return base + stage * C::kStageBytes + C::kTileBytesA; };

#pragma unroll
  for (int i = 0; i < C::kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < C::kFragsN; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

  const int k_tiles = (depth + C::kK - 1) / C::kK;
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < k_tiles) {
      TileA::load(tile_a(s), a, m0, s * C::kK);
      TileB::load(tile_b(s), b, n0, s * C::kK);
    }
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<C::kStages - 2>();
    // Stage kt has landed for every thread, and every warp is done with the
    // stage the next load overwrites (it computed on it last iteration).
    __syncthreads();
    const int next = kt + C::kStages - 1;
    if (next < k_tiles) {
      TileA::load(tile_a(next % C::kStages), a, m0, next * C::kK);
      TileB::load(tile_b(next % C::kStages), b, n0, next * C::kK);
    }
    cp_async_commit();
    const std::uint32_t sa = tile_a(kt % C::kStages);
    const std::uint32_t sb = tile_b(kt % C::kStages);
#pragma unroll
    for (int ks = 0; ks < C::kK / 16; ++ks) {
      std::uint32_t fa[C::kFragsM][4];
      std::uint32_t fb[C::kFragsN][2];
#pragma unroll
      for (int i = 0; i < C::kFragsM; ++i) TileA::load_a(fa[i], sa, warp_m + i * 16, ks, lane);
#pragma unroll
      for (int j = 0; j < C::kFragsN; j += 2) {
        std::uint32_t pair[2][2];
        TileB::load_b(pair, sb, warp_n + j * 8, ks, lane);
        fb[j][0] = pair[0][0];
        fb[j][1] = pair[0][1];
        fb[j + 1][0] = pair[1][0];
        fb[j + 1][1] = pair[1][1];
      }
#pragma unroll
      for (int i = 0; i < C::kFragsM; ++i)
#pragma unroll
        for (int j = 0; j < C::kFragsN; ++j) mma_bf16(acc[i][j], fa[i], fb[j][0], fb[j][1]);
    }
  }
  cp_async_wait<0>();
  // The next call's prologue overwrites stages other warps may still read.
  __syncthreads();
}

// Calls store(row, col, v0, v1) for each pair of adjacent accumulator columns
// of this thread, in block-tile coordinates (col is even).
template <typename Store>
__device__ __forceinline__ void for_each_accumulator_pair(const Accumulators& acc, Store&& store) {
  using C = MmaConfig;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warp_m = (warp / C::kWarpsN) * C::kWarpTileM;
  const int warp_n = (warp % C::kWarpsN) * C::kWarpTileN;
#pragma unroll
  for (int i = 0; i < C::kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < C::kFragsN; ++j) {
      const int row = warp_m + i * 16 + lane / 4;
      const int col = warp_n + j * 8 + (lane % 4) * 2;
      store(row, col, acc[i][j][0], acc[i][j][1]);
      store(row + 8, col, acc[i][j][2], acc[i][j][3]);
    }
}

}  // namespace stepgraph::kernels::tile
