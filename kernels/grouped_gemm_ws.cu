// The grouped forward y = x_e w_e^T (+ bias_e) and dgrad dx = dy_e w_e on
// wgmma, warp-specialised (contract in grouped_gemm.h; shared pieces in
// grouped_gemm_common.cuh and kernels/tile/*.cuh; TMA descriptors from
// kernels/tensor_map.h).
//
// Operands. Both multiply a token-major operand a (x or dy, K-major) by a
// weight operand: K-major for the forward (w_e rows), N-major for dgrad (w_e
// read as [N][K] blocks of 64 output columns, the wgmma transpose bit set).
// TMA boxes ignore group boundaries: an x box may run past the group's last
// row into the next group (those rows of the product are never stored) or
// past T (zero-filled); a forward w box past N into the next expert likewise.
// dgrad reduces over w_e's rows, so its w boxes come from a 3-D view
// [E][N][K] whose N bound zero-fills instead of reading the next expert.
//
// A persistent block per SM has three warpgroups (384 threads):
//   warpgroup 0, the producer (registers cut to 40 with setmaxnreg): one
//     thread issues the TMA loads of every tile of the block, in tile order,
//     into a ring of (x box, w box) stages, each stage freed by the warps
//     that read it;
//   warpgroups 1 and 2, the consumers (registers raised to 232), both
//     computing each 128 x 256 tile, 64 rows each (m64n256k16, 128 fp32
//     accumulators a thread), the cooperative schedule.
// The variants that lost to it are in Note [Grouped GEMM variants that lost]
// (grouped_gemm.cu).
#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda_check.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tensor_map.h"
#include "kernels/tile/group_schedule.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::grouped {
namespace {

// Both consumer warpgroups share each 128 x 256 tile, 64 rows each.
struct WsConfig {
  static constexpr int kM = 128;
  static constexpr int kN = 256;
  static constexpr int kK = 64;
  static constexpr int kThreads = 384;
  static constexpr int kTileBytesA = kM * kK * 2;
  static constexpr int kTileBytesB = kN * kK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kStages = (192 * 1024) / kStageBytes;  // 4
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
};

template <GroupedGemmKind kKind, typename Out>
__global__ void __launch_bounds__(WsConfig::kThreads, 1)
    grouped_ws_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w, Problem p) {
  using C = WsConfig;
  constexpr bool kForward = kKind == GroupedGemmKind::kForward;
  const int cols = kForward ? p.n : p.k;   // of the output
  const int depth = kForward ? p.k : p.n;  // the reduction
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
    tile::prefetch_tensor_map(&map_w);
    for (int s = 0; s < C::kStages; ++s) {
      tile::mbarrier_init(&full[s], 1);
      tile::mbarrier_init(&empty[s], C::kReaderWarps);  // one arrival per reading warp
    }
    tile::fence_barrier_init();
  }
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);  // ends with a barrier
  const int tiles_n = (cols + C::kN - 1) / C::kN;
  auto m_tiles = [&](int e) { return (offs[e + 1] - offs[e] + C::kM - 1) / C::kM; };
  tile::build_tile_starts(p.experts, tile_start, [&](int e) { return m_tiles(e) * tiles_n; });

  const int total = tile_start[p.experts];
  const int grid = static_cast<int>(gridDim.x);
  const int block = static_cast<int>(blockIdx.x);
  const int my_tiles = total > block ? (total - block + grid - 1) / grid : 0;
  const int k_tiles = (depth + C::kK - 1) / C::kK;
  struct TileAt {
    int e, m0, n0;
  };
  auto tile_at = [&](int i) {
    const int t = block + i * grid;
    const int e = tile::group_of_tile(tile_start, p.experts, t);
    const tile::TileMN mn = tile::band_raster(t - tile_start[e], m_tiles(e), tiles_n, C::kRasterBand);
    return TileAt{e, mn.m * C::kM, mn.n * C::kN};
  };

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    if (threadIdx.x == 0) {
      int load = 0;
      for (int i = 0; i < my_tiles; ++i) {
        const TileAt place = tile_at(i);
        const int a_row = offs[place.e] + place.m0;
        for (int kt = 0; kt < k_tiles; ++kt, ++load) {
          const int slot = load % C::kStages;
          // The slot's previous use (load `load - kStages`) must be released by every reader.
          if (load >= C::kStages) tile::mbarrier_wait(&empty[slot], ((load / C::kStages) & 1) ^ 1);
          const int k0 = kt * C::kK;
          tile::mbarrier_arrive_expect_tx(&full[slot], C::kStageBytes);
          tile::tma_load_2d(tile_a(slot), &map_a, &full[slot], k0, a_row);
          if constexpr (kForward) {
            tile::tma_load_2d(tile_b(slot), &map_w, &full[slot], k0, place.e * p.n + place.n0);
          } else {
            // dgrad: [64 k][64 n] boxes of w_e, one per 64 output columns.
#pragma unroll
            for (int j = 0; j < C::kN / 64; ++j) {
              tile::tma_load_3d(tile_b(slot) + j * 64 * C::kK * 2, &map_w, &full[slot], place.n0 + j * 64, k0, place.e);
            }
          }
        }
      }
    }
    zero_rows_outside_groups(offs, p.experts, p.tokens, cols, static_cast<Out*>(p.out));
  } else {
    tile::setmaxnreg_inc<C::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int wg_warp = warp % 4;
    constexpr int kAcc = C::kN / 2;
    float acc[kAcc];
#pragma unroll
    for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;
    Out* out = static_cast<Out*>(p.out);
    // The A rows of this warpgroup inside the stage's tile: 64 rows are 8 KiB, 512 descriptor units.
    const std::uint64_t a_rows = consumer * 512;
    for (int i = 0; i < my_tiles; ++i) {
      const TileAt place = tile_at(i);
      int load = i * k_tiles;
      for (int kt = 0; kt < k_tiles; ++kt, ++load) {
        const int slot = load % C::kStages;
        tile::mbarrier_wait(&full[slot], (load / C::kStages) & 1);
        tile::fence_accumulators(acc);
        tile::wgmma_fence();
        const std::uint64_t desc_a = tile::wgmma_descriptor(tile_a(slot)) + a_rows;
#pragma unroll
        for (int ks = 0; ks < C::kK / 16; ++ks) {
          // K-major: k16 slices are 32 bytes apart (2 in the descriptor's 16-byte
          // units); N-major: 16 rows of 128 bytes apart.
          const int scale_d = (kt > 0 || ks > 0) ? 1 : 0;
          const std::uint64_t desc_b =
              kForward ? tile::wgmma_descriptor(tile_b(slot)) + 2 * ks
                       : tile::wgmma_descriptor_mn_major(tile_b(slot) + ks * 16 * 128, 64 * C::kK * 2);
          tile::wgmma_m64n256k16<!kForward>(acc, desc_a + 2 * ks, desc_b, scale_d);
        }
        tile::wgmma_commit();
        tile::wgmma_wait<1>();  // the previous stage's wgmma group is done
        tile::fence_accumulators(acc);
        if (kt > 0 && lane == 0) tile::mbarrier_arrive(&empty[(load - 1) % C::kStages]);
      }
      tile::wgmma_wait<0>();
      tile::fence_accumulators(acc);
      if (lane == 0) tile::mbarrier_arrive(&empty[(load - 1) % C::kStages]);

      const int start = offs[place.e];
      const int count = offs[place.e + 1] - start;
      Out* y = out + static_cast<std::int64_t>(start) * cols;
      const __nv_bfloat16* bias =
          kForward && p.bias != nullptr ? at<__nv_bfloat16>(p.bias, static_cast<std::int64_t>(place.e) * p.n) : nullptr;
      const int row0 = place.m0 + consumer * 64 + wg_warp * 16 + lane / 4;
      const int col0 = place.n0 + (lane % 4) * 2;
#pragma unroll
      for (int j = 0; j < kAcc; j += 2) {
        const int row = row0 + 8 * ((j / 2) % 2);
        const int col = col0 + (j / 4) * 8;
        if (row < count && col < cols) {  // cols % 8 == 0: col + 1 is in too
          float v0 = acc[j];
          float v1 = acc[j + 1];
          if (bias != nullptr) {
            v0 += __bfloat162float(bias[col]);
            v1 += __bfloat162float(bias[col + 1]);
          }
          store_pair(y + static_cast<std::int64_t>(row) * cols + col, v0, v1);
        }
      }
    }
    zero_rows_outside_groups(offs, p.experts, p.tokens, cols, out);
  }
}

}  // namespace

template <GroupedGemmKind kKind, typename Out>
void launch_grouped_ws(const Problem& p, cudaStream_t stream) {
  using C = WsConfig;
  constexpr bool kForward = kKind == GroupedGemmKind::kForward;
  const std::int64_t cols = kForward ? p.n : p.k;
  const std::int64_t depth = kForward ? p.k : p.n;
  const CUtensorMap map_a = swizzled_tensor_map<2>(DType::kBFloat16, kForward ? p.x : p.dy, {depth, p.tokens}, {C::kK, C::kM});
  const CUtensorMap map_w =
      kForward ? swizzled_tensor_map<2>(DType::kBFloat16, p.w, {p.k, static_cast<std::int64_t>(p.experts) * p.n}, {C::kK, C::kN})
               : swizzled_tensor_map<3>(DType::kBFloat16, p.w, {p.k, p.n, p.experts}, {64, C::kK, 1});
  const std::size_t smem = C::kAlignSlack + C::kPipelineBytes + 2 * C::kStages * sizeof(std::uint64_t) +
                           2 * sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  auto kernel = grouped_ws_kernel<kKind, Out>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // Persistent: a block per SM, and no more than a bound on the tiles from
  // static sizes (each group's partial last m-tile adds at most one row of tiles).
  const std::int64_t tiles = ((p.tokens + C::kM - 1) / C::kM + p.experts) * ((cols + C::kN - 1) / C::kN);
  const int grid = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(tiles, sm_count())));
  kernel<<<grid, C::kThreads, smem, stream>>>(map_a, map_w, p);
  SG_CUDA_CHECK(cudaGetLastError());
}

template void launch_grouped_ws<GroupedGemmKind::kForward, __nv_bfloat16>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kForward, float>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kDgrad, __nv_bfloat16>(const Problem&, cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kDgrad, float>(const Problem&, cudaStream_t);

}  // namespace stepgraph::kernels::grouped
