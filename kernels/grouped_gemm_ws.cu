// The grouped forward y = x_e w_e^T (+ bias_e) and dgrad dx = dy_e w_e on
// wgmma, warp-specialised (contract in grouped_gemm.h; shared pieces in
// grouped_gemm_common.cuh and kernels/tile/*.cuh; TMA descriptors from
// grouped_gemm_tma.cu).
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
//   warpgroups 1 and 2, the consumers (registers raised to 232), 128 fp32
//     accumulators a thread, either
//     ping-pong: each owns a whole 128 x 128 tile (two m64n128k16 per k16
//       slice) and they take the block's tiles in turn. Their main loops
//       alternate through two named barriers (the order barrier), so while
//       one stores its tile from registers the other keeps the tensor cores
//       busy: the epilogue is hidden. The order also makes a consumer wait on
//       a stage only after every earlier load has landed, which the mbarrier
//       phase parity needs;
//     cooperative: both compute each 128 x 256 tile, 64 rows each
//       (m64n256k16), fed by the producer (an earlier kernel, with one of
//       the consumer threads issuing the loads, reached 0.60-1.06x of
//       torch._grouped_mm against this one's 0.65-1.09x and was removed).
// Optionally in clusters of 2 blocks on adjacent m-tiles sharing the w box
// through TMA multicast (half the w traffic from L2; correct, but at about
// half the speed of the plain kernels on the H100, cause not yet known:
// benchmarks/README.md). The cooperative kernel without clusters is the default.
#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tile/group_schedule.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::grouped {
namespace {

// kPingPong: each consumer warpgroup owns a 128 x 128 tile (two m64n128k16
// per k16 slice) and the two take the block's tiles in turn; otherwise
// (cooperative) both share each 128 x 256 tile, 64 rows each (m64n256k16).
// Either way a consumer thread holds 128 fp32 accumulators.
template <bool kPingPong>
struct WsConfig {
  static constexpr int kM = 128;
  static constexpr int kN = kPingPong ? 128 : 256;
  static constexpr int kK = 64;
  static constexpr int kWgRows = kPingPong ? 128 : 64;  // of the tile, per consumer warpgroup
  static constexpr int kHalves = kWgRows / 64;          // m64 wgmma per k16 slice
  static constexpr int kThreads = 384;
  static constexpr int kTileBytesA = kM * kK * 2;
  static constexpr int kTileBytesB = kN * kK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kStages = (192 * 1024) / kStageBytes;  // 6 or 4
  static constexpr int kPipelineBytes = kStageBytes * kStages;
  static constexpr int kAlignSlack = 1024;  // the dynamic shared base is aligned up to 1024 bytes
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  // m-tiles per band of the tile order (tile::band_raster); 16 beat 8 and 4 on
  // the H100 for the cooperative kernel (benchmarks/README.md).
  static constexpr int kRasterBand = 16;
  // Warps that read a stage: one consumer warpgroup, or both.
  static constexpr int kReaderWarps = kPingPong ? 4 : 8;
};

// Named barriers 1 and 2 (0 is __syncthreads): "consumer c may start its main loop".
constexpr int kTurnBarrier = 1;
constexpr int kConsumerThreads = 256;

template <int kN, bool kTransB>
__device__ __forceinline__ void wgmma_k16(float (&d)[kN / 2], std::uint64_t desc_a, std::uint64_t desc_b, int scale_d) {
  if constexpr (kN == 256) {
    tile::wgmma_m64n256k16<kTransB>(d, desc_a, desc_b, scale_d);
  } else {
    tile::wgmma_m64n128k16<kTransB>(d, desc_a, desc_b, scale_d);
  }
}

// kCluster = 2: the two blocks of a cluster take m-tiles 2u and 2u + 1 of one
// group and the same n-tile, so they share the w box: each loads half of it
// with a TMA multicast into both, and a stage is free again once the readers
// of both blocks released it. A block whose m-tile lies past its group's rows
// still loads and computes (its stores are all masked): both run one schedule.
template <GroupedGemmKind kKind, typename Out, bool kPingPong, int kCluster>
__global__ void __launch_bounds__(WsConfig<kPingPong>::kThreads, 1)
    grouped_ws_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w, Problem p) {
  using C = WsConfig<kPingPong>;
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
  const int rank = kCluster > 1 ? static_cast<int>(tile::cluster_rank()) : 0;
  if (threadIdx.x == 0) {
    tile::prefetch_tensor_map(&map_a);
    tile::prefetch_tensor_map(&map_w);
    for (int s = 0; s < C::kStages; ++s) {
      tile::mbarrier_init(&full[s], 1);
      tile::mbarrier_init(&empty[s], kCluster * C::kReaderWarps);  // one arrival per reading warp of the cluster
    }
    tile::fence_barrier_init();
  }
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);  // ends with a barrier
  const int tiles_n = (cols + C::kN - 1) / C::kN;
  // Work units: kCluster m-adjacent tiles (one per block of the cluster).
  auto m_units = [&](int e) { return (offs[e + 1] - offs[e] + kCluster * C::kM - 1) / (kCluster * C::kM); };
  tile::build_tile_starts(p.experts, tile_start, [&](int e) { return m_units(e) * tiles_n; });
  if constexpr (kCluster > 1) tile::cluster_sync();  // the peers' barriers are initialised

  const int total = tile_start[p.experts];
  const int grid = static_cast<int>(gridDim.x) / kCluster;  // clusters
  const int cluster = static_cast<int>(blockIdx.x) / kCluster;
  const int my_tiles = total > cluster ? (total - cluster + grid - 1) / grid : 0;
  const int k_tiles = (depth + C::kK - 1) / C::kK;
  const int band = max(1, (p.raster_band > 0 ? p.raster_band : C::kRasterBand) / kCluster);  // in units
  struct TileAt {
    int e, m0, n0;
  };
  auto tile_at = [&](int i) {
    const int t = cluster + i * grid;
    const int e = tile::group_of_tile(tile_start, p.experts, t);
    const tile::TileMN mn = tile::band_raster(t - tile_start[e], m_units(e), tiles_n, band);
    return TileAt{e, (mn.m * kCluster + rank) * C::kM, mn.n * C::kN};
  };

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    if (threadIdx.x == 0) {
      constexpr std::uint16_t kAll = (1u << kCluster) - 1;
      int load = 0;
      for (int i = 0; i < my_tiles; ++i) {
        const TileAt place = tile_at(i);
        const int a_row = offs[place.e] + place.m0;
        for (int kt = 0; kt < k_tiles; ++kt, ++load) {
          const int slot = load % C::kStages;
          // The slot's previous use (load `load - kStages`) must be released
          // by every reader (of both blocks of a cluster).
          if (load >= C::kStages) tile::mbarrier_wait(&empty[slot], ((load / C::kStages) & 1) ^ 1);
          const int k0 = kt * C::kK;
          tile::mbarrier_arrive_expect_tx(&full[slot], C::kStageBytes);
          tile::tma_load_2d(tile_a(slot), &map_a, &full[slot], k0, a_row);
          if constexpr (kForward) {
            constexpr int kRows = C::kN / kCluster;  // this block's part of the w box
            unsigned char* dst = tile_b(slot) + rank * kRows * C::kK * 2;
            const int w_row = place.e * p.n + place.n0 + rank * kRows;
            if constexpr (kCluster > 1) {
              tile::tma_load_2d_multicast(dst, &map_w, &full[slot], k0, w_row, kAll);
            } else {
              tile::tma_load_2d(dst, &map_w, &full[slot], k0, w_row);
            }
          } else {
            // dgrad: [64 k][64 n] boxes of w_e, one per 64 output columns.
            constexpr int kMine = C::kN / 64 / kCluster;
#pragma unroll
            for (int j = rank * kMine; j < (rank + 1) * kMine; ++j) {
              unsigned char* dst = tile_b(slot) + j * 64 * C::kK * 2;
              if constexpr (kCluster > 1) {
                tile::tma_load_3d_multicast(dst, &map_w, &full[slot], place.n0 + j * 64, k0, place.e, kAll);
              } else {
                tile::tma_load_3d(dst, &map_w, &full[slot], place.n0 + j * 64, k0, place.e);
              }
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
    // A warp is done with a stage: tell every block whose loads write into it.
    auto release = [&](int slot) {
      if constexpr (kCluster == 1) {
        tile::mbarrier_arrive(&empty[slot]);
      } else {
        for (int cta = 0; cta < kCluster; ++cta) {
          tile::mbarrier_arrive_cluster(&empty[slot], static_cast<std::uint32_t>(cta));
        }
      }
    };
    constexpr int kAccN = C::kN / 2;  // accumulators per m64 half
    float acc[C::kHalves][kAccN];
#pragma unroll
    for (int h = 0; h < C::kHalves; ++h) {
#pragma unroll
      for (int j = 0; j < kAccN; ++j) acc[h][j] = 0.0f;
    }
    auto fence_all = [&] {
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h) tile::fence_accumulators(acc[h]);
    };
    Out* out = static_cast<Out*>(p.out);
    // Ping-pong: consumer c takes tiles c, c + 2, ...; cooperative: both take every tile.
    const int first = kPingPong ? consumer : 0;
    constexpr int kStep = kPingPong ? 2 : 1;
    // The A rows of this warpgroup inside the stage's tile: 64 rows are 8 KiB, 512 descriptor units.
    const std::uint64_t a_rows = kPingPong ? 0 : consumer * 512;
    for (int i = first; i < my_tiles; i += kStep) {
      // Ping-pong: wait until the other consumer issued its main loop of tile i - 1.
      if (kPingPong && i > 0) tile::named_barrier_sync(kTurnBarrier + consumer, kConsumerThreads);
      const TileAt place = tile_at(i);
      int load = i * k_tiles;
      for (int kt = 0; kt < k_tiles; ++kt, ++load) {
        const int slot = load % C::kStages;
        tile::mbarrier_wait(&full[slot], (load / C::kStages) & 1);
        fence_all();
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
#pragma unroll
          for (int h = 0; h < C::kHalves; ++h) {
            wgmma_k16<C::kN, !kForward>(acc[h], desc_a + 2 * ks + h * 512, desc_b, scale_d);
          }
        }
        tile::wgmma_commit();
        if (kPingPong && kt == k_tiles - 1 && i + 1 < my_tiles) {
          // Every load of this tile has landed: the other consumer may start.
          tile::named_barrier_arrive(kTurnBarrier + 1 - consumer, kConsumerThreads);
        }
        tile::wgmma_wait<1>();  // the previous stage's wgmma group is done
        fence_all();
        if (kt > 0 && lane == 0) release((load - 1) % C::kStages);
      }
      tile::wgmma_wait<0>();
      fence_all();
      if (lane == 0) release((load - 1) % C::kStages);

      const int start = offs[place.e];
      const int count = offs[place.e + 1] - start;
      Out* y = out + static_cast<std::int64_t>(start) * cols;
      const __nv_bfloat16* bias =
          kForward && p.bias != nullptr ? at<__nv_bfloat16>(p.bias, static_cast<std::int64_t>(place.e) * p.n) : nullptr;
      const int wg_row0 = place.m0 + (kPingPong ? 0 : consumer * 64);
#pragma unroll
      for (int h = 0; h < C::kHalves; ++h) {
        const int row0 = wg_row0 + h * 64 + wg_warp * 16 + lane / 4;
        const int col0 = place.n0 + (lane % 4) * 2;
#pragma unroll
        for (int j = 0; j < kAccN; j += 2) {
          const int row = row0 + 8 * ((j / 2) % 2);
          const int col = col0 + (j / 4) * 8;
          if (row < count && col < cols) {  // cols % 8 == 0: col + 1 is in too
            float v0 = acc[h][j];
            float v1 = acc[h][j + 1];
            if (bias != nullptr) {
              v0 += __bfloat162float(bias[col]);
              v1 += __bfloat162float(bias[col + 1]);
            }
            store_pair(y + static_cast<std::int64_t>(row) * cols + col, v0, v1);
          }
        }
      }
    }
    zero_rows_outside_groups(offs, p.experts, p.tokens, cols, out);
  }
  // No block may exit while a peer can still arrive on its barriers.
  if constexpr (kCluster > 1) tile::cluster_sync();
}

template <GroupedGemmKind kKind, typename Out, bool kPingPong, int kCluster>
void launch_ws(const Problem& p, cudaStream_t stream) {
  using C = WsConfig<kPingPong>;
  constexpr bool kForward = kKind == GroupedGemmKind::kForward;
  const std::int64_t cols = kForward ? p.n : p.k;
  const std::int64_t depth = kForward ? p.k : p.n;
  const CUtensorMap map_a = bf16_tensor_map<2>(kForward ? p.x : p.dy, {depth, p.tokens}, {C::kK, C::kM});
  const CUtensorMap map_w =
      kForward ? bf16_tensor_map<2>(p.w, {p.k, static_cast<std::int64_t>(p.experts) * p.n}, {C::kK, C::kN / kCluster})
               : bf16_tensor_map<3>(p.w, {p.k, p.n, p.experts}, {64, C::kK, 1});
  const std::size_t smem = C::kAlignSlack + C::kPipelineBytes + 2 * C::kStages * sizeof(std::uint64_t) +
                           2 * sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  auto kernel = grouped_ws_kernel<kKind, Out, kPingPong, kCluster>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(sm_count() / kCluster * kCluster));
  config.blockDim = dim3(C::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = kCluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  // Persistent: only as many clusters as can run at once (GPCs whose SM
  // count is odd leave an SM out of clusters of 2), and no more than a bound
  // on the work units from static sizes (each group's partial last m-tile
  // adds at most one row of units).
  int resident = sm_count();
  if constexpr (kCluster > 1) SG_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
  SG_CHECK_CODE(resident > 0, ErrorCode::kCuda, "grouped_gemm: no cluster of ", kCluster, " blocks with ", smem,
                " bytes of shared memory fits on this device");
  const std::int64_t units =
      ((p.tokens + kCluster * C::kM - 1) / (kCluster * C::kM) + p.experts) * ((cols + C::kN - 1) / C::kN);
  const std::int64_t clusters = std::max<std::int64_t>(1, std::min<std::int64_t>(units, resident));
  config.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  SG_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, map_a, map_w, p));
}

}  // namespace

template <GroupedGemmKind kKind, typename Out>
void launch_grouped_ws(const Problem& p, WsSchedule schedule, WgmmaCluster cluster, cudaStream_t stream) {
  const bool pair = cluster == WgmmaCluster::kPairM;
  if (schedule == WsSchedule::kPingPong) {
    pair ? launch_ws<kKind, Out, true, 2>(p, stream) : launch_ws<kKind, Out, true, 1>(p, stream);
  } else {
    pair ? launch_ws<kKind, Out, false, 2>(p, stream) : launch_ws<kKind, Out, false, 1>(p, stream);
  }
}

template void launch_grouped_ws<GroupedGemmKind::kForward, __nv_bfloat16>(const Problem&, WsSchedule, WgmmaCluster,
                                                                          cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kForward, float>(const Problem&, WsSchedule, WgmmaCluster,
                                                                  cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kDgrad, __nv_bfloat16>(const Problem&, WsSchedule, WgmmaCluster,
                                                                        cudaStream_t);
template void launch_grouped_ws<GroupedGemmKind::kDgrad, float>(const Problem&, WsSchedule, WgmmaCluster, cudaStream_t);

}  // namespace stepgraph::kernels::grouped
