// The grouped forward y = x_e w_e^T (+ bias_e) on Hopper's tensor cores with
// wgmma, fed by TMA through a 4-stage mbarrier pipeline (contract in
// grouped_gemm.h; the shared pieces in grouped_gemm_common.cuh and
// kernels/tile/*.cuh).
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
// past T (zero-filled); a w box past N into the next expert likewise.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tile/group_schedule.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::grouped {
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

// Keeps the compiler from moving accumulator reads or writes across the
// asynchronous wgmma boundaries.
__device__ __forceinline__ void fence_accumulators(float (&acc)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

template <typename Out>
__global__ void __launch_bounds__(WgmmaConfig::kThreads, 1)
    grouped_forward_wgmma_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                                 Problem p) {
  using C = WgmmaConfig;
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
    tile::prefetch_tensor_map(&map_x);
    tile::prefetch_tensor_map(&map_w);
    for (int s = 0; s < C::kStages; ++s) {
      tile::mbarrier_init(&full[s], 1);
      tile::mbarrier_init(&empty[s], C::kThreads / 32);  // one arrival per warp
    }
    tile::fence_barrier_init();
  }
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);  // ends with a barrier
  const int tiles_n = (p.n + C::kN - 1) / C::kN;
  tile::build_tile_starts(p.experts, tile_start,
                          [&](int e) { return (offs[e + 1] - offs[e] + C::kM - 1) / C::kM * tiles_n; });

  const int total = tile_start[p.experts];
  const int grid = static_cast<int>(gridDim.x);
  const int my_tiles =
      total > static_cast<int>(blockIdx.x) ? (total - static_cast<int>(blockIdx.x) + grid - 1) / grid : 0;
  const int k_tiles = (p.k + C::kK - 1) / C::kK;
  const int total_loads = my_tiles * k_tiles;
  struct TileAt {
    int e, m0, n0;
  };
  auto tile_at = [&](int i) {
    const int t = static_cast<int>(blockIdx.x) + i * grid;
    const int e = tile::group_of_tile(tile_start, p.experts, t);
    const int m_tiles = (offs[e + 1] - offs[e] + C::kM - 1) / C::kM;
    const tile::TileMN mn = tile::band_raster(t - tile_start[e], m_tiles, tiles_n, kRasterBand);
    return TileAt{e, mn.m * C::kM, mn.n * C::kN};
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
      tile::tma_load_2d(tile_a(slot), &map_x, &full[slot], k0, offs[place.e] + place.m0);
      tile::tma_load_2d(tile_b(slot), &map_w, &full[slot], k0, place.e * p.n + place.n0);
    }
  };
  if (threadIdx.x == 0) produce_until(C::kStages);
  __syncwarp();

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
      fence_accumulators(acc);
      tile::wgmma_fence();
      const std::uint64_t desc_a = tile::wgmma_descriptor(tile_a(slot) + warpgroup * 64 * 128);
      const std::uint64_t desc_b = tile::wgmma_descriptor(tile_b(slot));
#pragma unroll
      for (int ks = 0; ks < C::kK / 16; ++ks) {
        // k16 slices are 32 bytes apart: 2 in the descriptor's 16-byte units.
        tile::wgmma_m64n256k16(acc, desc_a + 2 * ks, desc_b + 2 * ks, (kt > 0 || ks > 0) ? 1 : 0);
      }
      tile::wgmma_commit();
      tile::wgmma_wait<1>();  // the previous stage's wgmma group is done
      fence_accumulators(acc);
      if (kt > 0 && lane == 0) tile::mbarrier_arrive(&empty[(consumed - 1) % C::kStages]);
      if (threadIdx.x == 0) produce_until(consumed + C::kStages);
      __syncwarp();  // warp 0 reconverges before the next warpgroup-wide wgmma
    }
    tile::wgmma_wait<0>();
    fence_accumulators(acc);
    if (lane == 0) tile::mbarrier_arrive(&empty[(consumed - 1) % C::kStages]);
    if (threadIdx.x == 0) produce_until(consumed + C::kStages);  // the next tile loads during the epilogue
    __syncwarp();

    Out* y = out + static_cast<std::int64_t>(start) * p.n;
    const __nv_bfloat16* bias =
        p.bias != nullptr ? at<__nv_bfloat16>(p.bias, static_cast<std::int64_t>(place.e) * p.n) : nullptr;
    const int row0 = place.m0 + warpgroup * 64 + (warp % 4) * 16 + lane / 4;
    const int col0 = place.n0 + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < 128; j += 2) {
      const int row = row0 + 8 * ((j / 2) % 2);
      const int col = col0 + (j / 4) * 8;
      if (row < count && col < p.n) {  // n % 8 == 0: col + 1 is in too
        float v0 = acc[j];
        float v1 = acc[j + 1];
        if (bias != nullptr) {
          v0 += __bfloat162float(bias[col]);
          v1 += __bfloat162float(bias[col + 1]);
        }
        store_pair(y + static_cast<std::int64_t>(row) * p.n + col, v0, v1);
      }
    }
  }
  zero_rows_outside_groups(offs, p.experts, p.tokens, p.n, out);
}

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

// A [rows, cols] row-major bf16 matrix read in [box_rows, 64] boxes, 128-byte swizzled.
CUtensorMap bf16_tensor_map(const void* base, std::int64_t rows, std::int64_t cols, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(WgmmaConfig::kK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
                           element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SG_CHECK_CODE(result == CUDA_SUCCESS, ErrorCode::kCuda, "grouped_gemm: cuTensorMapEncodeTiled failed (CUresult ",
                static_cast<int>(result), ") for a [", rows, ", ", cols, "] bf16 matrix at ", base);
  return map;
}

int sm_count() {
  int device = 0;
  int count = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace

template <typename Out>
void launch_forward_wgmma(const Problem& p, cudaStream_t stream) {
  using C = WgmmaConfig;
  const CUtensorMap map_x = bf16_tensor_map(p.x, p.tokens, p.k, C::kM);
  const CUtensorMap map_w = bf16_tensor_map(p.w, static_cast<std::int64_t>(p.experts) * p.n, p.k, C::kN);
  const std::size_t smem = C::kAlignSlack + C::kPipelineBytes + 2 * C::kStages * sizeof(std::uint64_t) +
                           2 * sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  auto kernel = grouped_forward_wgmma_kernel<Out>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // A bound on the tile count from static sizes (each group's partial last
  // m-tile adds at most one row of tiles), capped at one block per SM.
  const std::int64_t tiles_n = (p.n + C::kN - 1) / C::kN;
  const std::int64_t tiles = ((p.tokens + C::kM - 1) / C::kM + p.experts) * tiles_n;
  const int grid = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(tiles, sm_count())));
  kernel<<<grid, C::kThreads, smem, stream>>>(map_x, map_w, p);
  SG_CUDA_CHECK(cudaGetLastError());
}

template void launch_forward_wgmma<__nv_bfloat16>(const Problem&, cudaStream_t);
template void launch_forward_wgmma<float>(const Problem&, cudaStream_t);

}  // namespace stepgraph::kernels::grouped
