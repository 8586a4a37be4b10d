// The grouped products on wgmma, warp-specialised (contract in
// grouped_gemm.h; shared pieces in grouped_gemm_common.cuh and
// kernels/tile/*.cuh; TMA descriptors from kernels/tensor_map.h): the
// forward y = x_e w_e^T (+ bias_e), dgrad dx = dy_e w_e and wgrad
// dw_e = dy_e^T x_e, in bf16 and in FP8 (Note [FP8 grouped GEMM]).
//
// Operands. Each multiplies a K-major operand a by a weight-side operand b,
// staged as 128-byte rows (64 bf16 or 128 FP8 elements of the reduction):
//   bf16 forward  a = x [T, K],   b = w [E*N, K] K-major
//   bf16 dgrad    a = dy [T, N],  b = w_e read as [N][K] blocks of 64 output
//                 columns, N-major (the wgmma transpose bit set)
//   FP8 forward   as bf16's forward, in E4M3
//   FP8 dgrad     a = dy [T, N],  b = w^T [K, E*N] (the column-wise copy of w
//                 as [E*N, K]) read as a 3-D [K][E][N] view, K-major
//   bf16 wgrad    a = dy [T, N], b = x [T, K], both read MN-major (the
//                 wgmma transpose bits set) in [64 t][64 n or k] boxes,
//                 reducing over the group's tokens: dw_e [N, K] tiles
//   FP8 wgrad     a = dy^T [N, T], b = x^T [K, T] (the column-wise copies),
//                 as bf16's wgrad but K-major (FP8 wgmma has no transpose)
// TMA boxes ignore group boundaries where that is harmless: an x box may run
// past the group's last row into the next group (those rows of the product
// are never stored) or past T (zero-filled); a forward w box past N into the
// next expert likewise. dgrad reduces over w_e's rows, so its w boxes come
// from a 3-D view whose N bound zero-fills instead of reading the next
// expert. Wgrad reduces over tokens: the rows of a group's last token box
// that belong to the next group are zeroed in shared memory before the
// wgmma reads them (a box past T is zero-filled). bf16 boxes start at the
// group's first token (an outer coordinate); FP8's, where tokens are the
// inner coordinate, at that token rounded down to a multiple of 16 (TMA
// faults, "illegal instruction", on an inner coordinate that is not 16-byte
// aligned), and the first box's columns before the group are zeroed too.
//
// A persistent block per SM has three warpgroups (384 threads):
//   warpgroup 0, the producer (registers cut to 40 with setmaxnreg): one
//     thread issues the TMA loads of every tile of the block, in tile order,
//     into a ring of (a box, b box) stages, each stage freed by the warps
//     that read it;
//   warpgroups 1 and 2, the consumers (registers raised to 232), both
//     computing each 128 x 256 tile, 64 rows each (m64n256, 128 fp32
//     accumulators a thread), the cooperative schedule.
// The variants that lost to it are in Note [Grouped GEMM variants that lost]
// (grouped_gemm.cu).
//
// Note [FP8 grouped GEMM]
// FP8 operands are tensor-wise scaled: the product is multiplied by the two
// operands' scale_inv in the epilogue. FP8 wgmma reads both operands K-major,
// so the transposes come from the quantize kernels' column-wise copies (the
// layouts above), as for cuBLASLt's FP8 GEMMs. Hopper's tensor cores add FP8
// products into their accumulators with fewer bits than fp32 keeps (measured
// on the H100: 2e-4 of the norm from an fp32 sum at a reduction of 304,
// 1.2e-3 at 4224, all E4M3). That is cuBLASLt's "fast accumulation", the
// default. With split accumulation (GroupedGemmDesc::split_accumulation,
// cuBLASLt's default for FP8) each 128-deep stage's wgmma sums start from
// zero in a second set of registers and are added into fp32 totals on the
// CUDA cores, as DeepSeek-V3 promotes them; both sets fit only at 128 x 128
// tiles (64 + 64 registers a thread), and the wgmma of a stage must finish
// before its sums are added, so this mode runs slower.
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tensor_map.h"
#include "kernels/tile/group_schedule.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::grouped {
namespace {

// Both consumer warpgroups share each 128 x kN tile (256 columns; 128 with
// split accumulation), 64 rows each; a stage holds 128 bytes of the
// reduction (kDepth elements) of both operands.
template <int kTileN>
struct WsConfig {
  static constexpr int kM = 128;
  static constexpr int kN = kTileN;
  static constexpr int kRowBytes = 128;
  static constexpr int kThreads = 384;
  static constexpr int kTileBytesA = kM * kRowBytes;
  static constexpr int kTileBytesB = kN * kRowBytes;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kStages = (192 * 1024) / kStageBytes;  // 4 at kN = 256, 6 at 128
  static constexpr int kPipelineBytes = kStageBytes * kStages;
  static constexpr int kAlignSlack = 1024;  // the dynamic shared base is aligned up to 1024 bytes
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static_assert(tile::register_split_fits(kProducerRegisters, kConsumerRegisters));
  // m-tiles per band of the tile order (tile::band_raster); 16 beat 8 and 4 on
  // the H100 (Note [Grouped GEMM variants that lost]).
  static constexpr int kRasterBand = 16;
  // Warps that read a stage: both consumer warpgroups.
  static constexpr int kReaderWarps = 8;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kTailBarrier = 1;  // the consumers' named barrier for a zeroed wgrad tail
};

// Which product, in which element type, and how it accumulates (Note [FP8 grouped GEMM]).
template <GroupedGemmKind kKind, bool kFp8, bool kAE5M2, bool kSplit>
struct WsProduct {
  static constexpr bool kForward = kKind == GroupedGemmKind::kForward;
  static constexpr bool kWgrad = kKind == GroupedGemmKind::kWgrad;
  static_assert(kFp8 || !kSplit, "split accumulation is for FP8");
  using C = WsConfig<kSplit ? 128 : 256>;
  static constexpr int kDepth = C::kRowBytes / (kFp8 ? 1 : 2);  // reduction elements a stage
  static constexpr int kSlices = kDepth / (kFp8 ? 32 : 16);     // wgmma per stage and warpgroup
};

// Clears the bytes outside [begin, end) of every 128-byte row of the stage's
// `rows` rows at `tile` (128-byte swizzled: byte c of row r sits in chunk
// (c / 16) ^ (r % 8)), as the `first`-th of `step` threads.
__device__ __forceinline__ void zero_rows_outside(unsigned char* tile, int rows, int begin, int end, int first,
                                                  int step) {
  constexpr int kRowBytes = 128;
  for (int r = first; r < rows; r += step) {
    unsigned char* row = tile + r * kRowBytes;
    for (int c = 0; c < kRowBytes; ++c) {
      if (c < begin || c >= end) row[(((c >> 4) ^ (r & 7)) << 4) | (c & 15)] = 0;
    }
  }
}

// Zeros rows [first_row, 64) of each of `boxes` [64 x 128-byte] boxes at
// `tile` (whole rows: the swizzle stays inside a row), as the `first`-th of
// `step` threads.
__device__ __forceinline__ void zero_box_rows_from(unsigned char* tile, int boxes, int first_row, int first, int step) {
  constexpr int kChunksPerRow = 8;  // 16-byte chunks in a 128-byte row
  const int chunks = (64 - first_row) * kChunksPerRow;
  for (int i = first; i < boxes * chunks; i += step) {
    const int box = i / chunks;
    const int chunk = i % chunks + first_row * kChunksPerRow;
    reinterpret_cast<uint4*>(tile + box * 64 * 128)[chunk] = make_uint4(0, 0, 0, 0);
  }
}

// Wgrad: the token where group e's boxes start (16-aligned for FP8, whose
// tokens are the boxes' inner coordinate).
template <bool kFp8>
__device__ __forceinline__ int token_start(const int* offs, int e) {
  return kFp8 ? offs[e] & ~15 : offs[e];
}

template <GroupedGemmKind kKind, bool kFp8, bool kAE5M2, bool kSplit, typename Out>
__global__ void __launch_bounds__(WsConfig<256>::kThreads, 1)
    grouped_ws_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b, Problem p) {
  using P = WsProduct<kKind, kFp8, kAE5M2, kSplit>;
  using C = typename P::C;
  // Output [rows, cols] of a tile's group, and the reduction's length.
  const int cols = P::kWgrad ? p.k : (P::kForward ? p.n : p.k);
  const int depth = P::kForward ? p.k : p.n;  // fwd/dgrad; wgrad's is the group's tokens
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  auto* full = reinterpret_cast<std::uint64_t*>(smem + C::kPipelineBytes);
  std::uint64_t* empty = full + C::kStages;
  int* offs = reinterpret_cast<int*>(empty + C::kStages);
  int* tile_start = offs + tile::group_offsets_ints(p.experts);
  auto tile_a = [&](int slot) { return smem + slot * C::kStageBytes; };
  auto tile_b = [&](int slot) { return smem + slot * C::kStageBytes + C::kTileBytesA; };

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warpgroup = warp / 4;
  if (threadIdx.x == 0) {
    tile::prefetch_tensor_map(&map_a);
    tile::prefetch_tensor_map(&map_b);
    for (int s = 0; s < C::kStages; ++s) {
      tile::mbarrier_init(&full[s], 1);
      tile::mbarrier_init(&empty[s], C::kReaderWarps);  // one arrival per reading warp
    }
    tile::fence_barrier_init();
  }
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);  // ends with a barrier
  // fwd/dgrad: a group's tiles cover its token rows; wgrad: every group has
  // the same tiles of its dw_e [N, K].
  const int tiles_n = (cols + C::kN - 1) / C::kN;
  const int wgrad_tiles_m = (p.n + C::kM - 1) / C::kM;
  auto m_tiles = [&](int e) { return P::kWgrad ? wgrad_tiles_m : (offs[e + 1] - offs[e] + C::kM - 1) / C::kM; };
  tile::build_tile_starts(p.experts, tile_start, [&](int e) { return m_tiles(e) * tiles_n; });

  const int total = tile_start[p.experts];
  const int grid = static_cast<int>(gridDim.x);
  const int block = static_cast<int>(blockIdx.x);
  const int my_tiles = total > block ? (total - block + grid - 1) / grid : 0;
  struct TileAt {
    int e, m0, n0;
  };
  auto tile_at = [&](int i) {
    const int t = block + i * grid;
    const int e = tile::group_of_tile(tile_start, p.experts, t);
    const tile::TileMN mn = tile::band_raster(t - tile_start[e], m_tiles(e), tiles_n, C::kRasterBand);
    return TileAt{e, mn.m * C::kM, mn.n * C::kN};
  };
  // Stages of a tile: over K (or N) for fwd/dgrad, over the group's tokens for wgrad.
  auto k_tiles = [&](const TileAt& place) {
    if constexpr (P::kWgrad) {
      if (offs[place.e + 1] == offs[place.e]) return 0;
      return (offs[place.e + 1] - token_start<kFp8>(offs, place.e) + P::kDepth - 1) / P::kDepth;
    }
    return (depth + P::kDepth - 1) / P::kDepth;
  };

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    if (threadIdx.x == 0) {
      int load = 0;
      for (int i = 0; i < my_tiles; ++i) {
        const TileAt place = tile_at(i);
        const int stages = k_tiles(place);
        for (int kt = 0; kt < stages; ++kt, ++load) {
          const int slot = load % C::kStages;
          // The slot's previous use (load `load - kStages`) must be released by every reader.
          if (load >= C::kStages) tile::mbarrier_wait(&empty[slot], ((load / C::kStages) & 1) ^ 1);
          const int k0 = kt * P::kDepth;
          tile::mbarrier_arrive_expect_tx(&full[slot], C::kStageBytes);
          if constexpr (P::kWgrad && kFp8) {
            const int t0 = token_start<kFp8>(offs, place.e) + k0;
            tile::tma_load_2d(tile_a(slot), &map_a, &full[slot], t0, place.m0);
            tile::tma_load_2d(tile_b(slot), &map_b, &full[slot], t0, place.n0);
          } else if constexpr (P::kWgrad) {
            // bf16 wgrad: [64 t][64 n] boxes of dy, [64 t][64 k] boxes of x.
            const int t0 = token_start<kFp8>(offs, place.e) + k0;
#pragma unroll
            for (int j = 0; j < C::kM / 64; ++j) {
              tile::tma_load_2d(tile_a(slot) + j * 64 * C::kRowBytes, &map_a, &full[slot], place.m0 + j * 64, t0);
            }
#pragma unroll
            for (int j = 0; j < C::kN / 64; ++j) {
              tile::tma_load_2d(tile_b(slot) + j * 64 * C::kRowBytes, &map_b, &full[slot], place.n0 + j * 64, t0);
            }
          } else {
            tile::tma_load_2d(tile_a(slot), &map_a, &full[slot], k0, offs[place.e] + place.m0);
            if constexpr (P::kForward) {
              tile::tma_load_2d(tile_b(slot), &map_b, &full[slot], k0, place.e * p.n + place.n0);
            } else if constexpr (kFp8) {
              tile::tma_load_3d(tile_b(slot), &map_b, &full[slot], k0, place.e, place.n0);
            } else {
              // bf16 dgrad: [64 k][64 n] boxes of w_e, one per 64 output columns.
#pragma unroll
              for (int j = 0; j < C::kN / 64; ++j) {
                tile::tma_load_3d(tile_b(slot) + j * 64 * C::kRowBytes, &map_b, &full[slot], place.n0 + j * 64, k0,
                                  place.e);
              }
            }
          }
        }
      }
    }
    if constexpr (!P::kWgrad) zero_rows_outside_groups(offs, p.experts, p.tokens, cols, static_cast<Out*>(p.out));
  } else {
    tile::setmaxnreg_inc<C::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int consumer_thread = static_cast<int>(threadIdx.x) - 128;
    const int wg_warp = warp % 4;
    constexpr int kAcc = C::kN / 2;
    float acc[kAcc];
    Out* out = static_cast<Out*>(p.out);
    // FP8: the product of the operands' scale_inv, applied in the epilogue.
    float scale = 1.0f;
    if constexpr (kFp8) scale = *p.a_scale_inv * *p.b_scale_inv;
    // The A rows of this warpgroup inside the stage's tile: 64 rows are 8 KiB, 512 descriptor units.
    const std::uint64_t a_rows = consumer * 512;
    int load = 0;
    for (int i = 0; i < my_tiles; ++i) {
      const TileAt place = tile_at(i);
      // Wgrad's stages come from the offsets in shared memory, which ptxas
      // cannot prove warp-uniform: as a loop bound around wgmma that makes it
      // serialise them all (warning C7518). Lane 0's value is uniform.
      const int stages = __shfl_sync(0xffffffffu, k_tiles(place), 0);
      for (int kt = 0; kt < stages; ++kt, ++load) {
        const int slot = load % C::kStages;
        tile::mbarrier_wait(&full[slot], (load / C::kStages) & 1);
        if constexpr (P::kWgrad) {
          // A box that starts before the group or runs past it: zero the other groups' tokens in both operands.
          const int t0 = token_start<kFp8>(offs, place.e) + kt * P::kDepth;
          const int begin = offs[place.e] - t0;   // FP8: < 16, and > 0 in the first box only; bf16: 0
          const int end = offs[place.e + 1] - t0;  // < kDepth in the last box only
          if (begin > 0 || end < P::kDepth) {
            if constexpr (kFp8) {
              zero_rows_outside(tile_a(slot), C::kM, begin, end, consumer_thread, C::kConsumerThreads);
              zero_rows_outside(tile_b(slot), C::kN, begin, end, consumer_thread, C::kConsumerThreads);
            } else {
              zero_box_rows_from(tile_a(slot), C::kM / 64, end, consumer_thread, C::kConsumerThreads);
              zero_box_rows_from(tile_b(slot), C::kN / 64, end, consumer_thread, C::kConsumerThreads);
            }
            tile::fence_proxy_async_shared();
            tile::named_barrier_sync(C::kTailBarrier, C::kConsumerThreads);
          }
        }
        if constexpr (kSplit) {
          // This stage's sums from zero, then into the fp32 totals (Note [FP8 grouped GEMM]).
          float partial[kAcc];
          tile::wgmma_fence();
          const std::uint64_t desc_a = tile::wgmma_descriptor(tile_a(slot)) + a_rows;
#pragma unroll
          for (int ks = 0; ks < P::kSlices; ++ks) {
            tile::wgmma_m64n128k32_fp8<kAE5M2>(partial, desc_a + 2 * ks,
                                               tile::wgmma_descriptor(tile_b(slot)) + 2 * ks, ks > 0 ? 1 : 0);
          }
          tile::wgmma_commit();
          tile::wgmma_wait<0>();
          tile::fence_accumulators(partial);
          if (lane == 0) tile::mbarrier_arrive(&empty[slot]);
#pragma unroll
          for (int j = 0; j < kAcc; ++j) acc[j] = kt > 0 ? acc[j] + partial[j] : partial[j];
          continue;
        }
        tile::fence_accumulators(acc);
        tile::wgmma_fence();
        const std::uint64_t desc_a = tile::wgmma_descriptor(tile_a(slot)) + a_rows;
#pragma unroll
        for (int ks = 0; ks < P::kSlices; ++ks) {
          // K-major: slices are 32 bytes apart (2 in the descriptor's 16-byte
          // units); bf16 dgrad's N-major b: 16 rows of 128 bytes apart.
          const int scale_d = (kt > 0 || ks > 0) ? 1 : 0;
          if constexpr (kFp8) {
            if constexpr (!kSplit) {
              tile::wgmma_m64n256k32_fp8<kAE5M2>(acc, desc_a + 2 * ks, tile::wgmma_descriptor(tile_b(slot)) + 2 * ks,
                                                 scale_d);
            }
          } else {
            // bf16 dgrad reads w N-major in [64 k][64 n] boxes, wgrad both
            // operands MN-major in [64 t][64] boxes (a k16 slice is 16 rows
            // of them); the forward both K-major.
            constexpr bool kTransB = !P::kForward;
            constexpr bool kTransA = P::kWgrad;
            constexpr std::uint32_t kBoxBytes = 64 * C::kRowBytes;
            const std::uint64_t desc_b =
                kTransB ? tile::wgmma_descriptor_mn_major(tile_b(slot) + ks * 16 * C::kRowBytes, kBoxBytes)
                           : tile::wgmma_descriptor(tile_b(slot)) + 2 * ks;
            const std::uint64_t desc_a_slice =
                kTransA ? tile::wgmma_descriptor_mn_major(tile_a(slot) + consumer * kBoxBytes + ks * 16 * C::kRowBytes,
                                                          kBoxBytes)
                        : desc_a + 2 * ks;
            tile::wgmma_m64n256k16<kTransB, kTransA>(acc, desc_a_slice, desc_b, scale_d);
          }
        }
        tile::wgmma_commit();
        tile::wgmma_wait<1>();  // the previous stage's wgmma group is done
        tile::fence_accumulators(acc);
        if (kt > 0 && lane == 0) tile::mbarrier_arrive(&empty[(load - 1) % C::kStages]);
      }
      if (!kSplit && stages > 0) {
        tile::wgmma_wait<0>();
        tile::fence_accumulators(acc);
        if (lane == 0) tile::mbarrier_arrive(&empty[(load - 1) % C::kStages]);
      }

      // This warpgroup's accumulators into the tile's rows of the group's output.
      const int row0 = place.m0 + consumer * 64 + wg_warp * 16 + lane / 4;
      const int col0 = place.n0 + (lane % 4) * 2;
      if constexpr (P::kWgrad) {
        Out* dw = out + static_cast<std::int64_t>(place.e) * p.n * p.k;
        // An empty group's dw_e is zeros (its accumulators hold whatever the
        // block's last tile left, or nothing: selected away, not multiplied).
        const bool empty_group = stages == 0;
#pragma unroll
        for (int j = 0; j < kAcc; j += 2) {
          const int row = row0 + 8 * ((j / 2) % 2);
          const int col = col0 + (j / 4) * 8;
          if (row < p.n && col < p.k) {  // k % 16 == 0: col + 1 is in too
            Out* dst = dw + static_cast<std::int64_t>(row) * p.k + col;
            float v0 = empty_group ? 0.0f : acc[j] * scale;
            float v1 = empty_group ? 0.0f : acc[j + 1] * scale;
            if (p.accumulate) {
              const float2 old = load_pair(dst);
              v0 += old.x;
              v1 += old.y;
            }
            store_pair(dst, v0, v1);
          }
        }
      } else {
        const int start = offs[place.e];
        const int count = offs[place.e + 1] - start;
        Out* y = out + static_cast<std::int64_t>(start) * cols;
        const __nv_bfloat16* bias = P::kForward && p.bias != nullptr
                                        ? at<__nv_bfloat16>(p.bias, static_cast<std::int64_t>(place.e) * p.n)
                                        : nullptr;
#pragma unroll
        for (int j = 0; j < kAcc; j += 2) {
          const int row = row0 + 8 * ((j / 2) % 2);
          const int col = col0 + (j / 4) * 8;
          if (row < count && col < cols) {  // cols % 8 == 0: col + 1 is in too
            float v0 = acc[j] * scale;
            float v1 = acc[j + 1] * scale;
            if (bias != nullptr) {
              v0 += __bfloat162float(bias[col]);
              v1 += __bfloat162float(bias[col + 1]);
            }
            store_pair(y + static_cast<std::int64_t>(row) * cols + col, v0, v1);
          }
        }
      }
    }
    if constexpr (!P::kWgrad) zero_rows_outside_groups(offs, p.experts, p.tokens, cols, out);
  }
}

// The TMA maps of a product's two operands (the layouts at the top).
template <GroupedGemmKind kKind, bool kFp8, typename C>
std::pair<CUtensorMap, CUtensorMap> operand_maps(const Problem& p, DType a_type, DType b_type) {
  constexpr int kDepth = C::kRowBytes / (kFp8 ? 1 : 2);
  const std::int64_t experts = p.experts;
  if constexpr (kKind == GroupedGemmKind::kForward) {
    return {swizzled_tensor_map<2>(a_type, p.x, {p.k, p.tokens}, {kDepth, C::kM}),
            swizzled_tensor_map<2>(b_type, p.w, {p.k, experts * p.n}, {kDepth, C::kN})};
  } else if constexpr (kKind == GroupedGemmKind::kWgrad && kFp8) {
    return {swizzled_tensor_map<2>(a_type, p.dy, {p.tokens, p.n}, {kDepth, C::kM}),
            swizzled_tensor_map<2>(b_type, p.x, {p.tokens, p.k}, {kDepth, C::kN})};
  } else if constexpr (kKind == GroupedGemmKind::kWgrad) {
    return {swizzled_tensor_map<2>(a_type, p.dy, {p.n, p.tokens}, {64, kDepth}),
            swizzled_tensor_map<2>(b_type, p.x, {p.k, p.tokens}, {64, kDepth})};
  } else if constexpr (kFp8) {
    return {swizzled_tensor_map<2>(a_type, p.dy, {p.n, p.tokens}, {kDepth, C::kM}),
            swizzled_tensor_map<3>(b_type, p.w, {p.n, experts, p.k}, {kDepth, 1, C::kN})};
  } else {
    return {swizzled_tensor_map<2>(a_type, p.dy, {p.n, p.tokens}, {kDepth, C::kM}),
            swizzled_tensor_map<3>(b_type, p.w, {p.k, p.n, experts}, {64, kDepth, 1})};
  }
}

// One kernel variant's launch: a persistent block per SM, and no more than a
// bound on the tiles from static sizes (fwd/dgrad: each group's partial last
// m-tile adds at most one row of tiles; wgrad: E groups of the same tiles).
template <GroupedGemmKind kKind, bool kFp8, bool kAE5M2, bool kSplit, typename Out>
void launch_variant(const Problem& p, cudaStream_t stream) {
  using C = typename WsProduct<kKind, kFp8, kAE5M2, kSplit>::C;
  const std::int64_t cols = kKind == GroupedGemmKind::kWgrad ? p.k : (kKind == GroupedGemmKind::kForward ? p.n : p.k);
  const std::size_t smem = C::kAlignSlack + C::kPipelineBytes + 2 * C::kStages * sizeof(std::uint64_t) +
                           2 * sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  const std::int64_t tiles =
      kKind == GroupedGemmKind::kWgrad
          ? p.experts * ((p.n + C::kM - 1) / C::kM) * ((cols + C::kN - 1) / C::kN)
          : ((p.tokens + C::kM - 1) / C::kM + p.experts) * ((cols + C::kN - 1) / C::kN);
  const int grid = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(tiles, sm_count())));
  auto kernel = grouped_ws_kernel<kKind, kFp8, kAE5M2, kSplit, Out>;
  const std::pair<CUtensorMap, CUtensorMap> maps = operand_maps<kKind, kFp8, C>(p, p.a_type, p.b_type);
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid, C::kThreads, smem, stream>>>(maps.first, maps.second, p);
  SG_CUDA_CHECK(cudaGetLastError());
}

template <GroupedGemmKind kKind, bool kAE5M2, typename Out>
void launch_fp8(const Problem& p, cudaStream_t stream) {
  if (p.split_accumulation) {
    launch_variant<kKind, true, kAE5M2, true, Out>(p, stream);
  } else {
    launch_variant<kKind, true, kAE5M2, false, Out>(p, stream);
  }
}

}  // namespace

template <GroupedGemmKind kKind, typename Out>
void launch_grouped_ws(const Problem& p, cudaStream_t stream) {
  if (p.a_type == DType::kBFloat16) {
    launch_variant<kKind, false, false, false, Out>(p, stream);
  } else if constexpr (kKind == GroupedGemmKind::kWgrad && !std::is_same_v<Out, float>) {
    SG_THROW(ErrorCode::kUnsupported, "grouped_gemm wgrad: FP8 products write an fp32 dw");  // check_grouped_gemm says so first
  } else if (p.a_type == DType::kFloat8E5M2) {
    launch_fp8<kKind, true, Out>(p, stream);
  } else {
    launch_fp8<kKind, false, Out>(p, stream);
  }
}

template void launch_grouped_ws<GroupedGemmKind::kForward, __nv_bfloat16>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kForward, float>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kDgrad, __nv_bfloat16>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kDgrad, float>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kWgrad, float>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kWgrad, __nv_bfloat16>(const Problem&, cudaStream_t);

}  // namespace stepgraph::kernels::grouped
