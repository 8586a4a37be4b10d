// The grouped forward y = x_e w_e^T (+ bias_e) and dgrad dx = dy_e w_e on
// Hopper's tensor cores with wgmma, fed by TMA through a 4-stage mbarrier
// pipeline (contract in grouped_gemm.h; the shared pieces in
// grouped_gemm_common.cuh and kernels/tile/*.cuh). Both multiply a
// token-major operand a (x or dy, K-major) by a weight operand: K-major for
// the forward (w_e rows), N-major for dgrad (w_e read as [N][K] blocks of 64
// output columns, the wgmma transpose bit set). Since the warp-specialised
// kernel of grouped_gemm_ws.cu became the default, this one runs on request
// (SG_GROUPED_GEMM_PATH=wgmma, wgmma_pair_m, wgmma_pair_n; see grouped_gemm.cu);
// it also holds the host helpers both launchers use (bf16_tensor_map, sm_count).
//
// A persistent block per SM (2 warpgroups, 256 threads) walks the device-built
// tile schedule over (group, 128-row m-tile, 256-column n-tile). Thread 0 is
// also the loader: it keeps up to 4 stages of (x box, w box) in flight,
// running ahead across tile boundaries so the next tile's first stages load
// during this tile's epilogue. Each warpgroup computes 64 x 256 of the tile
// with m64n256k16 wgmma (one group in flight while the next stage is awaited),
// then writes its registers straight to y, masked to the group's rows.
//
// TMA boxes ignore group boundaries: an x box may run past the group's last
// row into the next group (those rows of the product are never stored) or
// past T (zero-filled); a forward w box past N into the next expert likewise.
// dgrad reduces over w_e's rows, so its w boxes come from a 3-D view
// [E][N][K] whose N bound zero-fills instead of reading the next expert.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tile/group_schedule.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::grouped {

namespace {
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    SG_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    SG_CHECK_CODE(found == cudaDriverEntryPointSuccess && function != nullptr, ErrorCode::kCuda,
                  "grouped_gemm: the driver has no cuTensorMapEncodeTiled (needs CUDA 12+ drivers)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

}  // namespace

template <int kRank>
CUtensorMap bf16_tensor_map(const void* base, const std::array<std::int64_t, kRank>& dims,
                            const std::array<int, kRank>& box) {
  CUtensorMap map;
  cuuint64_t global_dims[kRank];
  cuuint64_t strides[kRank - 1];
  cuuint32_t box_dims[kRank];
  cuuint32_t element_strides[kRank];
  std::uint64_t stride = 2;
  for (int i = 0; i < kRank; ++i) {
    global_dims[i] = static_cast<cuuint64_t>(dims[i]);
    box_dims[i] = static_cast<cuuint32_t>(box[i]);
    element_strides[i] = 1;
    if (i + 1 < kRank) strides[i] = stride *= static_cast<std::uint64_t>(dims[i]);
  }
  const CUresult result =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRank, const_cast<void*>(base), global_dims, strides,
                           box_dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SG_CHECK_CODE(result == CUDA_SUCCESS, ErrorCode::kCuda, "grouped_gemm: cuTensorMapEncodeTiled failed (CUresult ",
                static_cast<int>(result), ") for a rank-", kRank, " bf16 tensor at ", base, " (innermost ", dims[0],
                ")");
  return map;
}

int sm_count() {
  int device = 0;
  int count = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template CUtensorMap bf16_tensor_map<2>(const void*, const std::array<std::int64_t, 2>&, const std::array<int, 2>&);
template CUtensorMap bf16_tensor_map<3>(const void*, const std::array<std::int64_t, 3>&, const std::array<int, 3>&);

namespace {

struct WgmmaConfig {
  static constexpr int kM = 128;
  static constexpr int kN = 256;
  static constexpr int kK = 64;
  static constexpr int kStages = 4;
  static constexpr int kThreads = 256;
  static constexpr int kTileBytesA = kM * kK * 2;
  static constexpr int kTileBytesB = kN * kK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kPipelineBytes = kStageBytes * kStages;
  static constexpr int kAlignSlack = 1024;  // the dynamic shared base is aligned up to 1024 bytes
};

constexpr int kRasterBand = 8;  // m-tiles per band of the tile order (see tile::band_raster)

// kCluster = 2: the two blocks of a cluster compute adjacent tiles of one
// group and share the operand box the two tiles have in common, each loading
// half of it with a TMA multicast into both (less L2 -> SM traffic):
//   !kAlongN  m-tiles 2u and 2u + 1, one n-tile: they share the w box;
//   kAlongN   one m-tile, n-tiles 2u and 2u + 1: they share the x box.
// A block whose tile lies past its group's last row or past N still loads and
// computes (its stores are all masked), so both blocks run the same schedule.
// On the H100 this ran at ~0.6x of kCluster = 1 (benchmarks/README.md): each
// loading thread waits for the warps of both blocks before it reuses a stage,
// so the pair runs in lockstep. It is kept, tested, behind SG_GROUPED_GEMM_PATH.
template <GroupedGemmKind kKind, typename Out, int kCluster, bool kAlongN>
__global__ void __launch_bounds__(WgmmaConfig::kThreads, 1)
    grouped_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_w,
                         Problem p) {
  using C = WgmmaConfig;
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
      tile::mbarrier_init(&empty[s], kCluster * C::kThreads / 32);  // one arrival per warp of the cluster
    }
    tile::fence_barrier_init();
  }
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);  // ends with a barrier
  const int tiles_n = (cols + C::kN - 1) / C::kN;
  // Work units: kCluster adjacent tiles (one per block of the cluster), in an
  // m_units(e) x n_units grid per group.
  constexpr int kPairM = kAlongN ? 1 : kCluster;
  constexpr int kPairN = kAlongN ? kCluster : 1;
  const int n_units = (tiles_n + kPairN - 1) / kPairN;
  auto m_units = [&](int e) { return (offs[e + 1] - offs[e] + kPairM * C::kM - 1) / (kPairM * C::kM); };
  tile::build_tile_starts(p.experts, tile_start, [&](int e) { return m_units(e) * n_units; });
  if constexpr (kCluster > 1) tile::cluster_sync();  // the peers' barriers are initialised

  const int total = tile_start[p.experts];
  const int grid = static_cast<int>(gridDim.x) / kCluster;  // clusters
  const int cluster = static_cast<int>(blockIdx.x) / kCluster;
  const int my_tiles = total > cluster ? (total - cluster + grid - 1) / grid : 0;
  const int k_tiles = (depth + C::kK - 1) / C::kK;
  const int total_loads = my_tiles * k_tiles;
  struct TileAt {
    int e, m0, n0;
  };
  auto tile_at = [&](int i) {
    const int t = cluster + i * grid;
    const int e = tile::group_of_tile(tile_start, p.experts, t);
    const tile::TileMN mn = tile::band_raster(t - tile_start[e], m_units(e), n_units, kRasterBand / kPairM);
    const int m = kAlongN ? mn.m : mn.m * kCluster + rank;
    const int n = kAlongN ? mn.n * kCluster + rank : mn.n;
    return TileAt{e, m * C::kM, n * C::kN};
  };

  // Thread 0 only: issues loads until `limit` (a load index) or the end.
  int loads = 0;
  auto produce_until = [&](int limit) {
    for (; loads < limit && loads < total_loads; ++loads) {
      const int slot = loads % C::kStages;
      // The slot's previous use (load `loads - kStages`) must be released by every warp.
      if (loads >= C::kStages) tile::mbarrier_wait(&empty[slot], ((loads / C::kStages) & 1) ^ 1);
      const TileAt place = tile_at(loads / k_tiles);
      const int k0 = loads % k_tiles * C::kK;
      tile::mbarrier_arrive_expect_tx(&full[slot], C::kStageBytes);
      constexpr std::uint16_t kAll = (1u << kCluster) - 1;
      const int a_row = offs[place.e] + place.m0;
      const int w_row = place.e * p.n + place.n0;
      if constexpr (kCluster > 1 && kAlongN) {  // this block's half of the x box, into both blocks
        constexpr int kRows = C::kM / kCluster;
        tile::tma_load_2d_multicast(tile_a(slot) + rank * kRows * C::kK * 2, &map_a, &full[slot], k0,
                                    a_row + rank * kRows, kAll);
      } else {
        tile::tma_load_2d(tile_a(slot), &map_a, &full[slot], k0, a_row);
      }
      if constexpr (!kForward) {
        // dgrad: [64 k][64 n] boxes of w_e, one per 64 output columns; with
        // clusters paired along m, each block loads its half of them into both.
        constexpr int kBoxes = C::kN / 64;
        constexpr bool kShared = kCluster > 1 && !kAlongN;
        constexpr int kMine = kShared ? kBoxes / kCluster : kBoxes;
        for (int j = kShared ? rank * kMine : 0, last = j + kMine; j < last; ++j) {
          unsigned char* dst = tile_b(slot) + j * 64 * C::kK * 2;
          if constexpr (kShared) {
            tile::tma_load_3d_multicast(dst, &map_w, &full[slot], place.n0 + j * 64, k0, place.e, kAll);
          } else {
            tile::tma_load_3d(dst, &map_w, &full[slot], place.n0 + j * 64, k0, place.e);
          }
        }
      } else if constexpr (kCluster > 1 && !kAlongN) {  // this block's half of the w box, into both blocks
        constexpr int kRows = C::kN / kCluster;
        tile::tma_load_2d_multicast(tile_b(slot) + rank * kRows * C::kK * 2, &map_w, &full[slot], k0,
                                    w_row + rank * kRows, kAll);
      } else {
        tile::tma_load_2d(tile_b(slot), &map_w, &full[slot], k0, w_row);
      }
    }
  };
  if (threadIdx.x == 0) produce_until(C::kStages);
  __syncwarp();

  // A warp is done with a stage: tell every block whose loads write into it.
  auto release = [&](std::uint64_t* bar) {
    if constexpr (kCluster == 1) {
      tile::mbarrier_arrive(bar);
    } else {
      for (int cta = 0; cta < kCluster; ++cta) tile::mbarrier_arrive_cluster(bar, static_cast<std::uint32_t>(cta));
    }
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  Out* out = static_cast<Out*>(p.out);
  int consumed = 0;
  for (int i = 0; i < my_tiles; ++i) {
    const TileAt place = tile_at(i);
    const int start = offs[place.e];
    const int count = offs[place.e + 1] - start;
    for (int kt = 0; kt < k_tiles; ++kt, ++consumed) {
      const int slot = consumed % C::kStages;
      tile::mbarrier_wait(&full[slot], (consumed / C::kStages) & 1);
      tile::fence_accumulators(acc);
      tile::wgmma_fence();
      const std::uint64_t desc_a = tile::wgmma_descriptor(tile_a(slot) + warpgroup * 64 * 128);
#pragma unroll
      for (int ks = 0; ks < C::kK / 16; ++ks) {
        // K-major: k16 slices are 32 bytes apart (2 in the descriptor's 16-byte
        // units); N-major: 16 rows of 128 bytes apart.
        const int scale_d = (kt > 0 || ks > 0) ? 1 : 0;
        if constexpr (kForward) {
          tile::wgmma_m64n256k16(acc, desc_a + 2 * ks, tile::wgmma_descriptor(tile_b(slot)) + 2 * ks, scale_d);
        } else {
          const std::uint64_t desc_b = tile::wgmma_descriptor_mn_major(tile_b(slot) + ks * 16 * 128, 64 * C::kK * 2);
          tile::wgmma_m64n256k16<true>(acc, desc_a + 2 * ks, desc_b, scale_d);
        }
      }
      tile::wgmma_commit();
      tile::wgmma_wait<1>();  // the previous stage's wgmma group is done
      tile::fence_accumulators(acc);
      if (kt > 0 && lane == 0) release(&empty[(consumed - 1) % C::kStages]);
      if (threadIdx.x == 0) produce_until(consumed + C::kStages);
      __syncwarp();  // warp 0 reconverges before the next warpgroup-wide wgmma
    }
    tile::wgmma_wait<0>();
    tile::fence_accumulators(acc);
    if (lane == 0) release(&empty[(consumed - 1) % C::kStages]);
    if (threadIdx.x == 0) produce_until(consumed + C::kStages);  // the next tile loads during the epilogue
    __syncwarp();

    Out* y = out + static_cast<std::int64_t>(start) * cols;
    const __nv_bfloat16* bias =
        kForward && p.bias != nullptr ? at<__nv_bfloat16>(p.bias, static_cast<std::int64_t>(place.e) * p.n) : nullptr;
    const int row0 = place.m0 + warpgroup * 64 + (warp % 4) * 16 + lane / 4;
    const int col0 = place.n0 + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < 128; j += 2) {
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
  // No block may exit while a peer can still arrive on its barriers.
  if constexpr (kCluster > 1) tile::cluster_sync();
}

template <GroupedGemmKind kKind, typename Out, int kCluster, bool kAlongN>
void launch_wgmma(const Problem& p, cudaStream_t stream) {
  using C = WgmmaConfig;
  constexpr bool kForward = kKind == GroupedGemmKind::kForward;
  const std::int64_t cols = kForward ? p.n : p.k;
  const std::int64_t depth = kForward ? p.k : p.n;
  const int a_box = kAlongN ? C::kM / kCluster : C::kM;
  const CUtensorMap map_a = bf16_tensor_map<2>(kForward ? p.x : p.dy, {depth, p.tokens}, {C::kK, a_box});
  const CUtensorMap map_w = kForward ? bf16_tensor_map<2>(p.w, {p.k, static_cast<std::int64_t>(p.experts) * p.n},
                                                          {C::kK, kAlongN ? C::kN : C::kN / kCluster})
                                     : bf16_tensor_map<3>(p.w, {p.k, p.n, p.experts}, {64, C::kK, 1});
  const std::size_t smem = C::kAlignSlack + C::kPipelineBytes + 2 * C::kStages * sizeof(std::uint64_t) +
                           2 * sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  auto kernel = grouped_wgmma_kernel<kKind, Out, kCluster, kAlongN>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // A bound on the tile count from static sizes (each group's partial last
  // m-tile adds at most one row of tiles), capped at one block per SM.
  const std::int64_t tiles_n = (cols + C::kN - 1) / C::kN;
  const std::int64_t tiles = ((p.tokens + C::kM - 1) / C::kM + p.experts) * tiles_n;
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
  // The schedule is persistent: launch only as many clusters as can run at
  // once (GPCs whose SM count is odd, for one, leave an SM out of clusters of 2).
  int resident = sm_count();
  if constexpr (kCluster > 1) SG_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
  SG_CHECK_CODE(resident > 0, ErrorCode::kCuda, "grouped_gemm: no cluster of ", kCluster, " blocks with ", smem,
                " bytes of shared memory fits on this device");
  const std::int64_t clusters =
      std::max<std::int64_t>(1, std::min<std::int64_t>((tiles + kCluster - 1) / kCluster, resident));
  config.gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  SG_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, map_a, map_w, p));
}

}  // namespace

template <GroupedGemmKind kKind, typename Out>
void launch_grouped_wgmma(const Problem& p, WgmmaCluster cluster, cudaStream_t stream) {
  switch (cluster) {
    case WgmmaCluster::kNone: launch_wgmma<kKind, Out, 1, false>(p, stream); break;
    case WgmmaCluster::kPairM: launch_wgmma<kKind, Out, 2, false>(p, stream); break;
    case WgmmaCluster::kPairN: launch_wgmma<kKind, Out, 2, true>(p, stream); break;
  }
}

template void launch_grouped_wgmma<GroupedGemmKind::kForward, __nv_bfloat16>(const Problem&, WgmmaCluster,
                                                                             cudaStream_t);
template void launch_grouped_wgmma<GroupedGemmKind::kForward, float>(const Problem&, WgmmaCluster, cudaStream_t);
template void launch_grouped_wgmma<GroupedGemmKind::kDgrad, __nv_bfloat16>(const Problem&, WgmmaCluster, cudaStream_t);
template void launch_grouped_wgmma<GroupedGemmKind::kDgrad, float>(const Problem&, WgmmaCluster, cudaStream_t);

}  // namespace stepgraph::kernels::grouped
