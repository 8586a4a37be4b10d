// The tensor-core attention backward (bf16/fp16, head_dim 64 and 128):
// FlashAttention-2's two-kernel form, deterministic (no atomics).
//
// Note [Attention backward without atomics]
// After the delta kernel (delta = rowsum(dout * out), attention_simple.cu):
//  - dK/dV: a block owns kBN = 64 keys of one kv head (4 warps x 16 keys) and
//    walks the query heads of its group and, per head, the query tiles
//    (kBM = 64) that see its keys, with Q, dO, lse and delta of the next step
//    double-buffered. Everything is computed transposed, keys along the mma's
//    M: S^T = K Q^T, P^T = exp2(S^T - lse), dP^T = V dO^T,
//    dS^T = P^T (dP^T - delta), and then dV += P^T dO and dK += dS^T Q take
//    P^T and dS^T as A operands straight from the accumulators (rounded to 16
//    bits), dO and Q through ldmatrix.trans. No shared-memory round trip of P.
//  - dQ: a block owns kBM = 64 queries of one head (Q fragments in
//    registers) and walks its kv tiles as the forward does: S, P, dP = dO V^T,
//    dS, dQ += dS K (K through ldmatrix.trans).
// Each gradient element is summed by one thread in a fixed order, so the
// bits are the same on every launch (eager == graph replay).
// Rows past a sequence's end are zero-filled; a query row there gets lse =
// +inf (so P = 0) and delta = 0, and nothing is written for it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/attention_paths.h"
#include "kernels/tile/attention_tile.cuh"

namespace stepgraph::kernels::attention_detail {
namespace {

using tile::RowTile;

constexpr float kLog2e = 1.4426950408889634f;

struct BackwardParams {
  const void* q;
  const void* k;
  const void* v;
  const float* lse;
  const void* dout;
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

template <int D>
struct BackwardConfig {
  static constexpr int kBM = 64;  // queries per step (dK/dV) or per block (dQ)
  static constexpr int kBN = 64;  // keys per block (dK/dV) or per step (dQ)
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  using Tile = RowTile<64, D, kThreads>;
  // Two fixed tiles and two double-buffered ones, plus lse/delta stages.
  static constexpr int kSmemBytes = 6 * Tile::kBytes + 4 * kBM * static_cast<int>(sizeof(float));
};

template <typename T, int D>
__device__ __forceinline__ void store_rows(T* base, std::int64_t ld, const float (&acc)[D / 8][4], float factor,
                                           int row_lo, int end, int lane) {
  using M = tile::Half16<T>;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    if (row >= end) continue;
    T* dst = base + row * ld + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      *reinterpret_cast<std::uint32_t*>(dst + j * 8) = M::pack(acc[j][2 * r] * factor, acc[j][2 * r + 1] * factor);
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(BackwardConfig<D>::kThreads) attention_dkdv_mma_kernel(BackwardParams p) {
  using C = BackwardConfig<D>;
  using Tile = typename C::Tile;
  using M = tile::Half16<T>;
  constexpr int kBM = C::kBM;
  constexpr int kBN = C::kBN;
  extern __shared__ __align__(128) unsigned char smem[];

  tile::SequenceTile seq;
  if (!tile::block_locate_tile(p.cu_seqlens, p.sequences, p.tokens, kBN, static_cast<int>(blockIdx.x), &seq)) return;
  const int g = static_cast<int>(blockIdx.y);
  const int group = p.heads / p.kv_heads;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp_row = (static_cast<int>(threadIdx.x) >> 5) * 16;
  const std::int64_t q_ld = static_cast<std::int64_t>(p.heads) * D;
  const std::int64_t kv_ld = static_cast<std::int64_t>(p.kv_heads) * D;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);

  const int n0 = seq.first;
  const std::uint32_t sk = tile::smem_address(smem);
  const std::uint32_t sv = sk + Tile::kBytes;
  auto sq = [&](int stage) { return sk + (2 + 2 * stage) * Tile::kBytes; };
  auto sdo = [&](int stage) { return sq(stage) + Tile::kBytes; };
  float* stats = reinterpret_cast<float*>(smem + 6 * Tile::kBytes);  // [stage][lse kBM | delta kBM]

  Tile::load(sk, static_cast<const T*>(p.k) + n0 * kv_ld + g * D, kv_ld, seq.end - n0);
  Tile::load(sv, static_cast<const T*>(p.v) + n0 * kv_ld + g * D, kv_ld, seq.end - n0);

  // Steps: (query head of the group, query tile that sees these keys).
  const int first_tile = p.causal ? (n0 - seq.begin) / kBM : 0;
  const int q_tiles = (seq.end - seq.begin + kBM - 1) / kBM - first_tile;
  const int steps = group * q_tiles;
  auto load_step = [&](int t, int stage) {
    const int h = g * group + t / q_tiles;
    const int q0 = seq.begin + (first_tile + t % q_tiles) * kBM;
    Tile::load(sq(stage), q + q0 * q_ld + h * D, q_ld, seq.end - q0);
    Tile::load(sdo(stage), dout + q0 * q_ld + h * D, q_ld, seq.end - q0);
    float* st = stats + stage * 2 * kBM;
    for (int i = static_cast<int>(threadIdx.x); i < kBM; i += C::kThreads) {
      const int row = q0 + i;
      const std::int64_t at = static_cast<std::int64_t>(h) * p.tokens + row;
      st[i] = row < seq.end ? p.lse[at] * kLog2e : INFINITY;
      st[kBM + i] = row < seq.end ? p.delta[at] : 0.0f;
    }
  };
  load_step(0, 0);
  tile::cp_async_commit();

  float dk[D / 8][4];
  float dv[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.0f;
  const int key_lo = n0 + warp_row + lane / 4;

  for (int t = 0; t < steps; ++t) {
    if (t + 1 < steps) load_step(t + 1, (t + 1) & 1);
    tile::cp_async_commit();
    tile::cp_async_wait<1>();
    __syncthreads();
    const std::uint32_t qt = sq(t & 1);
    const std::uint32_t dot = sdo(t & 1);
    const float* lse2 = stats + (t & 1) * 2 * kBM;
    const float* delta = lse2 + kBM;
    const int q0 = seq.begin + (first_tile + t % q_tiles) * kBM;

    // S^T = K Q^T and dP^T = V dO^T, keys along M.
    float s[kBM / 8][4];
    float dp[kBM / 8][4];
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      std::uint32_t a[4];
      Tile::load_a(a, sk, warp_row, ks * 16, lane);
#pragma unroll
      for (int jj = 0; jj < kBM / 16; ++jj) {
        std::uint32_t b[2][2];
        Tile::load_b(b, qt, jj * 16, ks * 16, lane);
        M::mma(s[2 * jj], a, b[0][0], b[0][1]);
        M::mma(s[2 * jj + 1], a, b[1][0], b[1][1]);
      }
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      std::uint32_t a[4];
      Tile::load_a(a, sv, warp_row, ks * 16, lane);
#pragma unroll
      for (int jj = 0; jj < kBM / 16; ++jj) {
        std::uint32_t b[2][2];
        Tile::load_b(b, dot, jj * 16, ks * 16, lane);
        M::mma(dp[2 * jj], a, b[0][0], b[0][1]);
        M::mma(dp[2 * jj + 1], a, b[1][0], b[1][1]);
      }
    }

    // P^T and dS^T (in place). Causal: query q sees key j when q >= j.
    const bool mask = p.causal && q0 < n0 + warp_row + 15;
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j * 8 + 2 * (lane & 3) + (e & 1);
        float prob = tile::fast_exp2(fmaf(s[j][e], p.scale_log2, -lse2[col]));
        if (mask && q0 + col < key_lo + (e >> 1) * 8) prob = 0.0f;
        s[j][e] = prob;
        dp[j][e] = prob * (dp[j][e] - delta[col]);
      }

    // dV += P^T dO, dK += dS^T Q (the query steps as k).
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) {
      std::uint32_t ap[4];
      std::uint32_t ads[4];
      tile::accumulators_to_a<T>(ap, s[2 * kk], s[2 * kk + 1]);
      tile::accumulators_to_a<T>(ads, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        std::uint32_t b[2][2];
        Tile::load_b_trans(b, dot, kk * 16, dj * 16, lane);
        M::mma(dv[2 * dj], ap, b[0][0], b[0][1]);
        M::mma(dv[2 * dj + 1], ap, b[1][0], b[1][1]);
        Tile::load_b_trans(b, qt, kk * 16, dj * 16, lane);
        M::mma(dk[2 * dj], ads, b[0][0], b[0][1]);
        M::mma(dk[2 * dj + 1], ads, b[1][0], b[1][1]);
      }
    }
    // The next step's loads overwrite the stage this one read.
    __syncthreads();
  }
  tile::cp_async_wait<0>();

  store_rows<T, D>(static_cast<T*>(p.dk) + g * D, kv_ld, dk, p.scale, key_lo, seq.end, lane);
  store_rows<T, D>(static_cast<T*>(p.dv) + g * D, kv_ld, dv, 1.0f, key_lo, seq.end, lane);
}

template <typename T, int D>
__global__ void __launch_bounds__(BackwardConfig<D>::kThreads) attention_dq_mma_kernel(BackwardParams p) {
  using C = BackwardConfig<D>;
  using Tile = typename C::Tile;
  using M = tile::Half16<T>;
  constexpr int kBM = C::kBM;
  constexpr int kBN = C::kBN;
  extern __shared__ __align__(128) unsigned char smem[];

  tile::SequenceTile seq;
  const int target = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  if (!tile::block_locate_tile(p.cu_seqlens, p.sequences, p.tokens, kBM, target, &seq)) return;
  const int h = static_cast<int>(blockIdx.y);
  const int g = h / (p.heads / p.kv_heads);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp_row = (static_cast<int>(threadIdx.x) >> 5) * 16;
  const std::int64_t q_ld = static_cast<std::int64_t>(p.heads) * D;
  const std::int64_t kv_ld = static_cast<std::int64_t>(p.kv_heads) * D;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const int m0 = seq.first;
  const int kv_end = p.causal ? min(seq.end, m0 + kBM) : seq.end;
  const int kv_tiles = (kv_end - seq.begin + kBN - 1) / kBN;
  const std::uint32_t sq = tile::smem_address(smem);
  const std::uint32_t sdo = sq + Tile::kBytes;
  auto sk = [&](int stage) { return sq + (2 + 2 * stage) * Tile::kBytes; };
  auto sv = [&](int stage) { return sk(stage) + Tile::kBytes; };
  auto load_kv = [&](int n, int stage) {
    const int n0 = seq.begin + n * kBN;
    Tile::load(sk(stage), k + n0 * kv_ld + g * D, kv_ld, seq.end - n0);
    Tile::load(sv(stage), v + n0 * kv_ld + g * D, kv_ld, seq.end - n0);
  };
  Tile::load(sq, static_cast<const T*>(p.q) + m0 * q_ld + h * D, q_ld, seq.end - m0);
  Tile::load(sdo, static_cast<const T*>(p.dout) + m0 * q_ld + h * D, q_ld, seq.end - m0);
  load_kv(0, 0);
  tile::cp_async_commit();

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
  float dq[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[j][e] = 0.0f;
  std::uint32_t qf[D / 16][4];

  for (int n = 0; n < kv_tiles; ++n) {
    if (n + 1 < kv_tiles) load_kv(n + 1, (n + 1) & 1);
    tile::cp_async_commit();
    tile::cp_async_wait<1>();
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) Tile::load_a(qf[ks], sq, warp_row, ks * 16, lane);
    }
    const std::uint32_t kt = sk(n & 1);
    const std::uint32_t vt = sv(n & 1);
    float s[kBN / 8][4];
    float dp[kBN / 8][4];
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      std::uint32_t ado[4];
      Tile::load_a(ado, sdo, warp_row, ks * 16, lane);
#pragma unroll
      for (int jj = 0; jj < kBN / 16; ++jj) {
        std::uint32_t b[2][2];
        Tile::load_b(b, kt, jj * 16, ks * 16, lane);
        M::mma(s[2 * jj], qf[ks], b[0][0], b[0][1]);
        M::mma(s[2 * jj + 1], qf[ks], b[1][0], b[1][1]);
        Tile::load_b(b, vt, jj * 16, ks * 16, lane);
        M::mma(dp[2 * jj], ado, b[0][0], b[0][1]);
        M::mma(dp[2 * jj + 1], ado, b[1][0], b[1][1]);
      }
    }
    const int n0 = seq.begin + n * kBN;
    const bool mask = n0 + kBN > seq.end || (p.causal && n0 + kBN - 1 > m0 + warp_row);
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float prob = tile::fast_exp2(fmaf(s[j][e], p.scale_log2, -lse2[r]));
        if (mask) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1);
          if (col >= seq.end || (p.causal && col > row_lo + 8 * r)) prob = 0.0f;
        }
        dp[j][e] = prob * (dp[j][e] - delta[r]);
      }
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      std::uint32_t a[4];
      tile::accumulators_to_a<T>(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        std::uint32_t b[2][2];
        Tile::load_b_trans(b, kt, kk * 16, dj * 16, lane);
        M::mma(dq[2 * dj], a, b[0][0], b[0][1]);
        M::mma(dq[2 * dj + 1], a, b[1][0], b[1][1]);
      }
    }
    __syncthreads();
  }
  tile::cp_async_wait<0>();
  store_rows<T, D>(static_cast<T*>(p.dq) + h * D, q_ld, dq, p.scale, row_lo, seq.end, lane);
}

template <typename T, int D>
void launch(const AttentionDesc& desc, const BackwardParams& params, CUstream_st* stream) {
  using C = BackwardConfig<D>;
  auto* dkdv = attention_dkdv_mma_kernel<T, D>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 dkdv_grid(static_cast<unsigned>(tile::attention_tile_bound(desc.tokens, desc.sequences, C::kBN)),
                       static_cast<unsigned>(desc.kv_heads));
  dkdv<<<dkdv_grid, C::kThreads, C::kSmemBytes, stream>>>(params);
  SG_CUDA_CHECK(cudaGetLastError());
  auto* dq = attention_dq_mma_kernel<T, D>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 dq_grid(static_cast<unsigned>(tile::attention_tile_bound(desc.tokens, desc.sequences, C::kBM)),
                     static_cast<unsigned>(desc.heads));
  dq<<<dq_grid, C::kThreads, C::kSmemBytes, stream>>>(params);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void backward_mma(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream) {
  const float scale = desc.softmax_scale();
  const BackwardParams params{p.q,
                              p.k,
                              p.v,
                              p.lse,
                              p.dout,
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
    bf16 ? launch<__nv_bfloat16, 64>(desc, params, stream) : launch<__half, 64>(desc, params, stream);
  } else {
    bf16 ? launch<__nv_bfloat16, 128>(desc, params, stream) : launch<__half, 128>(desc, params, stream);
  }
}

}  // namespace stepgraph::kernels::attention_detail
