// The tensor-core attention forward (bf16/fp16, head_dim 64 and 128):
// FlashAttention-2 on mma.sync m16n8k16.
//
// Note [Attention forward tiles]
// A block owns kBM = 128 query rows of one sequence and one head; its 8 warps
// own 16 rows each, with the rows' Q fragments kept in registers. The block
// walks the sequence's keys in tiles of kBN = 64 (only up to its last row when
// causal: later tiles are fully masked and never loaded), K and V
// double-buffered through cp.async into swizzled shared memory. Per tile and
// warp: S = Q K^T (ldmatrix of K rows as the col-major B operand), the masks
// (only on the tiles that cross the diagonal or the sequence's end), the
// online softmax in base 2 (scale * log2 e folded into one multiply; each
// thread keeps partial row sums, reduced over the row's 4 lanes once at the
// end), then O += P V with P rounded to 16 bits straight from the S
// accumulators (their layout is the A operand's) and V through ldmatrix.trans.
// Blocks are launched in reverse tile order so that a causal sequence's long
// tiles (its last rows see the most keys) start first.
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

struct ForwardParams {
  const void* q;
  const void* k;
  const void* v;
  const std::int32_t* cu_seqlens;
  void* out;
  float* lse;
  int tokens, sequences, heads, kv_heads;
  bool causal;
  float scale_log2;  // scale * log2(e)
};

template <int D>
struct ForwardConfig {
  static constexpr int kBM = 128;
  static constexpr int kBN = 64;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  using QTile = RowTile<kBM, D, kThreads>;
  using KVTile = RowTile<kBN, D, kThreads>;
  static constexpr int kSmemBytes = QTile::kBytes + 4 * KVTile::kBytes;
};

template <typename T, int D>
__global__ void __launch_bounds__(ForwardConfig<D>::kThreads, 1) attention_forward_mma_kernel(ForwardParams p) {
  using C = ForwardConfig<D>;
  using QTile = typename C::QTile;
  using KVTile = typename C::KVTile;
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
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const int m0 = seq.first;
  const int kv_end = p.causal ? min(seq.end, m0 + kBM) : seq.end;
  const int kv_tiles = (kv_end - seq.begin + kBN - 1) / kBN;
  const std::uint32_t sq = tile::smem_address(smem);
  auto sk = [&](int stage) { return sq + QTile::kBytes + stage * 2 * KVTile::kBytes; };
  auto sv = [&](int stage) { return sk(stage) + KVTile::kBytes; };
  auto load_kv = [&](int n, int stage) {
    const int n0 = seq.begin + n * kBN;
    KVTile::load(sk(stage), k + n0 * kv_ld + g * D, kv_ld, seq.end - n0);
    KVTile::load(sv(stage), v + n0 * kv_ld + g * D, kv_ld, seq.end - n0);
  };

  QTile::load(sq, q + m0 * q_ld + h * D, q_ld, seq.end - m0);
  load_kv(0, 0);
  tile::cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 units (scores * scale * log2 e)
  float row_sum[2] = {0.0f, 0.0f};            // this thread's columns only
  std::uint32_t qf[D / 16][4];
  const int row_lo = m0 + warp_row + lane / 4;

  for (int n = 0; n < kv_tiles; ++n) {
    if (n + 1 < kv_tiles) load_kv(n + 1, (n + 1) & 1);
    tile::cp_async_commit();
    tile::cp_async_wait<1>();
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) QTile::load_a(qf[ks], sq, warp_row, ks * 16, lane);
    }
    const std::uint32_t kt = sk(n & 1);
    const std::uint32_t vt = sv(n & 1);

    float s[kBN / 8][4];
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int jj = 0; jj < kBN / 16; ++jj) {
        std::uint32_t b[2][2];
        KVTile::load_b(b, kt, jj * 16, ks * 16, lane);
        M::mma(s[2 * jj], qf[ks], b[0][0], b[0][1]);
        M::mma(s[2 * jj + 1], qf[ks], b[1][0], b[1][1]);
      }
    }

    const int n0 = seq.begin + n * kBN;
    if (n0 + kBN > seq.end || (p.causal && n0 + kBN - 1 > m0 + warp_row)) {
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n0 + j * 8 + 2 * (lane & 3) + (e & 1);
          const int row = row_lo + (e >> 1) * 8;
          if (col >= seq.end || (p.causal && col > row)) s[j][e] = -INFINITY;
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float new_max = fmaxf(row_max[r], mx * p.scale_log2);
      // A row with no key yet keeps max -inf: subtract 0, not -inf (no NaN).
      const float base = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = tile::fast_exp2(row_max[r] - base);
      row_max[r] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
        s[j][2 * r] = tile::fast_exp2(fmaf(s[j][2 * r], p.scale_log2, -base));
        s[j][2 * r + 1] = tile::fast_exp2(fmaf(s[j][2 * r + 1], p.scale_log2, -base));
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
    }

#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      std::uint32_t a[4];
      tile::accumulators_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dj = 0; dj < D / 16; ++dj) {
        std::uint32_t b[2][2];
        KVTile::load_b_trans(b, vt, kk * 16, dj * 16, lane);
        M::mma(o[2 * dj], a, b[0][0], b[0][1]);
        M::mma(o[2 * dj + 1], a, b[1][0], b[1][1]);
      }
    }
    // The next iteration's load overwrites the stage this one read.
    __syncthreads();
  }
  tile::cp_async_wait<0>();

  T* out = static_cast<T*>(p.out);
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
      *reinterpret_cast<std::uint32_t*>(dst + j * 8) = M::pack(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
    }
    if ((lane & 3) == 0) {
      p.lse[static_cast<std::int64_t>(h) * p.tokens + row] =
          sum > 0.0f ? row_max[r] * 0.69314718055994530942f + logf(sum) : -INFINITY;
    }
  }
}

template <typename T, int D>
void launch(const AttentionDesc& desc, const ForwardParams& params, CUstream_st* stream) {
  using C = ForwardConfig<D>;
  auto* kernel = attention_forward_mma_kernel<T, D>;
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(tile::attention_tile_bound(desc.tokens, desc.sequences, C::kBM)),
                  static_cast<unsigned>(desc.heads));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(params);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void forward_mma(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream) {
  const ForwardParams params{p.q,
                             p.k,
                             p.v,
                             p.cu_seqlens,
                             p.out_mut,
                             p.lse_mut,
                             static_cast<int>(desc.tokens),
                             static_cast<int>(desc.sequences),
                             static_cast<int>(desc.heads),
                             static_cast<int>(desc.kv_heads),
                             desc.causal,
                             desc.softmax_scale() * 1.4426950408889634f};
  const bool bf16 = desc.dtype == DType::kBFloat16;
  SG_CHECK(bf16 || desc.dtype == DType::kFloat16, "attention: the tensor-core forward takes bf16 or fp16");
  SG_CHECK(desc.head_dim == 64 || desc.head_dim == 128, "attention: the tensor-core forward takes head_dim 64 or 128");
  if (desc.head_dim == 64) {
    bf16 ? launch<__nv_bfloat16, 64>(desc, params, stream) : launch<__half, 64>(desc, params, stream);
  } else {
    bf16 ? launch<__nv_bfloat16, 128>(desc, params, stream) : launch<__half, 128>(desc, params, stream);
  }
}

}  // namespace stepgraph::kernels::attention_detail
