// The tensor-core attention forward (bf16/fp16, head_dim 64 and 128) on
// Hopper: TMA, wgmma and warp specialisation (FlashAttention-3's design).
//
// Note [Attention forward on wgmma]
// A block owns kBM = 128 query rows of one sequence and one head, and has
// three warpgroups:
//  - warpgroup 0, the producer (registers cut to 24): one thread loads the
//    block's Q tile, then the K and V tiles of kBN = 128 keys (only up to the
//    block's last row when causal), each into its own two-stage ring: K and
//    V of a stage have separate barriers, so S = Q K^T starts before V lands;
//  - warpgroups 1 and 2, the consumers (registers raised to 240), 64 query
//    rows each: S = Q K^T (wgmma, both operands in shared memory, K-major),
//    the masks (only on tiles that cross the diagonal or the sequence's end),
//    the online softmax in base 2, then O += P V with P rounded to 16 bits
//    straight from the S accumulators into wgmma's register A operand and V
//    read N-major (the transpose bit).
// Softmax overlaps the tensor cores within a warpgroup: the loop issues
// S_n = Q K_n^T and then O += P_{n-1} V_{n-1}, waits for S_n only, runs its
// softmax while the P V product is in flight, and rescales O after that
// product lands.
// TMA boxes ignore sequence boundaries: rows past a sequence's end are the
// next sequence's (or zero past T). Those keys are masked, those query rows
// are never stored. Blocks run in reverse tile order so that a causal
// sequence's long tiles (its last rows see the most keys) start first.
// Segment attention (Note [Segment attention] in kernels/attention.h) is the
// same kernel given the table: the tiles are the segments' (q_offsets read as
// cu_seqlens), and a block's keys are its segment's range [k_begin, k_end)
// of the Tk rows of K and V, loaded from k_begin in steps of kBN. Causal is
// bottom-right aligned: row r sees keys up to r + shift, shift = k_end - the
// segment's query end (0 for self-attention), so the key loop stops at the
// last key the tile's last row sees, and the masks apply where a tile
// crosses that diagonal or k_end. A tile whose rows see no key loads
// nothing and stores out 0 and lse -inf, as does a row that sees none.
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
#include "kernels/tile/attention_launch.cuh"
#include "kernels/tile/attention_tile.cuh"
#include "kernels/tile/wgmma_ops.cuh"
#include "kernels/tile/wgmma_pipeline.cuh"

namespace stepgraph::kernels::attention_detail {
namespace {

struct ForwardParams {
  const std::int32_t* cu_seqlens;  // segment attention: q_offsets
  const std::int32_t* kv_ranges;   // segment attention: [G, 2]; null: self-attention
  void* out;
  float* lse;
  int tokens, sequences, heads, kv_heads;
  int kv_tokens;  // the rows of k and v (self-attention: tokens)
  bool causal;
  float scale_log2;  // scale * log2(e)
};

template <int D>
struct ForwardConfig {
  static constexpr int kBM = 128;  // query rows per block, 64 per consumer warpgroup
  static constexpr int kBN = 128;  // keys per step
  static constexpr int kThreads = 384;
  static constexpr int kStages = 2;
  static constexpr int kColumnBlocks = D / 64;  // 128-byte swizzle atoms along D
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kKVBytes = kBN * D * 2;  // one K or V stage
  static constexpr int kPipelineBytes = kQBytes + 2 * kStages * kKVBytes;
  static constexpr int kBarriers = 1 + 4 * kStages;
  static constexpr int kSmemBytes = 1024 + kPipelineBytes + kBarriers * 8;  // + the 1024-byte alignment slack
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(tile::register_split_fits(kProducerRegisters, kConsumerRegisters));
  static constexpr int kReaderWarps = 8;  // a stage is released by every consumer warp
};

// kSegments: segment attention (p.kv_ranges set), else self-attention; two
// instantiations, so that self-attention's code is the plain sequence case:
// keys its own sequence, shift 0, at least one key tile.
template <typename T, int D, bool kSegments>
__global__ void __launch_bounds__(ForwardConfig<D>::kThreads, 1)
    attention_forward_wgmma_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                                   const __grid_constant__ CUtensorMap map_v, ForwardParams p) {
  using C = ForwardConfig<D>;
  using M = tile::Half16<T>;
  using SGemm = tile::Wgmma<T, C::kBN>;  // S = Q K^T: 64 x kBN per warpgroup
  using OGemm = tile::Wgmma<T, D>;       // O += P V: 64 x D per warpgroup
  constexpr int kBM = C::kBM;
  constexpr int kBN = C::kBN;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t{1023});
  unsigned char* sq = smem;
  auto sk = [&](int stage) { return smem + C::kQBytes + stage * C::kKVBytes; };
  auto sv = [&](int stage) { return smem + C::kQBytes + (C::kStages + stage) * C::kKVBytes; };
  auto* q_full = reinterpret_cast<std::uint64_t*>(smem + C::kPipelineBytes);
  std::uint64_t* k_full = q_full + 1;
  std::uint64_t* k_empty = k_full + C::kStages;
  std::uint64_t* v_full = k_empty + C::kStages;
  std::uint64_t* v_empty = v_full + C::kStages;

  if (threadIdx.x == 0) {
    tile::prefetch_tensor_map(&map_q);
    tile::prefetch_tensor_map(&map_k);
    tile::prefetch_tensor_map(&map_v);
    tile::mbarrier_init(q_full, 1);
    for (int s = 0; s < C::kStages; ++s) {
      tile::mbarrier_init(&k_full[s], 1);
      tile::mbarrier_init(&v_full[s], 1);
      tile::mbarrier_init(&k_empty[s], C::kReaderWarps);
      tile::mbarrier_init(&v_empty[s], C::kReaderWarps);
    }
    tile::fence_barrier_init();
  }
  tile::SequenceTile seq;
  const int target = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  // Ends with a barrier, which also publishes the initialised mbarriers.
  if (!tile::block_locate_tile(p.cu_seqlens, p.sequences, p.tokens, kBM, target, &seq)) return;
  const int h = static_cast<int>(blockIdx.y);
  const int g = h / (p.heads / p.kv_heads);
  const int m0 = seq.first;
  const tile::KeyRange keys = kSegments ? tile::segment_keys(p.kv_ranges, p.kv_tokens, seq.index, seq.end)
                                         : tile::KeyRange{seq.begin, seq.end, 0};
  const int shift = kSegments ? keys.shift : 0;  // self-attention: 0 at compile time
  // Up to the last key the tile's last row sees; none when no row sees a key (segments only).
  const int kv_end = p.causal ? min(keys.end, min(seq.end, m0 + kBM) + shift) : keys.end;
  const int kv_tiles = !kSegments || kv_end > keys.begin ? (kv_end - keys.begin + kBN - 1) / kBN : 0;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warpgroup = warp / 4;

  if (warpgroup == 0) {
    tile::setmaxnreg_dec<C::kProducerRegisters>();
    if (threadIdx.x == 0 && (!kSegments || kv_tiles > 0)) {
      tile::mbarrier_arrive_expect_tx(q_full, C::kQBytes);
      for (int c = 0; c < C::kColumnBlocks; ++c) {
        tile::tma_load_2d(sq + c * kBM * 128, &map_q, q_full, h * D + c * 64, m0);
      }
      for (int n = 0; n < kv_tiles; ++n) {
        const int stage = n % C::kStages;
        const int row = keys.begin + n * kBN;
        tile::ring_wait_empty<C::kStages>(k_empty, n);
        tile::mbarrier_arrive_expect_tx(&k_full[stage], C::kKVBytes);
        for (int c = 0; c < C::kColumnBlocks; ++c) {
          tile::tma_load_2d(sk(stage) + c * kBN * 128, &map_k, &k_full[stage], g * D + c * 64, row);
        }
        tile::ring_wait_empty<C::kStages>(v_empty, n);
        tile::mbarrier_arrive_expect_tx(&v_full[stage], C::kKVBytes);
        for (int c = 0; c < C::kColumnBlocks; ++c) {
          tile::tma_load_2d(sv(stage) + c * kBN * 128, &map_v, &v_full[stage], g * D + c * 64, row);
        }
      }
    }
    return;
  }

  tile::setmaxnreg_inc<C::kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp_row = consumer * 64 + (warp % 4) * 16;  // this warp's first row in the tile
  const int row_lo = m0 + warp_row + lane / 4;            // this thread's rows: row_lo, row_lo + 8
  // Descriptor offsets (16-byte units): a column block of Q or K/V, a k16 step inside one.
  constexpr std::uint64_t kQBlock = kBM * 128 / 16;
  constexpr std::uint64_t kKVBlock = kBN * 128 / 16;
  const std::uint64_t q_desc = tile::wgmma_descriptor(sq) + consumer * (64 * 128 / 16);

  float o[D / 2];
#pragma unroll
  for (int j = 0; j < D / 2; ++j) o[j] = 0.0f;
  float s[kBN / 2];
  std::uint32_t pa[kBN / 16][4];          // P of the previous tile, wgmma's A operand
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 units (scores * scale * log2 e)
  float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only

  auto issue_s = [&](int n) {
    const int stage = n % C::kStages;
    tile::ring_wait_full<C::kStages>(k_full, n);
    tile::fence_accumulators(s);
    tile::wgmma_fence();
    const std::uint64_t k_desc = tile::wgmma_descriptor(sk(stage));
    SGemm::template ss_overwrite<false>(s, q_desc, k_desc);
#pragma unroll
    for (int ks = 1; ks < D / 16; ++ks) {
      const std::uint64_t step = 2 * (ks % 4);  // k16 slices are 32 bytes apart in a 128-byte row
      SGemm::template ss<false>(s, q_desc + (ks / 4) * kQBlock + step, k_desc + (ks / 4) * kKVBlock + step, 1);
    }
    tile::wgmma_commit();
  };
  auto issue_pv = [&](int n) {
    const int stage = n % C::kStages;
    tile::ring_wait_full<C::kStages>(v_full, n);
    tile::fence_accumulators(o);
    tile::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      // V is N-major: k16 steps are 16 rows of 128 bytes apart, column blocks kKVBytes / blocks apart.
      OGemm::template rs<true>(o, pa[kk], tile::wgmma_descriptor_mn_major(sv(stage) + kk * 16 * 128, kBN * 128), 1);
    }
    tile::wgmma_commit();
  };
  auto release = [&](std::uint64_t* empty, int n) { tile::ring_release<C::kStages>(empty, n); };
  // Masks and the online softmax of tile n in s (exponentials in place);
  // returns the factors the earlier O must be rescaled by.
  auto softmax = [&](int n, float (&alpha)[2]) {
    const int n0 = keys.begin + n * kBN;
    if (n0 + kBN > keys.end || (p.causal && n0 + kBN - 1 > m0 + warp_row + shift)) {
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1);
          const int row = row_lo + (e >> 1) * 8;
          if (col >= keys.end || (p.causal && col > row + shift)) s[4 * j + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float new_max = fmaxf(row_max[r], mx * p.scale_log2);
      // A row with no key yet keeps max -inf: subtract 0, not -inf (no NaN).
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      alpha[r] = tile::fast_exp2(row_max[r] - base);
      row_max[r] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        float& s0 = s[4 * j + 2 * r];
        float& s1 = s[4 * j + 2 * r + 1];
        s0 = tile::fast_exp2(fmaf(s0, p.scale_log2, -base));
        s1 = tile::fast_exp2(fmaf(s1, p.scale_log2, -base));
        sum += s0 + s1;
      }
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  };
  auto s_to_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) tile::accumulators_to_a<T>(pa[kk], s, kk);
  };

  // A tile whose rows see no key (segment attention) loads nothing and stores out 0, lse -inf.
  if (!kSegments || kv_tiles > 0) {
    tile::mbarrier_wait(q_full, 0);
    float alpha[2];
    issue_s(0);
    tile::wgmma_wait<0>();
    tile::fence_accumulators(s);
    release(k_empty, 0);
    softmax(0, alpha);  // O is still zero: nothing to rescale
    s_to_p();
    for (int n = 1; n < kv_tiles; ++n) {
      issue_s(n);
      issue_pv(n - 1);
      tile::wgmma_wait<1>();  // S_n has landed; P_{n-1} V_{n-1} may be in flight
      tile::fence_accumulators(s);
      release(k_empty, n);
      softmax(n, alpha);
      tile::wgmma_wait<0>();
      tile::fence_accumulators(o);
      tile::fence_registers(pa);  // the product read pa until here
      release(v_empty, n - 1);
      rescale_o(alpha);
      s_to_p();
    }
    issue_pv(kv_tiles - 1);
    tile::wgmma_wait<0>();
    tile::fence_accumulators(o);
    tile::fence_registers(pa);
    release(v_empty, kv_tiles - 1);
  }

  T* out = static_cast<T*>(p.out);
  const std::int64_t q_ld = static_cast<std::int64_t>(p.heads) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row_lo + r * 8;
    if (row >= seq.end) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* dst = out + row * q_ld + h * D + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<std::uint32_t*>(dst + j * 8) = M::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
    if ((lane & 3) == 0) {
      p.lse[static_cast<std::int64_t>(h) * p.tokens + row] =
          sum > 0.0f ? row_max[r] * 0.69314718055994530942f + logf(sum) : -INFINITY;
    }
  }
}

template <typename T, int D>
void launch(const AttentionDesc& desc, std::int64_t kv_tokens, const AttentionPointers& ptr,
            const ForwardParams& params, CUstream_st* stream) {
  using C = ForwardConfig<D>;
  const tile::QkvMaps maps = tile::qkv_maps<C, D>(desc, kv_tokens, ptr.q, ptr.k, ptr.v);
  // A block per tile of kBM query rows and per query head.
  if (params.kv_ranges != nullptr) {
    tile::launch_over_tiles<C>(attention_forward_wgmma_kernel<T, D, true>, desc, C::kBM, desc.heads, stream, maps.q,
                               maps.k, maps.v, params);
  } else {
    tile::launch_over_tiles<C>(attention_forward_wgmma_kernel<T, D, false>, desc, C::kBM, desc.heads, stream, maps.q,
                               maps.k, maps.v, params);
  }
}

}  // namespace

void forward_wgmma(const AttentionDesc& desc, std::int64_t kv_tokens, const AttentionPointers& p, CUstream_st* stream) {
  const ForwardParams params{p.cu_seqlens,
                             p.kv_ranges,
                             p.out_mut,
                             p.lse_mut,
                             static_cast<int>(desc.tokens),
                             static_cast<int>(desc.sequences),
                             static_cast<int>(desc.heads),
                             static_cast<int>(desc.kv_heads),
                             static_cast<int>(kv_tokens),
                             desc.causal,
                             desc.softmax_scale() * 1.4426950408889634f};
  tile::dispatch_tensor_core_shape(desc.dtype, desc.head_dim, "forward",
                                   [&]<typename T, int D>() { launch<T, D>(desc, kv_tokens, p, params, stream); });
}

}  // namespace stepgraph::kernels::attention_detail
