// The tensor-core attention backward (bf16/fp16, head_dim 64 and 128) on
// Hopper: FlashAttention-2's two-kernel form, deterministic (no atomics),
// each kernel on TMA + wgmma with a producer warpgroup and two consumer
// warpgroups, as the forward (Note [Attention forward on wgmma]).
//
// Note [Attention backward without atomics]
// After the delta kernel (delta = rowsum(dout * out), attention_simple.cu):
//  - dK/dV: a block owns kBN = 128 keys of one kv head (64 per consumer
//    warpgroup, K and V loaded once) and walks the query heads of its group
//    and, per head, the query tiles (kBM = 64) that see its keys, with Q, dO
//    and the tile's lse and delta in a two-stage ring. Everything is computed
//    transposed, keys along wgmma's M: S^T = K Q^T and dP^T = V dO^T (both
//    operands in shared memory), P^T = exp2(S^T - lse), dS^T =
//    P^T (dP^T - delta), and then dV += P^T dO and dK += dS^T Q take P^T and
//    dS^T as register A operands straight from the accumulators (rounded to
//    16 bits), dO and Q read N-major. No shared-memory round trip of P.
//  - dQ: a block owns kBM = 128 queries of one head (64 per consumer
//    warpgroup; Q and dO loaded once) and walks its kv tiles (kBN = 64) as
//    the forward does: S = Q K^T, dP = dO V^T, dS, dQ += dS K (K N-major).
// Each gradient element is summed by one thread in a fixed order, so the
// bits are the same on every launch (eager == graph replay).
// TMA boxes ignore sequence boundaries (rows past a sequence's end are the
// next sequence's, or zero past T): a query row there gets lse = +inf (so
// P = 0) and delta = 0, a key column there is masked, and nothing is written
// for either.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/attention_paths.h"
#include "kernels/tensor_map.h"
#include "kernels/tile/attention_tile.cuh"
#include "kernels/tile/wgmma_ops.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::attention_detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct BackwardParams {
  const float* lse;
  const float* delta;
  const std::int32_t* cu_seqlens;
  void* dq;
  void* dk;
  void* dv;
  int tokens, sequences, heads, kv_heads;
  bool causal;
  float scale;
  float scale_log2;
};

// Both kernels: 384 threads, a producer warpgroup and two consumer
// warpgroups of 64 rows each; kFixedRows rows of two tensors loaded once
// (K and V, or Q and dO) and kStepRows rows of two tensors per step.
template <int D, int kFixedRows_, int kStepRows_>
struct BackwardConfig {
  static constexpr int kFixedRows = kFixedRows_;
  static constexpr int kStepRows = kStepRows_;
  static constexpr int kThreads = 384;
  static constexpr int kStages = 2;
  static constexpr int kFixedBytes = kFixedRows * D * 2;  // one of the two fixed tensors
  static constexpr int kStepBytes = kStepRows * D * 2;    // one of the two step tensors
  static constexpr int kPipelineBytes = 2 * kFixedBytes + 2 * kStages * kStepBytes;
  static constexpr int kVectorBytes = kStages * 2 * kStepRows * 4;  // dK/dV: lse and delta per step
  static constexpr int kBarriers = 1 + 2 * kStages;
  static constexpr int kSmemBytes = 1024 + kPipelineBytes + kVectorBytes + kBarriers * 8;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
  static_assert(tile::register_split_fits(kProducerRegisters, kConsumerRegisters));
  static constexpr int kReaderWarps = 8;
  // Descriptor units (16 bytes) between the 64-column blocks of a tile.
  static constexpr std::uint64_t kFixedBlock = kFixedRows * 128 / 16;
  static constexpr std::uint64_t kStepBlock = kStepRows * 128 / 16;
};

template <int D>
using DkdvConfig = BackwardConfig<D, 128, 64>;  // 128 keys per block, 64 queries per step
template <int D>
using DqConfig = BackwardConfig<D, 128, 64>;  // 128 queries per block, 64 keys per step

// The shared-memory layout of both kernels: the fixed tiles (a, b), the
// step ring (a, b per stage), the step vectors, the barriers.
template <typename C>
struct BackwardSmem {
  unsigned char* base;
  __device__ explicit BackwardSmem(unsigned char* raw)
      : base(reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) &
                                              ~std::uintptr_t{1023})) {}
  __device__ unsigned char* fixed(int which) const { return base + which * C::kFixedBytes; }
  __device__ unsigned char* step(int which, int stage) const {
    return base + 2 * C::kFixedBytes + (2 * stage + which) * C::kStepBytes;
  }
  __device__ float* vectors(int stage) const {
    return reinterpret_cast<float*>(base + C::kPipelineBytes) + stage * 2 * C::kStepRows;
  }
  __device__ std::uint64_t* fixed_full() const {
    return reinterpret_cast<std::uint64_t*>(base + C::kPipelineBytes + C::kVectorBytes);
  }
  __device__ std::uint64_t* full() const { return fixed_full() + 1; }
  __device__ std::uint64_t* empty() const { return full() + C::kStages; }
};

// Thread 0 initialises the barriers (a step's full barrier expects
// `full_arrivals`); published by the barrier of block_locate_tile.
template <typename C>
__device__ __forceinline__ void init_barriers(const BackwardSmem<C>& sm, int full_arrivals) {
  if (threadIdx.x != 0) return;
  tile::mbarrier_init(sm.fixed_full(), 1);
  for (int s = 0; s < C::kStages; ++s) {
    tile::mbarrier_init(&sm.full()[s], full_arrivals);
    tile::mbarrier_init(&sm.empty()[s], C::kReaderWarps);
  }
  tile::fence_barrier_init();
}

// TMA of rows [row, row + rows) and columns [col, col + D) of `map` into a
// tile of D / 64 column blocks.
template <int D>
__device__ __forceinline__ void load_rows(unsigned char* dst, const CUtensorMap* map, std::uint64_t* bar, int col,
                                          int row, int rows) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c) tile::tma_load_2d(dst + c * rows * 128, map, bar, col + c * 64, row);
}

// acc = A B^T over D (both K-major in shared memory; A's 64 rows of this
// warpgroup at a_desc, B's N rows at b_desc; column blocks a_block, b_block apart).
template <typename Gemm, int D>
__device__ __forceinline__ void gemm_over_d(float (&acc)[Gemm::kAccumulators], std::uint64_t a_desc,
                                            std::uint64_t a_block, std::uint64_t b_desc, std::uint64_t b_block) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const std::uint64_t step = 2 * (ks % 4);  // k16 slices are 32 bytes apart in a 128-byte row
    Gemm::template ss<false>(acc, a_desc + (ks / 4) * a_block + step, b_desc + (ks / 4) * b_block + step,
                             ks > 0 ? 1 : 0);
  }
}

// acc += A B with A the register operand (16-bit, k16 steps of kRows rows
// of B) and B N-major in shared memory (kRows rows, D / 64 column blocks).
template <typename Gemm, int kRows>
__device__ __forceinline__ void gemm_rows(float (&acc)[Gemm::kAccumulators], const std::uint32_t (&a)[kRows / 16][4],
                                          const unsigned char* b) {
#pragma unroll
  for (int kk = 0; kk < kRows / 16; ++kk) {
    Gemm::template rs<true>(acc, a[kk], tile::wgmma_descriptor_mn_major(b + kk * 16 * 128, kRows * 128), 1);
  }
}

template <typename T, int D>
__device__ __forceinline__ void store_rows(T* base, std::int64_t ld, const float (&acc)[D / 2], float factor,
                                           int row_lo, int end, int lane) {
  using M = tile::Half16<T>;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    if (row >= end) continue;
    T* dst = base + row * ld + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<std::uint32_t*>(dst + j * 8) =
          M::pack(acc[4 * j + 2 * r] * factor, acc[4 * j + 2 * r + 1] * factor);
    }
  }
}

template <int kCount>
__device__ __forceinline__ void zero(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) acc[i] = 0.0f;
}

template <typename T, int D>
__global__ void __launch_bounds__(DkdvConfig<D>::kThreads, 1)
    attention_dkdv_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                                const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                                BackwardParams p) {
  using C = DkdvConfig<D>;
  using SGemm = tile::Wgmma<T, C::kStepRows>;  // S^T, dP^T: 64 keys x 64 queries per warpgroup
  using DGemm = tile::Wgmma<T, D>;             // dK, dV: 64 keys x D
  constexpr int kBN = C::kFixedRows;
  constexpr int kBM = C::kStepRows;
  extern __shared__ unsigned char smem_raw[];
  const BackwardSmem<C> sm(smem_raw);
  init_barriers(sm, 1 + 32);  // the TMA thread's arrival and a warp storing lse and delta

  tile::SequenceTile seq;
  if (!tile::block_locate_tile(p.cu_seqlens, p.sequences, p.tokens, kBN, static_cast<int>(blockIdx.x), &seq)) return;
  const int g = static_cast<int>(blockIdx.y);
  const int group = p.heads / p.kv_heads;
  const int n0 = seq.first;
  // Steps: (query head of the group, query tile that sees these keys).
  const int first_tile = p.causal ? (n0 - seq.begin) / kBM : 0;
  const int q_tiles = (seq.end - seq.begin + kBM - 1) / kBM - first_tile;
  const int steps = group * q_tiles;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warpgroup = warp / 4;

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    // Steps in order: query heads of the group, then query tiles from first_row.
    const int first_row = seq.begin + first_tile * kBM;
    if (threadIdx.x == 0) {
      tile::mbarrier_arrive_expect_tx(sm.fixed_full(), 2 * C::kFixedBytes);
      load_rows<D>(sm.fixed(0), &map_k, sm.fixed_full(), g * D, n0, kBN);
      load_rows<D>(sm.fixed(1), &map_v, sm.fixed_full(), g * D, n0, kBN);
      int t = 0;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int q0 = first_row; q0 < seq.end; q0 += kBM, ++t) {
          const int stage = t % C::kStages;
          tile::ring_wait_empty<C::kStages>(sm.empty(), t);
          tile::mbarrier_arrive_expect_tx(&sm.full()[stage], 2 * C::kStepBytes);
          load_rows<D>(sm.step(0, stage), &map_q, &sm.full()[stage], h * D, q0, kBM);
          load_rows<D>(sm.step(1, stage), &map_do, &sm.full()[stage], h * D, q0, kBM);
        }
      }
    } else if (warp == 1) {
      // lse (base 2) and delta of the step's queries; +inf and 0 past the sequence.
      int t = 0;
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const float* lse = p.lse + static_cast<std::int64_t>(h) * p.tokens;
        const float* delta = p.delta + static_cast<std::int64_t>(h) * p.tokens;
        for (int q0 = first_row; q0 < seq.end; q0 += kBM, ++t) {
          const int stage = t % C::kStages;
          tile::ring_wait_empty<C::kStages>(sm.empty(), t);
          float* vectors = sm.vectors(stage);
          for (int i = lane; i < kBM; i += 32) {
            const int row = q0 + i;
            vectors[i] = row < seq.end ? lse[row] * kLog2e : INFINITY;
            vectors[kBM + i] = row < seq.end ? delta[row] : 0.0f;
          }
          tile::mbarrier_arrive(&sm.full()[stage]);
        }
      }
    }
    return;
  }

  tile::setmaxnreg_inc<C::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp_row = consumer * 64 + (warp % 4) * 16;  // this warp's first key in the block
  const int key_lo = n0 + warp_row + lane / 4;           // this thread's keys: key_lo, key_lo + 8
  const std::uint64_t k_desc = tile::wgmma_descriptor(sm.fixed(0)) + consumer * (64 * 128 / 16);
  const std::uint64_t v_desc = tile::wgmma_descriptor(sm.fixed(1)) + consumer * (64 * 128 / 16);
  float dk[D / 2];
  float dv[D / 2];
  zero(dk);
  zero(dv);
  float s[kBM / 2];
  float dp[kBM / 2];
  std::uint32_t pa[kBM / 16][4];
  std::uint32_t dsa[kBM / 16][4];

  tile::mbarrier_wait(sm.fixed_full(), 0);
  for (int t = 0; t < steps; ++t) {
    const int stage = t % C::kStages;
    tile::ring_wait_full<C::kStages>(sm.full(), t);
    tile::fence_accumulators(s);
    tile::fence_accumulators(dp);
    tile::wgmma_fence();
    gemm_over_d<SGemm, D>(s, k_desc, C::kFixedBlock, tile::wgmma_descriptor(sm.step(0, stage)), C::kStepBlock);
    gemm_over_d<SGemm, D>(dp, v_desc, C::kFixedBlock, tile::wgmma_descriptor(sm.step(1, stage)), C::kStepBlock);
    tile::wgmma_commit();
    tile::wgmma_wait<0>();
    tile::fence_accumulators(s);
    tile::fence_accumulators(dp);

    // P^T and dS^T (in place). Causal: query q sees key j when q >= j.
    const float* lse2 = sm.vectors(stage);
    const float* delta = lse2 + kBM;
    const int q0 = seq.begin + (first_tile + t % q_tiles) * kBM;
    const bool mask = p.causal && q0 < n0 + warp_row + 15;
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + 2 * (lane & 3) + (e & 1);
        float prob = tile::fast_exp2(fmaf(s[4 * j + e], p.scale_log2, -lse2[col]));
        if (mask && q0 + col < key_lo + (e >> 1) * 8) prob = 0.0f;
        s[4 * j + e] = prob;
        dp[4 * j + e] = prob * (dp[4 * j + e] - delta[col]);
      }
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) {
      tile::accumulators_to_a<T>(pa[kk], s, kk);
      tile::accumulators_to_a<T>(dsa[kk], dp, kk);
    }

    // dV += P^T dO, dK += dS^T Q (the queries as k).
    tile::fence_accumulators(dv);
    tile::fence_accumulators(dk);
    tile::wgmma_fence();
    gemm_rows<DGemm, kBM>(dv, pa, sm.step(1, stage));
    gemm_rows<DGemm, kBM>(dk, dsa, sm.step(0, stage));
    tile::wgmma_commit();
    tile::wgmma_wait<0>();
    tile::fence_accumulators(dv);
    tile::fence_accumulators(dk);
    tile::fence_registers(pa);
    tile::fence_registers(dsa);
    tile::ring_release<C::kStages>(sm.empty(), t);
  }

  const std::int64_t kv_ld = static_cast<std::int64_t>(p.kv_heads) * D;
  store_rows<T, D>(static_cast<T*>(p.dk) + g * D, kv_ld, dk, p.scale, key_lo, seq.end, lane);
  store_rows<T, D>(static_cast<T*>(p.dv) + g * D, kv_ld, dv, 1.0f, key_lo, seq.end, lane);
}

template <typename T, int D>
__global__ void __launch_bounds__(DqConfig<D>::kThreads, 1)
    attention_dq_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                              const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                              BackwardParams p) {
  using C = DqConfig<D>;
  using SGemm = tile::Wgmma<T, C::kStepRows>;  // S, dP: 64 queries x 64 keys per warpgroup
  using DGemm = tile::Wgmma<T, D>;             // dQ: 64 queries x D
  constexpr int kBM = C::kFixedRows;
  constexpr int kBN = C::kStepRows;
  extern __shared__ unsigned char smem_raw[];
  const BackwardSmem<C> sm(smem_raw);
  init_barriers(sm, 1);

  tile::SequenceTile seq;
  const int target = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // long causal tiles first
  if (!tile::block_locate_tile(p.cu_seqlens, p.sequences, p.tokens, kBM, target, &seq)) return;
  const int h = static_cast<int>(blockIdx.y);
  const int g = h / (p.heads / p.kv_heads);
  const int m0 = seq.first;
  const int kv_end = p.causal ? min(seq.end, m0 + kBM) : seq.end;
  const int kv_tiles = (kv_end - seq.begin + kBN - 1) / kBN;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warpgroup = warp / 4;

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    if (threadIdx.x == 0) {
      tile::mbarrier_arrive_expect_tx(sm.fixed_full(), 2 * C::kFixedBytes);
      load_rows<D>(sm.fixed(0), &map_q, sm.fixed_full(), h * D, m0, kBM);
      load_rows<D>(sm.fixed(1), &map_do, sm.fixed_full(), h * D, m0, kBM);
      for (int n = 0; n < kv_tiles; ++n) {
        const int stage = n % C::kStages;
        tile::ring_wait_empty<C::kStages>(sm.empty(), n);
        tile::mbarrier_arrive_expect_tx(&sm.full()[stage], 2 * C::kStepBytes);
        load_rows<D>(sm.step(0, stage), &map_k, &sm.full()[stage], g * D, seq.begin + n * kBN, kBN);
        load_rows<D>(sm.step(1, stage), &map_v, &sm.full()[stage], g * D, seq.begin + n * kBN, kBN);
      }
    }
    return;
  }

  tile::setmaxnreg_inc<C::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp_row = consumer * 64 + (warp % 4) * 16;
  const int row_lo = m0 + warp_row + lane / 4;
  float lse2[2];
  float delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    const std::int64_t at = static_cast<std::int64_t>(h) * p.tokens + row;
    lse2[r] = row < seq.end ? p.lse[at] * kLog2e : INFINITY;
    delta[r] = row < seq.end ? p.delta[at] : 0.0f;
  }
  const std::uint64_t q_desc = tile::wgmma_descriptor(sm.fixed(0)) + consumer * (64 * 128 / 16);
  const std::uint64_t do_desc = tile::wgmma_descriptor(sm.fixed(1)) + consumer * (64 * 128 / 16);
  float dq[D / 2];
  zero(dq);
  float s[kBN / 2];
  float dp[kBN / 2];
  std::uint32_t dsa[kBN / 16][4];

  tile::mbarrier_wait(sm.fixed_full(), 0);
  for (int n = 0; n < kv_tiles; ++n) {
    const int stage = n % C::kStages;
    tile::ring_wait_full<C::kStages>(sm.full(), n);
    tile::fence_accumulators(s);
    tile::fence_accumulators(dp);
    tile::wgmma_fence();
    gemm_over_d<SGemm, D>(s, q_desc, C::kFixedBlock, tile::wgmma_descriptor(sm.step(0, stage)), C::kStepBlock);
    gemm_over_d<SGemm, D>(dp, do_desc, C::kFixedBlock, tile::wgmma_descriptor(sm.step(1, stage)), C::kStepBlock);
    tile::wgmma_commit();
    tile::wgmma_wait<0>();
    tile::fence_accumulators(s);
    tile::fence_accumulators(dp);

    const int n0 = seq.begin + n * kBN;
    const bool mask = n0 + kBN > seq.end || (p.causal && n0 + kBN - 1 > m0 + warp_row);
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float prob = tile::fast_exp2(fmaf(s[4 * j + e], p.scale_log2, -lse2[r]));
        if (mask) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1);
          if (col >= seq.end || (p.causal && col > row_lo + 8 * r)) prob = 0.0f;
        }
        dp[4 * j + e] = prob * (dp[4 * j + e] - delta[r]);
      }
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) tile::accumulators_to_a<T>(dsa[kk], dp, kk);

    tile::fence_accumulators(dq);
    tile::wgmma_fence();
    gemm_rows<DGemm, kBN>(dq, dsa, sm.step(0, stage));  // dQ += dS K
    tile::wgmma_commit();
    tile::wgmma_wait<0>();
    tile::fence_accumulators(dq);
    tile::fence_registers(dsa);
    tile::ring_release<C::kStages>(sm.empty(), n);
  }
  const std::int64_t q_ld = static_cast<std::int64_t>(p.heads) * D;
  store_rows<T, D>(static_cast<T*>(p.dq) + h * D, q_ld, dq, p.scale, row_lo, seq.end, lane);
}

template <typename T, int D>
void launch(const AttentionDesc& desc, const AttentionPointers& ptr, const BackwardParams& params,
            CUstream_st* stream) {
  const std::int64_t q_width = desc.heads * D;
  const std::int64_t kv_width = desc.kv_heads * D;
  auto query_map = [&](const void* base, int rows) {
    return swizzled_tensor_map<2>(desc.dtype, base, {q_width, desc.tokens}, {64, rows});
  };
  auto key_map = [&](const void* base, int rows) {
    return swizzled_tensor_map<2>(desc.dtype, base, {kv_width, desc.tokens}, {64, rows});
  };
  {
    using C = DkdvConfig<D>;
    auto* kernel = attention_dkdv_wgmma_kernel<T, D>;
    SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
    const dim3 grid(static_cast<unsigned>(tile::attention_tile_bound(desc.tokens, desc.sequences, C::kFixedRows)),
                    static_cast<unsigned>(desc.kv_heads));
    kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(
        query_map(ptr.q, C::kStepRows), key_map(ptr.k, C::kFixedRows), key_map(ptr.v, C::kFixedRows),
        query_map(ptr.dout, C::kStepRows), params);
    SG_CUDA_CHECK(cudaGetLastError());
  }
  {
    using C = DqConfig<D>;
    auto* kernel = attention_dq_wgmma_kernel<T, D>;
    SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
    const dim3 grid(static_cast<unsigned>(tile::attention_tile_bound(desc.tokens, desc.sequences, C::kFixedRows)),
                    static_cast<unsigned>(desc.heads));
    kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(
        query_map(ptr.q, C::kFixedRows), key_map(ptr.k, C::kStepRows), key_map(ptr.v, C::kStepRows),
        query_map(ptr.dout, C::kFixedRows), params);
    SG_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace

void backward_wgmma(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream) {
  const float scale = desc.softmax_scale();
  const BackwardParams params{p.lse,
                              p.delta,
                              p.cu_seqlens,
                              p.dq,
                              p.dk,
                              p.dv,
                              static_cast<int>(desc.tokens),
                              static_cast<int>(desc.sequences),
                              static_cast<int>(desc.heads),
                              static_cast<int>(desc.kv_heads),
                              desc.causal,
                              scale,
                              scale * kLog2e};
  const bool bf16 = desc.dtype == DType::kBFloat16;
  SG_CHECK(bf16 || desc.dtype == DType::kFloat16, "attention: the tensor-core backward takes bf16 or fp16");
  SG_CHECK(desc.head_dim == 64 || desc.head_dim == 128, "attention: the tensor-core backward takes head_dim 64 or 128");
  if (desc.head_dim == 64) {
    bf16 ? launch<__nv_bfloat16, 64>(desc, p, params, stream) : launch<__half, 64>(desc, p, params, stream);
  } else {
    bf16 ? launch<__nv_bfloat16, 128>(desc, p, params, stream) : launch<__half, 128>(desc, p, params, stream);
  }
}

}  // namespace stepgraph::kernels::attention_detail
