// The tensor-core attention backward (bf16/fp16, head_dim 64 and 128) on
// Hopper, in one pass: TMA + wgmma with a producer warpgroup and two consumer
// warpgroups, as the forward (Note [Attention forward on wgmma]).
//
// Note [Attention backward in one pass, deterministic]
// After the delta kernel (delta = rowsum(dout * out), attention_simple.cu),
// one kernel computes dK, dV and dQ. A block owns kBN = 128 keys of one kv
// head (64 per consumer warpgroup, K and V loaded once) and walks the query
// heads of its group and, per head, the query tiles (kBM = 64) that see its
// keys, with Q, dO and the tile's lse and delta in a two-stage ring. Keys run
// along wgmma's M: S^T = K Q^T and dP^T = V dO^T (both operands in shared
// memory), P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta); then
// dV += P^T dO and dK += dS^T Q take P^T and dS^T as register A operands
// straight from the accumulators (rounded to 16 bits), dO and Q read
// N-major. dS^T also goes to shared memory, where both warpgroups' halves
// form the tile's dS for dQ_tile = dS K (warpgroup w takes dQ's 64 columns
// from 64 w; A read M-major).
// dQ_tile is summed over the key blocks in global fp32 memory (dq_accum,
// [T, H, D]) in a fixed order, so the bits are the same on every launch
// (eager == graph replay) without a second pass over S: a semaphore per
// (query head, tile) counts the key blocks that have added, and a block
// waits for its turn, adds (TMA reduce onto dq_accum, zeroed before the
// kernel) and counts itself. The order is
// the last key block that sees the tile first, down to key block 0: a block
// walks its query tiles upwards, so the block above it in the sequence
// reached each shared tile two steps earlier (causal) and nobody waits in
// the steady state. Blocks start in reverse tile order, so a block only ever
// waits on blocks with lower linear indices, started before it: no deadlock
// whatever the grid's size.
// A last kernel writes dq = scale * dq_accum in q's dtype.
// Segment attention (Note [Segment attention] in kernels/attention.h) runs
// the same kernel given the table. Segments' ranges may overlap (a
// context-parallel rank's two pieces of one sequence both read its first
// keys), so a block owns a tile of kBN keys of the Tk kv tokens (not of a
// segment) and walks the segments whose ranges meet its keys, in segment
// order, with their query tiles (kBM rows from the segment's first query)
// that see any of its keys (bottom-right causal: row r sees keys up to
// r + shift, shift = k_end - the segment's query end); keys outside the
// segment's range are masked, and rows that see no key get lse = +inf (P =
// 0). dK and dV sum in registers over all of a block's steps (segment order)
// and are stored once: keys no segment reads get zeros. Each query row lies
// in one segment, so dQ keeps the scheme above with semaphores per (query
// head, segment's tile): the key tiles that read a tile are consecutive
// (from the one holding k_begin to the one holding the last key its last row
// sees), and a tile's order is (the highest of them) - (this block's). The
// highest adds first and each block waits only on key tiles above its own;
// a block's dependence chain goes strictly up the key tiles of its kv head,
// to blocks of lower linear index, started before it (or finished): no
// cycle, no deadlock, whatever the table. Two instantiations keep the table
// walk out of self-attention's code. The table walk lives in the producer
// warpgroup (the loads, the lse/delta warp and the dQ writer each walk it,
// 32 segments at a time); the consumers read each step's query tile and key
// range from its stage and stop at the producer's end mark.
// TMA boxes ignore sequence boundaries (rows past a sequence's end are the
// next sequence's, or zero past T): a query row there gets lse = +inf (so
// P = 0) and delta = 0, so its dQ row is zero and the reduce that covers it
// adds zeros to the next sequence's rows (x + 0 = x, bit for bit; rows past
// T are dropped); key rows there are masked out of dQ and never stored.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/attention_paths.h"
#include "kernels/tensor_map.h"
#include "kernels/tile/attention_launch.cuh"
#include "kernels/tile/attention_tile.cuh"
#include "kernels/tile/wgmma_ops.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::attention_detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct BackwardParams {
  const float* lse;
  const float* delta;
  const std::int32_t* cu_seqlens;  // segment attention: q_offsets
  const std::int32_t* kv_ranges;   // segment attention: [G, 2]; null: self-attention
  float* dq_accum;                 // [T, H, D]
  int* dq_semaphores;              // [H, T], zero at launch
  void* dk;
  void* dv;
  int tokens, sequences, heads, kv_heads;
  int kv_tokens;  // the rows of k and v (self-attention: tokens)
  bool causal;
  float scale;
  float scale_log2;
};

template <int D>
struct BackwardConfig {
  static constexpr int kBN = 128;  // keys per block, 64 per consumer warpgroup
  static constexpr int kBM = 64;   // queries per step
  static constexpr int kThreads = 384;
  static constexpr int kStages = 2;
  static constexpr int kKeyBytes = kBN * D * 2;    // K or V
  static constexpr int kQueryBytes = kBM * D * 2;  // Q or dO, one stage
  static constexpr int kDsBytes = kBN * kBM * 2;   // dS^T, [128 keys][64 queries]
  // fp32 dQ tiles handed to the writer warp: D / 32 boxes of [64 rows][32
  // floats], 128-byte rows swizzled, as the writer's TMA reduce reads them.
  static constexpr int kDqBuffers = 2;
  static constexpr int kDqBoxBytes = kBM * 128;
  static constexpr int kDqBytes = kBM * D * 4;
  static constexpr int kPipelineBytes =
      2 * kKeyBytes + 2 * kStages * kQueryBytes + kDsBytes + kDqBuffers * kDqBytes;
  static constexpr int kVectorBytes = kStages * 2 * kBM * 4;  // lse and delta per stage
  static constexpr int kBarriers = 1 + 2 * kStages + 2 * kDqBuffers;
  static constexpr int kStepBytes = kStages * 4 * 4;  // a Step's q0, k_begin, k_end, shift per stage
  static constexpr int kSmemBytes = 1024 + kPipelineBytes + kVectorBytes + kBarriers * 8 + kStepBytes;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(tile::register_split_fits(kProducerRegisters, kConsumerRegisters));
  static constexpr int kConsumerThreads = 256;
  // Descriptor units (16 bytes) between the 64-column blocks of a tile.
  static constexpr std::uint64_t kKeyBlock = kBN * 128 / 16;
  static constexpr std::uint64_t kQueryBlock = kBM * 128 / 16;
};

// The shared-memory layout: K, V, the step ring (Q, dO per stage), dS^T, the
// dQ buffers, the step vectors (lse, delta), the barriers.
template <typename C>
struct BackwardSmem {
  unsigned char* base;
  __device__ explicit BackwardSmem(unsigned char* raw)
      : base(reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(raw) + 1023) &
                                              ~std::uintptr_t{1023})) {}
  __device__ unsigned char* k() const { return base; }
  __device__ unsigned char* v() const { return base + C::kKeyBytes; }
  __device__ unsigned char* q(int stage) const { return base + 2 * C::kKeyBytes + 2 * stage * C::kQueryBytes; }
  __device__ unsigned char* dout(int stage) const { return q(stage) + C::kQueryBytes; }
  __device__ unsigned char* ds() const { return base + 2 * C::kKeyBytes + 2 * C::kStages * C::kQueryBytes; }
  __device__ unsigned char* dq(int buffer) const { return ds() + C::kDsBytes + buffer * C::kDqBytes; }
  __device__ float* vectors(int stage) const {
    return reinterpret_cast<float*>(base + C::kPipelineBytes) + stage * 2 * C::kBM;
  }
  __device__ std::uint64_t* kv_full() const {
    return reinterpret_cast<std::uint64_t*>(base + C::kPipelineBytes + C::kVectorBytes);
  }
  __device__ std::uint64_t* full() const { return kv_full() + 1; }
  __device__ std::uint64_t* empty() const { return full() + C::kStages; }
  __device__ std::uint64_t* dq_full() const { return empty() + C::kStages; }
  __device__ std::uint64_t* dq_empty() const { return dq_full() + C::kDqBuffers; }
  __device__ int* step(int stage) const { return reinterpret_cast<int*>(dq_empty() + C::kDqBuffers) + 4 * stage; }
};

// The keys a block owns: [n0, n0 + kBN), numbered in tiles of kBN from
// `base`, stored up to `end`. Self-attention: a tile of a sequence's keys
// (base: the sequence's start, end: its end). Segment attention: a tile of
// the kv tokens (base 0, end Tk), read by any segment whose range meets it.
struct BlockKeys {
  int n0 = 0;
  int base = 0;
  int end = 0;
};

// Calls steps(q_begin, q_end, k_begin, k_end) for each segment, in order,
// that reads any of the keys [blk.n0, blk.n0 + kBN): a nonempty segment whose
// range meets them (bottom-right causal: its last query sees its whole
// range). The table is read as the plain kernels read it (safe q_offsets,
// clamped ranges), 32 segments at a time. Called by all 32 lanes of a warp.
template <int kBN, typename Steps>
__device__ __forceinline__ void walk_segments(const BackwardParams& p, const BlockKeys& blk, Steps&& steps) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  int carry = 0;
  for (int s0 = 0; s0 < p.sequences; s0 += 32) {
    int q_begin = 0;
    int q_end = 0;
    warp_safe_ranges(p.cu_seqlens, p.sequences, p.tokens, s0, &carry, &q_begin, &q_end);
    tile::KeyRange keys;
    if (s0 + lane < p.sequences) keys = tile::segment_keys(p.kv_ranges, p.kv_tokens, s0 + lane, q_end);
    unsigned readers =
        __ballot_sync(0xffffffffu, q_begin < q_end && max(keys.begin, blk.n0) < min(keys.end, blk.n0 + kBN));
    while (readers != 0) {
      const int src = __ffs(readers) - 1;
      readers &= readers - 1;
      steps(__shfl_sync(0xffffffffu, q_begin, src), __shfl_sync(0xffffffffu, q_end, src),
            __shfl_sync(0xffffffffu, keys.begin, src), __shfl_sync(0xffffffffu, keys.end, src));
    }
  }
}

// One step of a block: query tile [q0, q0 + kBM) of head h, in a segment of
// queries ending at q_end that reads keys [k_begin, k_end) (causal: row r sees
// keys <= r + shift), and the tile's place in dQ's order of adds.
struct Step {
  int h, q0, q_end, k_begin, k_end, shift, order;
};

// The steps of a block in order: per segment whose keys meet the block's
// (in segment order; self-attention: the block's sequence), per query head of
// kv head g's group, the segment's query tiles (of kBM rows from its first
// query) that see any of the block's keys. A tile's order is (the highest key
// tile that reads it) - (this block's key tile): the readers of a tile are
// consecutive key tiles, and the highest adds first (Note [Attention backward
// in one pass, deterministic]). Called by all 32 lanes of a warp (segment
// tables are read 32 segments at a time); every lane visits the same steps.
template <bool kSegments, int kBN, int kBM, typename Visit>
__device__ __forceinline__ void for_each_step(const BackwardParams& p, const tile::SequenceTile& seq,
                                              const BlockKeys& blk, int g, Visit&& visit) {
  const int group = p.heads / p.kv_heads;
  const int key_tile = (blk.n0 - blk.base) / kBN;
  auto segment_steps = [&](int q_begin, int q_end, int k_begin, int k_end) {
    const int shift = k_end - q_end;
    const int first_row = p.causal ? max(q_begin, max(blk.n0, k_begin) - shift) : q_begin;
    const int first_tile = q_begin + (first_row - q_begin) / kBM * kBM;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      for (int q0 = first_tile; q0 < q_end; q0 += kBM) {
        int last_key = k_end - 1;
        if constexpr (kSegments) {
          if (p.causal) last_key = min(k_end, min(q0 + kBM, q_end) + shift) - 1;
        } else {
          if (p.causal) last_key = q0;  // in the key tile of the tile's last row (q0 - base is a multiple of kBM)
        }
        visit(Step{h, q0, q_end, k_begin, k_end, shift, (last_key - blk.base) / kBN - key_tile});
      }
    }
  };
  if constexpr (kSegments) {
    walk_segments<kBN>(p, blk, segment_steps);
  } else {
    segment_steps(seq.begin, seq.end, seq.begin, seq.end);
  }
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
  Gemm::template ss_overwrite<false>(acc, a_desc, b_desc);
#pragma unroll
  for (int ks = 1; ks < D / 16; ++ks) {
    const std::uint64_t step = 2 * (ks % 4);  // k16 slices are 32 bytes apart in a 128-byte row
    Gemm::template ss<false>(acc, a_desc + (ks / 4) * a_block + step, b_desc + (ks / 4) * b_block + step, 1);
  }
}

// acc += A B with A the register operand (16-bit, k16 steps over kRows rows
// of B) and B N-major in shared memory (kRows rows, column blocks of 64).
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

// The value of x, opaque to the compiler: keeps addresses that do not change
// over the step loop from being hoisted out of it and held in registers.
__device__ __forceinline__ std::uint32_t opaque32(std::uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}
__device__ __forceinline__ std::uint64_t opaque(std::uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}

__device__ __forceinline__ void store_shared(std::uint32_t address, std::uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(value) : "memory");
}

// The two consumer warpgroups (threads 128-383), named barrier 1.
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

__device__ __forceinline__ int load_acquire(const int* address) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// Orders this thread's generic global accesses (the semaphore's acquire) and
// the bulk copies (the async proxy) around each other.
__device__ __forceinline__ void fence_global_for_async() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Adds the box of `map` at (inner, outer) to global memory from shared memory
// (fp32, a TMA reduce; out-of-bounds rows are dropped).
__device__ __forceinline__ void tma_reduce_add_2d(const CUtensorMap* map, const void* src, int inner, int outer) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(map),
      "r"(tile::smem_address(src)), "r"(inner), "r"(outer)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until all but the newest kPending committed groups have read their shared-memory sources.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Until all but the newest kPending committed groups have completed.
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Publishes the completed adds of a tile, then its semaphore's next value.
__device__ __forceinline__ void pass_turn(int* semaphore, int value) {
  fence_global_for_async();
  __threadfence();
  atomicExch(semaphore, value);
}

__device__ __forceinline__ void store_shared_f32x2(std::uint32_t address, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(x), "f"(y) : "memory");
}

// Generic-proxy writes to shared memory made visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// kSegments: segment attention (p.kv_ranges set), else self-attention; two
// instantiations so that self-attention's code carries nothing of the table walk.
template <typename T, int D, bool kSegments>
__global__ void __launch_bounds__(BackwardConfig<D>::kThreads, 1)
    attention_backward_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                                    const __grid_constant__ CUtensorMap map_v,
                                    const __grid_constant__ CUtensorMap map_do,
                                    const __grid_constant__ CUtensorMap map_dq, BackwardParams p) {
  using C = BackwardConfig<D>;
  using SGemm = tile::Wgmma<T, C::kBM>;  // S^T, dP^T: 64 keys x 64 queries; dQ: 64 queries x 64 columns
  using DGemm = tile::Wgmma<T, D>;       // dK, dV: 64 keys x D
  constexpr int kBN = C::kBN;
  constexpr int kBM = C::kBM;
  extern __shared__ unsigned char smem_raw[];
  const BackwardSmem<C> sm(smem_raw);
  if (threadIdx.x == 0) {
    tile::prefetch_tensor_map(&map_q);
    tile::prefetch_tensor_map(&map_do);
    tile::mbarrier_init(sm.kv_full(), 1);
    // Every consumer thread arrives on a release: each has read shared memory the next use rewrites
    // (racecheck does not follow a per-warp release after __syncwarp).
    for (int s = 0; s < C::kStages; ++s) {
      tile::mbarrier_init(&sm.full()[s], 1 + 32);  // the TMA thread, and a warp storing lse and delta
      tile::mbarrier_init(&sm.empty()[s], C::kConsumerThreads);
    }
    for (int b = 0; b < C::kDqBuffers; ++b) {
      tile::mbarrier_init(&sm.dq_full()[b], C::kConsumerThreads);
      tile::mbarrier_init(&sm.dq_empty()[b], 1);  // the writer
    }
    tile::fence_barrier_init();
  }

  // Reverse tile order: a sequence's later key tiles start first (dQ's order needs it).
  const int target = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  tile::SequenceTile seq;
  BlockKeys blk;
  if constexpr (!kSegments) {
    // Ends with a barrier, which also publishes the initialised mbarriers.
    if (!tile::block_locate_tile(p.cu_seqlens, p.sequences, p.tokens, kBN, target, &seq)) return;
    blk = {seq.first, seq.begin, seq.end};
  } else {
    __syncthreads();  // publishes the initialised mbarriers
    blk = {target * kBN, 0, p.kv_tokens};
  }
  const int g = static_cast<int>(blockIdx.y);
  const int n0 = blk.n0;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warpgroup = warp / 4;

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    // Warps 0, 1 and 2 each walk the block's steps; with segments the
    // consumers read each step from its stage (written by the producer) and
    // stop at q0 = -1, in self-attention they walk the steps themselves.
    if (warp == 0) {
      // The loads: K and V once, then Q and dO of each step (lane 0).
      if (lane == 0) {
        tile::mbarrier_arrive_expect_tx(sm.kv_full(), 2 * C::kKeyBytes);
        load_rows<D>(sm.k(), &map_k, sm.kv_full(), g * D, n0, kBN);
        load_rows<D>(sm.v(), &map_v, sm.kv_full(), g * D, n0, kBN);
      }
      int t = 0;
      for_each_step<kSegments, kBN, kBM>(p, seq, blk, g, [&](const Step& step) {
        if (lane == 0) {
          const int stage = t % C::kStages;
          tile::ring_wait_empty<C::kStages>(sm.empty(), t);
          if constexpr (kSegments) {
            int* info = sm.step(stage);
            info[0] = step.q0;
            info[1] = step.k_begin;
            info[2] = step.k_end;
            info[3] = step.shift;
          }
          tile::mbarrier_arrive_expect_tx(&sm.full()[stage], 2 * C::kQueryBytes);
          load_rows<D>(sm.q(stage), &map_q, &sm.full()[stage], step.h * D, step.q0, kBM);
          load_rows<D>(sm.dout(stage), &map_do, &sm.full()[stage], step.h * D, step.q0, kBM);
        }
        ++t;
      });
      if (kSegments && lane == 0) {
        tile::ring_wait_empty<C::kStages>(sm.empty(), t);
        sm.step(t % C::kStages)[0] = -1;
        tile::mbarrier_arrive(&sm.full()[t % C::kStages]);
      }
    } else if (warp == 1) {
      // lse (base 2) and delta of the step's queries; +inf and 0 past the
      // segment and where a query sees no key (lse -inf): P = 0 there.
      int t = 0;
      for_each_step<kSegments, kBN, kBM>(p, seq, blk, g, [&](const Step& step) {
        const int stage = t % C::kStages;
        tile::ring_wait_empty<C::kStages>(sm.empty(), t);
        const float* lse = p.lse + static_cast<std::int64_t>(step.h) * p.tokens;
        const float* delta = p.delta + static_cast<std::int64_t>(step.h) * p.tokens;
        float* vectors = sm.vectors(stage);
        for (int i = lane; i < kBM; i += 32) {
          const int row = step.q0 + i;
          const float row_lse = row < step.q_end ? lse[row] : -INFINITY;
          vectors[i] = row_lse != -INFINITY ? row_lse * kLog2e : INFINITY;
          vectors[kBM + i] = row < step.q_end ? delta[row] : 0.0f;
        }
        tile::mbarrier_arrive(&sm.full()[stage]);
        ++t;
      });
      if constexpr (kSegments) {  // the end mark's round
        tile::ring_wait_empty<C::kStages>(sm.empty(), t);
        tile::mbarrier_arrive(&sm.full()[t % C::kStages]);
      }
    } else if (warp == 2) {
      // The dQ writer (lane 0): adds each dQ tile the consumers hand over to
      // dq_accum in its turn (Note [Attention backward in one pass,
      // deterministic]), by TMA reduce; a tile's turn is passed on once its
      // add has completed, while the next tile's add is already in flight.
      int* pending = nullptr;  // the semaphore of the tile in flight, and its next value
      int pending_value = 0;
      int t = 0;
      for_each_step<kSegments, kBN, kBM>(p, seq, blk, g, [&](const Step& step) {
        if (lane == 0) {
          const int buffer = t % C::kDqBuffers;
          tile::ring_wait_full<C::kDqBuffers>(sm.dq_full(), t);
          int* semaphore = p.dq_semaphores + static_cast<std::int64_t>(step.h) * p.tokens + step.q0;
          if (step.order > 0) {
            while (load_acquire(semaphore) < step.order) {
            }
          }
          fence_global_for_async();
#pragma unroll
          for (int box = 0; box < D / 32; ++box) {
            tma_reduce_add_2d(&map_dq, sm.dq(buffer) + box * C::kDqBoxBytes, step.h * D + box * 32, step.q0);
          }
          bulk_commit();
          if (pending != nullptr) {
            bulk_wait_read<1>();
            tile::mbarrier_arrive(&sm.dq_empty()[(t - 1) % C::kDqBuffers]);
            bulk_wait<1>();
            pass_turn(pending, pending_value);
          }
          pending = semaphore;
          pending_value = step.order + 1;
        }
        ++t;
      });
      if (lane == 0 && pending != nullptr) {
        bulk_wait<0>();
        pass_turn(pending, pending_value);
      }
    }
    return;
  }

  tile::setmaxnreg_inc<C::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp_row = consumer * 64 + (warp % 4) * 16;  // this warp's first key in the block
  const int key_lo = n0 + warp_row + lane / 4;           // this thread's keys: key_lo, key_lo + 8
  const std::uint64_t k_desc = tile::wgmma_descriptor(sm.k()) + consumer * (64 * 128 / 16);
  const std::uint64_t v_desc = tile::wgmma_descriptor(sm.v()) + consumer * (64 * 128 / 16);
  // dQ = dS K: A is dS^T in shared memory read M-major (one 64-query block),
  // B this warpgroup's 64 columns of K read N-major.
  const bool computes_dq = D == 128 || consumer == 0;  // D / 64 column blocks, one a warpgroup
  const unsigned char* k_columns = sm.k() + (computes_dq ? consumer : 0) * kBN * 128;
  float dk[D / 2];
  float dv[D / 2];
  zero(dk);
  zero(dv);

  tile::mbarrier_wait(sm.kv_full(), 0);
  // Step t (its stage full): queries from q0, keys [k_begin, k_end) with the diagonal's shift.
  auto consume = [&](int t, int q0, int k_begin, int k_end, int shift) {
    const int stage = t % C::kStages;
    // Per step, so that no value is carried into the next step's products
    // (the wgmma operands read-write their accumulators).
    float s[kBM / 2];
    float dp[kBM / 2];
    float dq[kBM / 2];
    std::uint32_t pa[kBM / 16][4];
    std::uint32_t dsa[kBM / 16][4];
    tile::fence_accumulators(s);
    tile::fence_accumulators(dp);
    tile::wgmma_fence();
    gemm_over_d<SGemm, D>(s, opaque(k_desc), C::kKeyBlock, tile::wgmma_descriptor(sm.q(stage)), C::kQueryBlock);
    gemm_over_d<SGemm, D>(dp, opaque(v_desc), C::kKeyBlock, tile::wgmma_descriptor(sm.dout(stage)), C::kQueryBlock);
    tile::wgmma_commit();
    tile::wgmma_wait<0>();
    tile::fence_accumulators(s);
    tile::fence_accumulators(dp);

    // P^T and dS^T (in place). Causal: query q sees key j when q + shift >= j.
    const float* lse2 = reinterpret_cast<const float*>(opaque(reinterpret_cast<std::uintptr_t>(sm.vectors(stage))));
    const float* delta = lse2 + kBM;
    // Keys outside the segment's range (past a sequence's end: the next sequence's) are masked
    // too: dQ sums over all 128.
    const int warp_key = n0 + warp_row;  // this warp's keys: warp_key .. warp_key + 15
    const bool mask =
        (p.causal && q0 + shift < warp_key + 15) || warp_key + 15 >= k_end || (kSegments && warp_key < k_begin);
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + 2 * (lane & 3) + (e & 1);
        float prob = tile::fast_exp2(fmaf(s[4 * j + e], p.scale_log2, -lse2[col]));
        const int key = key_lo + (e >> 1) * 8;
        if (mask && ((p.causal && q0 + col + shift < key) || key >= k_end || (kSegments && key < k_begin))) {
          prob = 0.0f;
        }
        s[4 * j + e] = prob;
        dp[4 * j + e] = prob * (dp[4 * j + e] - delta[col]);
      }
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) {
      tile::accumulators_to_a<T>(pa[kk], s, kk);
      tile::accumulators_to_a<T>(dsa[kk], dp, kk);
    }
    // dS^T rows of this thread into the [128 keys][64 queries] tile, 128-byte rows swizzled
    // (Note [wgmma operand tiles]), once both warpgroups' dQ products of the last step are done.
    consumers_sync();
    {
      // Row warp_row + lane / 4 (+ 8): its swizzle key is lane / 4.
      const std::uint32_t line = opaque32(tile::smem_address(sm.ds()) + (warp_row + lane / 4) * 128 + (lane & 3) * 4);
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kBM / 8; ++j) {
          store_shared(line + r * 8 * 128 + ((j ^ (lane / 4)) << 4), dsa[j / 2][(j % 2) * 2 + r]);
        }
    }
    fence_shared_for_async();
    consumers_sync();

    // dV += P^T dO, dK += dS^T Q (the queries as k), dQ_tile = dS K.
    tile::fence_accumulators(dv);
    tile::fence_accumulators(dk);
    tile::wgmma_fence();
    gemm_rows<DGemm, kBM>(dv, pa, sm.dout(stage));
    gemm_rows<DGemm, kBM>(dk, dsa, sm.q(stage));
    if (computes_dq) {
      const std::uint64_t ds_desc = opaque(tile::wgmma_descriptor_mn_major(sm.ds(), kBM * 128));
      const std::uint64_t kc_desc = opaque(tile::wgmma_descriptor_mn_major(k_columns, kBN * 128));
      // k16 steps: 16 rows of 128 bytes, 128 descriptor units.
      SGemm::template ss_overwrite<true, true>(dq, ds_desc, kc_desc);
#pragma unroll
      for (int kk = 1; kk < kBN / 16; ++kk) {
        SGemm::template ss<true, true>(dq, ds_desc + kk * 128, kc_desc + kk * 128, 1);
      }
    }
    tile::wgmma_commit();
    tile::wgmma_wait<0>();
    tile::fence_accumulators(dv);
    tile::fence_accumulators(dk);
    tile::fence_accumulators(dq);
    tile::fence_registers(pa);
    tile::fence_registers(dsa);
    tile::mbarrier_arrive(&sm.empty()[stage]);

    // Hand dQ_tile to the writer warp.
    const int buffer = t % C::kDqBuffers;
    tile::ring_wait_empty<C::kDqBuffers>(sm.dq_empty(), t);
    if (computes_dq) {
      // Columns consumer * 64 + 8 j + 2 (lane % 4): box col / 32, 16-byte chunk (col % 32) / 4.
      const int row = (warp % 4) * 16 + lane / 4;  // and row + 8: the same swizzle key
      const std::uint32_t line =
          opaque32(tile::smem_address(sm.dq(buffer)) + 2 * consumer * C::kDqBoxBytes + row * 128 + (lane & 1) * 8);
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < kBM / 8; ++j) {
          const int box = j / 4;
          const int chunk = (2 * j + (lane & 3) / 2) % 8;
          store_shared_f32x2(line + box * C::kDqBoxBytes + r * 8 * 128 + ((chunk ^ (row & 7)) << 4), dq[4 * j + 2 * r],
                             dq[4 * j + 2 * r + 1]);
        }
    }
    fence_shared_for_async();
    tile::mbarrier_arrive(&sm.dq_full()[buffer]);
  };
  if constexpr (kSegments) {
    // The producer writes each step into its stage and ends with q0 = -1.
    for (int t = 0;; ++t) {
      tile::ring_wait_full<C::kStages>(sm.full(), t);
      const int* info = sm.step(t % C::kStages);
      if (info[0] < 0) break;
      consume(t, info[0], info[1], info[2], info[3]);
    }
  } else {
    // Self-attention walks its steps itself: keys from the sequence's start (at or before n0), shift 0.
    int t = 0;
    for_each_step<false, kBN, kBM>(p, seq, blk, g, [&](const Step& step) {
      tile::ring_wait_full<C::kStages>(sm.full(), t);
      consume(t, step.q0, 0, step.k_end, 0);
      ++t;
    });
  }

  const std::int64_t kv_ld = static_cast<std::int64_t>(p.kv_heads) * D;
  store_rows<T, D>(static_cast<T*>(p.dk) + g * D, kv_ld, dk, p.scale, key_lo, blk.end, lane);
  store_rows<T, D>(static_cast<T*>(p.dv) + g * D, kv_ld, dv, 1.0f, key_lo, blk.end, lane);
}

// dq = scale * dq_accum, 4 elements a thread.
template <typename T>
__global__ void attention_dq_store_kernel(const float4* __restrict__ accum, T* __restrict__ dq, std::int64_t count4,
                                          float scale) {
  using M = tile::Half16<T>;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count4;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = accum[i];
    uint2 packed;
    packed.x = M::pack(v.x * scale, v.y * scale);
    packed.y = M::pack(v.z * scale, v.w * scale);
    reinterpret_cast<uint2*>(dq)[i] = packed;
  }
}

template <typename T, int D>
void launch(const AttentionDesc& desc, std::int64_t kv_tokens, const AttentionPointers& ptr,
            const BackwardParams& params, CUstream_st* stream) {
  using C = BackwardConfig<D>;
  const tile::QkvMaps maps = tile::qkv_maps<C, D>(desc, kv_tokens, ptr.q, ptr.k, ptr.v);
  const CUtensorMap map_do = tile::token_major_map<D>(desc.dtype, ptr.dout, desc.heads, desc.tokens, C::kBM);
  // fp32 sums: 32 columns make the 128-byte swizzle atom.
  const CUtensorMap map_dq =
      swizzled_tensor_map<2>(DType::kFloat32, params.dq_accum, {desc.heads * D, desc.tokens}, {32, C::kBM});
  SG_CUDA_CHECK(cudaMemsetAsync(params.dq_semaphores, 0, sizeof(int) * desc.heads * desc.tokens, stream));
  SG_CUDA_CHECK(cudaMemsetAsync(params.dq_accum, 0, sizeof(float) * desc.heads * desc.tokens * D, stream));
  // A block per tile of kBN keys and per KV head: tiles of each sequence
  // (self-attention) or of the kv tokens (segment attention).
  const std::int64_t key_tiles = params.kv_ranges == nullptr
                                     ? tile::attention_tile_bound(desc.tokens, desc.sequences, C::kBN)
                                     : (kv_tokens + C::kBN - 1) / C::kBN;
  const auto kernel = params.kv_ranges == nullptr ? attention_backward_wgmma_kernel<T, D, false>
                                                  : attention_backward_wgmma_kernel<T, D, true>;
  tile::launch_blocks<C>(kernel, key_tiles, desc.kv_heads, stream, maps.q, maps.k, maps.v, map_do, map_dq, params);
  const std::int64_t count4 = desc.tokens * desc.heads * D / 4;
  const int blocks = static_cast<int>(std::min<std::int64_t>((count4 + 255) / 256, 4 * 1024));
  attention_dq_store_kernel<T><<<blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(params.dq_accum),
                                                           static_cast<T*>(ptr.dq), count4, params.scale);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void backward_wgmma(const AttentionDesc& desc, std::int64_t kv_tokens, const AttentionPointers& p,
                    CUstream_st* stream) {
  const float scale = desc.softmax_scale();
  const BackwardParams params{p.lse,
                              p.delta,
                              p.cu_seqlens,
                              p.kv_ranges,
                              p.dq_accum,
                              p.dq_semaphores,
                              p.dk,
                              p.dv,
                              static_cast<int>(desc.tokens),
                              static_cast<int>(desc.sequences),
                              static_cast<int>(desc.heads),
                              static_cast<int>(desc.kv_heads),
                              static_cast<int>(kv_tokens),
                              desc.causal,
                              scale,
                              scale * kLog2e};
  tile::dispatch_tensor_core_shape(desc.dtype, desc.head_dim, "backward",
                                   [&]<typename T, int D>() { launch<T, D>(desc, kv_tokens, p, params, stream); });
}

}  // namespace stepgraph::kernels::attention_detail
