// Grouped GEMM kernels (contract in grouped_gemm.h): the launchers, the
// mma.sync kernel, the simple fp32 kernel and the bias gradient.
//
// bf16 inputs take a tensor-core kernel: a persistent grid of at most one
// block per SM walks a tile schedule over (group, m-tile, n-tile) that every
// block builds in shared memory from the device offsets. The forward and
// dgrad run on warp-specialised wgmma + TMA (grouped_gemm_ws.cu); wgrad,
// whose reduction runs over each group's ragged token range, runs the shared
// cp.async + ldmatrix + mma.sync main loop (kernels/tile/mma_pipeline.cuh) with the operand layouts
// of its kind, then writes its fp32 accumulators through the kind's epilogue
// (the forward and dgrad can take it too, see wgmma_path()). fp32 inputs take
// a simple one-thread-per-output kernel over the same clamped offsets. The
// grid size depends only on (T, E, N, K, SM count).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm.h"
#include "kernels/grouped_gemm_common.cuh"
#include "kernels/tile/group_schedule.cuh"
#include "kernels/tile/mma_pipeline.cuh"

namespace stepgraph::kernels {
namespace {

using namespace grouped;  // NOLINT(google-build-using-namespace): this file implements them
using tile::MmaConfig;

// The global operands of group e (rows [start, start + count) of the tokens).
template <GroupedGemmKind kKind>
__device__ __forceinline__ void group_operands(const Problem& p, int e, int start, const GroupShape<kKind>& s,
                                               tile::GlobalOperand& a, tile::GlobalOperand& b) {
  using bf16 = __nv_bfloat16;
  const std::int64_t weight = static_cast<std::int64_t>(e) * p.n * p.k;
  switch (kKind) {
    case GroupedGemmKind::kForward:  // A = x_e [count, K], B = w_e [N, K]
      a = {at<bf16>(p.x, static_cast<std::int64_t>(start) * p.k), p.k, s.m, s.depth};
      b = {at<bf16>(p.w, weight), p.k, s.cols, s.depth};
      break;
    case GroupedGemmKind::kDgrad:  // A = dy_e [count, N], B(kout, n) = w_e[n, kout]
      a = {at<bf16>(p.dy, static_cast<std::int64_t>(start) * p.n), p.n, s.m, s.depth};
      b = {at<bf16>(p.w, weight), p.k, s.cols, s.depth};
      break;
    case GroupedGemmKind::kWgrad:  // A(n, t) = dy_e[t, n], B(k, t) = x_e[t, k]
      a = {at<bf16>(p.dy, static_cast<std::int64_t>(start) * p.n), p.n, s.m, s.depth};
      b = {at<bf16>(p.x, static_cast<std::int64_t>(start) * p.k), p.k, s.cols, s.depth};
      break;
  }
}

template <GroupedGemmKind kKind, typename Out>
__global__ void __launch_bounds__(MmaConfig::kThreads, 1) grouped_gemm_mma_kernel(Problem p) {
  using Shape = GroupShape<kKind>;
  extern __shared__ __align__(128) unsigned char smem[];
  int* offs = reinterpret_cast<int*>(smem + MmaConfig::kPipelineBytes);
  int* tile_start = offs + tile::group_offsets_ints(p.experts);
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);
  const int tiles_n = (Shape::of(p, 0).cols + MmaConfig::kN - 1) / MmaConfig::kN;
  tile::build_tile_starts(p.experts, tile_start, [&](int e) {
    const Shape s = Shape::of(p, offs[e + 1] - offs[e]);
    return (s.m + MmaConfig::kM - 1) / MmaConfig::kM * tiles_n;
  });

  Out* out = static_cast<Out*>(p.out);
  const int total = tile_start[p.experts];
  for (int t = static_cast<int>(blockIdx.x); t < total; t += static_cast<int>(gridDim.x)) {
    const int e = tile::group_of_tile(tile_start, p.experts, t);
    const int start = offs[e];
    const Shape s = Shape::of(p, offs[e + 1] - start);
    const tile::TileMN mn = tile::band_raster(t - tile_start[e], (s.m + MmaConfig::kM - 1) / MmaConfig::kM, tiles_n,
                                              /*band=*/8);
    const int m0 = mn.m * MmaConfig::kM;
    const int n0 = mn.n * MmaConfig::kN;
    tile::GlobalOperand a;
    tile::GlobalOperand b;
    group_operands<kKind>(p, e, start, s, a, b);

    tile::Accumulators acc;
    tile::block_mma<Shape::kAKMajor, Shape::kBKMajor>(acc, smem, a, b, m0, n0, s.depth);

    Out* c = out + (Shape::kTokensAlongM ? static_cast<std::int64_t>(start) * s.ldc
                                         : static_cast<std::int64_t>(e) * p.n * p.k);
    const __nv_bfloat16* bias =
        p.bias != nullptr ? at<__nv_bfloat16>(p.bias, static_cast<std::int64_t>(e) * p.n) : nullptr;
    tile::for_each_accumulator_pair(acc, [&](int r, int col, float v0, float v1) {
      const int row = m0 + r;
      const int column = n0 + col;
      if (row >= s.m || column >= s.cols) return;  // cols % 8 == 0: column + 1 is in too
      Out* dst = c + row * s.ldc + column;
      if (bias != nullptr) {
        v0 += __bfloat162float(bias[column]);
        v1 += __bfloat162float(bias[column + 1]);
      }
      if constexpr (std::is_same_v<Out, float>) {
        if (p.accumulate) {
          const float2 old = *reinterpret_cast<const float2*>(dst);
          v0 += old.x;
          v1 += old.y;
        }
      }
      store_pair(dst, v0, v1);
    });
  }
  if constexpr (Shape::kTokensAlongM) {
    zero_rows_outside_groups(offs, p.experts, p.tokens, Shape::output_cols(p), out);
  }
}

// fp32 (or any In) inputs: one thread per output element, the same clamped
// offsets; the group of a token row by binary search.
template <GroupedGemmKind kKind, typename In, typename Out>
__global__ void grouped_gemm_simple_kernel(Problem p) {
  extern __shared__ int offs[];
  tile::load_group_offsets(p.offsets, p.experts, p.tokens, offs);
  const In* x = static_cast<const In*>(p.x);
  const In* w = static_cast<const In*>(p.w);
  const In* dy = static_cast<const In*>(p.dy);
  const In* bias = static_cast<const In*>(p.bias);
  Out* out = static_cast<Out*>(p.out);
  const std::int64_t n = p.n;
  const std::int64_t k = p.k;
  const std::int64_t cols = kKind == GroupedGemmKind::kForward ? n : k;
  const std::int64_t count = kKind == GroupedGemmKind::kWgrad ? p.experts * n * k : p.tokens * cols;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float sum = 0.0f;
    if constexpr (kKind == GroupedGemmKind::kWgrad) {
      const std::int64_t e = i / (n * k);
      const std::int64_t row = i / k % n;
      const std::int64_t col = i % k;
      for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t) sum += as_float(dy[t * n + row]) * as_float(x[t * k + col]);
      if (p.accumulate) sum += as_float(out[i]);
    } else {
      const std::int64_t row = i / cols;
      const std::int64_t col = i % cols;
      if (row >= offs[0] && row < offs[p.experts]) {
        const int e = tile::group_of_tile(offs, p.experts, static_cast<int>(row));
        const In* we = w + e * n * k;
        if constexpr (kKind == GroupedGemmKind::kForward) {
          for (std::int64_t j = 0; j < k; ++j) sum += as_float(x[row * k + j]) * as_float(we[col * k + j]);
          if (bias != nullptr) sum += as_float(bias[e * n + col]);
        } else {
          for (std::int64_t j = 0; j < n; ++j) sum += as_float(dy[row * n + j]) * as_float(we[j * k + col]);
        }
      }
    }
    out[i] = from_float<Out>(sum);
  }
}

// db[e, col] (+)= sum over the rows of group e of dy[row, col]: a block per
// (32 columns, group), 8 row lanes, a fixed-order reduction.
template <typename In>
__global__ void grouped_bias_grad_kernel(const In* dy, const std::int32_t* offsets, int tokens, int experts, int n,
                                         bool accumulate, float* db) {
  extern __shared__ int offs[];
  __shared__ float partial[8][33];
  tile::load_group_offsets(offsets, experts, tokens, offs);
  const int e = static_cast<int>(blockIdx.y);
  const int col = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  float sum = 0.0f;
  if (col < n) {
    for (std::int64_t row = offs[e] + threadIdx.y; row < offs[e + 1]; row += blockDim.y) {
      sum += as_float(dy[row * n + col]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float total = 0.0f;
    for (int y = 0; y < 8; ++y) total += partial[y][threadIdx.x];
    float* dst = db + static_cast<std::int64_t>(e) * n + col;
    *dst = accumulate ? *dst + total : total;
  }
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

template <GroupedGemmKind kKind, typename Out>
void launch_mma(const Problem& p, cudaStream_t stream) {
  auto kernel = grouped_gemm_mma_kernel<kKind, Out>;
  const std::size_t smem =
      MmaConfig::kPipelineBytes + 2 * sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  // Raise the kernel's shared-memory limit to what this launch needs (not a
  // stream operation, so it is allowed while a stream is being captured).
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const GroupShape<kKind> s = GroupShape<kKind>::of(p, p.tokens);
  const std::int64_t tiles_n = ceil_div(s.cols, MmaConfig::kN);
  // A bound on the tile count from static sizes: every group's partial last
  // m-tile adds at most one tile per n-tile.
  const std::int64_t tiles = GroupShape<kKind>::kTokensAlongM
                                 ? (ceil_div(p.tokens, MmaConfig::kM) + p.experts) * tiles_n
                                 : p.experts * ceil_div(s.m, MmaConfig::kM) * tiles_n;
  const int grid = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(tiles, sm_count())));
  kernel<<<grid, MmaConfig::kThreads, smem, stream>>>(p);
  SG_CUDA_CHECK(cudaGetLastError());
}

template <GroupedGemmKind kKind, typename Out>
void launch_simple(const Problem& p, cudaStream_t stream) {
  const std::int64_t cols = kKind == GroupedGemmKind::kForward ? p.n : p.k;
  const std::int64_t count =
      kKind == GroupedGemmKind::kWgrad ? static_cast<std::int64_t>(p.experts) * p.n * p.k : p.tokens * cols;
  const int blocks = static_cast<int>(std::clamp<std::int64_t>(ceil_div(count, 256), 1, 8192));
  const std::size_t smem = sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(p.experts));
  grouped_gemm_simple_kernel<kKind, float, Out><<<blocks, 256, smem, stream>>>(p);
  SG_CUDA_CHECK(cudaGetLastError());
}

// The kernel of the forward and of dgrad, picked by SG_GROUPED_GEMM_PATH
// (read at every launch, so tests and benchmarks can compare the paths):
//   wgmma_coop (default)  warp-specialised (grouped_gemm_ws.cu): a TMA
//                     producer warpgroup, two consumer warpgroups sharing
//                     each 128 x 256 tile;
//   wgmma_pingpong    warp-specialised, the two consumers on their own
//                     128 x 128 tiles, in turn (slower on the H100: more
//                     L2 -> shared traffic per flop);
//   wgmma_coop_pair / wgmma_pingpong_pair  those in clusters of 2 blocks
//                     (adjacent m-tiles) sharing the w box by multicast
//                     (correct, much slower on the H100);
//   mma_sync          the Ampere-style kernel wgrad uses.
// SG_GROUPED_GEMM_RASTER_BAND (a positive integer) overrides the
// warp-specialised kernels' m-tiles per band of the tile order, for tuning.
enum class ForwardKernel { kWarpSpecialised, kMmaSync };
struct WgmmaPath {
  ForwardKernel kernel = ForwardKernel::kWarpSpecialised;
  WgmmaCluster cluster = WgmmaCluster::kNone;
  WsSchedule schedule = WsSchedule::kCooperative;
};

WgmmaPath wgmma_path() {
  const char* path = std::getenv("SG_GROUPED_GEMM_PATH");
  if (path == nullptr) return {};
  const std::string_view name(path);
  using enum ForwardKernel;
  if (name == "wgmma_pingpong") return {kWarpSpecialised, WgmmaCluster::kNone, WsSchedule::kPingPong};
  if (name == "wgmma_pingpong_pair") return {kWarpSpecialised, WgmmaCluster::kPairM, WsSchedule::kPingPong};
  if (name == "wgmma_coop") return {kWarpSpecialised, WgmmaCluster::kNone, WsSchedule::kCooperative};
  if (name == "wgmma_coop_pair") return {kWarpSpecialised, WgmmaCluster::kPairM, WsSchedule::kCooperative};
  SG_CHECK(name == "mma_sync",
           "SG_GROUPED_GEMM_PATH must be wgmma_coop, wgmma_coop_pair, wgmma_pingpong, wgmma_pingpong_pair or "
           "mma_sync, got '",
           path, "'");
  return {kMmaSync, WgmmaCluster::kNone};
}

int raster_band() {
  const char* value = std::getenv("SG_GROUPED_GEMM_RASTER_BAND");
  if (value == nullptr) return 0;
  const int band = std::atoi(value);
  SG_CHECK(band > 0 && band <= 4096, "SG_GROUPED_GEMM_RASTER_BAND must be an integer in [1, 4096], got '", value, "'");
  return band;
}

template <GroupedGemmKind kKind>
void launch_kind(const GroupedGemmDesc& d, const Problem& p, cudaStream_t stream) {
  const bool bf16_out = d.out_type == DType::kBFloat16;
  if (d.in_type == DType::kBFloat16) {
    if constexpr (kKind == GroupedGemmKind::kWgrad) {
      launch_mma<kKind, float>(p, stream);
    } else if (const WgmmaPath path = wgmma_path(); path.kernel == ForwardKernel::kWarpSpecialised) {
      Problem tuned = p;
      tuned.raster_band = raster_band();
      bf16_out ? launch_grouped_ws<kKind, __nv_bfloat16>(tuned, path.schedule, path.cluster, stream)
               : launch_grouped_ws<kKind, float>(tuned, path.schedule, path.cluster, stream);
    } else {
      bf16_out ? launch_mma<kKind, __nv_bfloat16>(p, stream) : launch_mma<kKind, float>(p, stream);
    }
  } else {
    if constexpr (kKind == GroupedGemmKind::kWgrad) {
      launch_simple<kKind, float>(p, stream);
    } else {
      bf16_out ? launch_simple<kKind, __nv_bfloat16>(p, stream) : launch_simple<kKind, float>(p, stream);
    }
  }
}

void check_pointer(const GroupedGemmDesc& d, const void* pointer, const char* name) {
  SG_CHECK(pointer != nullptr, "grouped_gemm ", grouped_gemm_kind_name(d.kind), ": ", name,
           " is null; pass a device pointer");
  SG_CHECK(d.in_type != DType::kBFloat16 || reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0, "grouped_gemm ",
           grouped_gemm_kind_name(d.kind), ": ", name, " (", pointer,
           ") is not 16-byte aligned; the tensor-core path copies 16-byte chunks");
}

}  // namespace

void launch_grouped_gemm(const GroupedGemmDesc& desc, const GroupedGemmOperands& o, cudaStream_t stream) {
  check_grouped_gemm(desc);
  const bool token_output = desc.kind != GroupedGemmKind::kWgrad;
  if (token_output && desc.tokens == 0) return;  // nothing to write
  Problem p;
  p.x = o.x;
  p.w = o.w;
  p.dy = o.dy;
  p.bias = desc.bias ? o.bias : nullptr;
  p.offsets = o.offsets;
  p.out = o.out;
  p.tokens = static_cast<int>(desc.tokens);
  p.experts = static_cast<int>(desc.experts);
  p.n = static_cast<int>(desc.n);
  p.k = static_cast<int>(desc.k);
  p.accumulate = desc.accumulate;
  SG_CHECK(o.offsets != nullptr, "grouped_gemm: offsets is null; pass the device int32 [E + 1] offsets");
  check_pointer(desc, o.out, "out");
  switch (desc.kind) {
    case GroupedGemmKind::kForward:
      check_pointer(desc, o.x, "x");
      check_pointer(desc, o.w, "w");
      if (desc.bias) SG_CHECK(o.bias != nullptr, "grouped_gemm forward: bias is null but desc.bias is set");
      launch_kind<GroupedGemmKind::kForward>(desc, p, stream);
      break;
    case GroupedGemmKind::kDgrad:
      check_pointer(desc, o.dy, "dy");
      check_pointer(desc, o.w, "w");
      launch_kind<GroupedGemmKind::kDgrad>(desc, p, stream);
      break;
    case GroupedGemmKind::kWgrad:
      if (desc.tokens > 0) {
        check_pointer(desc, o.dy, "dy");
        check_pointer(desc, o.x, "x");
      }
      launch_kind<GroupedGemmKind::kWgrad>(desc, p, stream);
      break;
  }
}

void launch_grouped_bias_grad(const GroupedBiasGradDesc& desc, const void* dy, const std::int32_t* offsets, float* db,
                              cudaStream_t stream) {
  check_grouped_bias_grad(desc);
  SG_CHECK(offsets != nullptr && db != nullptr && (dy != nullptr || desc.tokens == 0),
           "grouped_bias_grad: null pointer (dy, offsets and db must be device pointers)");
  const dim3 grid(static_cast<unsigned>(ceil_div(desc.n, 32)), static_cast<unsigned>(desc.experts));
  const dim3 block(32, 8);
  const std::size_t smem = sizeof(int) * static_cast<std::size_t>(tile::group_offsets_ints(desc.experts));
  const int tokens = static_cast<int>(desc.tokens);
  const int experts = static_cast<int>(desc.experts);
  const int n = static_cast<int>(desc.n);
  if (desc.dy_type == DType::kBFloat16) {
    grouped_bias_grad_kernel<<<grid, block, smem, stream>>>(static_cast<const __nv_bfloat16*>(dy), offsets, tokens,
                                                            experts, n, desc.accumulate, db);
  } else {
    grouped_bias_grad_kernel<<<grid, block, smem, stream>>>(static_cast<const float*>(dy), offsets, tokens, experts, n,
                                                            desc.accumulate, db);
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
