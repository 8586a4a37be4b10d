// Embedding forward (a gather) and its deterministic backward (contract and
// Note [Deterministic embedding backward] in embedding.h).
//
//   forward:  a grid-stride loop over out's elements, copying raw element
//             bits (no conversion: the gather is exact in every dtype).
//   backward: block (row v, chunk of kColumnChunk columns). The block walks
//             the tokens in tiles of kTokenTile, ballots them against v's
//             global id and compacts the tile's matching positions, in
//             increasing order, into shared memory; each thread then adds
//             dout of those positions for its kColsPerThread columns in fp32
//             registers, and the block writes its row chunk once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/embedding.h"
#include "kernels/launch_config.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

// The backward's block: kBackwardThreads threads own kColumnChunk columns of
// one dtable row and ballot kTokenTile tokens per tile, kTokensPerThread each.
constexpr int kBackwardThreads = 256;
constexpr int kBackwardWarps = kBackwardThreads / 32;
constexpr int kTokensPerThread = 4;
constexpr int kTokenTile = kBackwardThreads * kTokensPerThread;
constexpr int kColsPerThread = 8;  // one 16-byte load of bf16/fp16, two of fp32
constexpr int kColumnChunk = kBackwardThreads * kColsPerThread;
// How a thread hides the latency of its dout loads: the rows it loads before
// adding them, and the blocks an SM must hold (which caps its registers).
// Wide: many blocks (a large vocabulary) hide it by occupancy, 4 blocks
// (1024 threads) an SM at 64 registers, which the token scan wants too.
// Deep: a grid of at most one block an SM (a small vocabulary, each row
// named by many positions) has no occupancy to lose, so its threads keep 16
// rows of loads in flight (about 200 registers).
struct WideLatencyHiding {
  static constexpr int kRowsInFlight = 4;
  static constexpr int kBlocksPerSm = 4;
};
struct DeepLatencyHiding {
  static constexpr int kRowsInFlight = 16;
  static constexpr int kBlocksPerSm = 1;
};
// Grids up to this many blocks take DeepLatencyHiding: one an SM of an H100.
constexpr std::int64_t kDeepGridBlocks = 132;
// The tile's (slot, warp) match counts are scanned by one warp, a lane each.
static_assert(kTokensPerThread * kBackwardWarps == 32);

// Bits is an unsigned integer of the element size; its top bit is the sign.
template <typename Bits>
__global__ void __launch_bounds__(kThreadsPerBlock)
    forward_kernel(const Bits* __restrict__ table, const std::int32_t* __restrict__ tokens, Bits* __restrict__ out,
                   std::int32_t* error_flag, std::int64_t vocab, std::int64_t dim, std::int64_t positions,
                   std::int64_t vocab_offset, std::int64_t valid_ids) {
  // Note [Vocabulary slice of an embedding] (embedding.h).
  constexpr Bits kNegativeZero = static_cast<Bits>(Bits{1} << (8 * sizeof(Bits) - 1));
  grid_stride(positions * dim, [&](std::int64_t e) {
    const std::int64_t p = e / dim;
    const std::int64_t d = e - p * dim;
    const std::int64_t token = tokens[p];
    const std::int64_t row = token - vocab_offset;
    if (row >= 0 && row < vocab) {
      out[e] = table[row * dim + d];
      return;
    }
    const bool outside = token < 0 || token >= valid_ids;
    out[e] = outside && vocab_offset == 0 ? Bits{0} : kNegativeZero;
    if (outside && d == 0) *error_flag = 1;
  });
}

// Compacts one tile's tokens naming `id` into `matches` (their offsets in the
// tile, in increasing order) and returns how many there are. Slot k of thread
// t holds the tile's token k * kBackwardThreads + t, so (slot, warp, lane)
// order is position order: the (slot, warp) counts' exclusive scan plus the
// lanes below in the slot's ballot place each match. A tile without a match
// (most tiles of most rows) costs its loads and one barrier. Synchronizes the
// block; `counts` holds 33 ints (32 offsets and the total).
__device__ __forceinline__ int compact_tile_matches(const std::int32_t* __restrict__ tokens, std::int64_t start,
                                                    std::int64_t positions, std::int32_t id, int* matches,
                                                    int* counts) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  unsigned mine = 0;  // bit k: the token of slot k names id
#pragma unroll
  for (int k = 0; k < kTokensPerThread; ++k) {
    const std::int64_t p = start + k * kBackwardThreads + threadIdx.x;
    if (p < positions && tokens[p] == id) mine |= 1u << k;
  }
  // Also the barrier after which the previous tile's `matches` are no longer read.
  if (!__syncthreads_or(static_cast<int>(mine))) return 0;
  unsigned masks[kTokensPerThread];
#pragma unroll
  for (int k = 0; k < kTokensPerThread; ++k) {
    masks[k] = __ballot_sync(0xffffffffu, (mine >> k) & 1u);
    if (lane == 0) counts[k * kBackwardWarps + warp] = __popc(masks[k]);
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the 32 counts in (slot, warp) order
    const int count = counts[lane];
    int inclusive = count;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int below = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    counts[lane] = inclusive - count;
    if (lane == 31) counts[32] = inclusive;
  }
  __syncthreads();
  const unsigned lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int k = 0; k < kTokensPerThread; ++k) {
    if ((mine >> k) & 1u) {
      matches[counts[k * kBackwardWarps + warp] + __popc(masks[k] & lanes_below)] =
          k * kBackwardThreads + static_cast<int>(threadIdx.x);
    }
  }
  __syncthreads();
  return counts[32];
}

// A thread's kColsPerThread columns of the block's chunk. Vectorized: the
// adjacent columns chunk + thread * kColsPerThread + j (dim a multiple of
// kColsPerThread and 16-byte aligned pointers, so they are one or two whole
// vectors, all inside dim or all outside). Otherwise the strided columns
// chunk + j * kBackwardThreads + thread, coalesced scalar accesses.
template <bool kVectorized>
__device__ __forceinline__ std::int64_t column_of(std::int64_t chunk, int j) {
  if constexpr (kVectorized) {
    return chunk + static_cast<std::int64_t>(threadIdx.x) * kColsPerThread + j;
  } else {
    return chunk + static_cast<std::int64_t>(j) * kBackwardThreads + threadIdx.x;
  }
}

// A thread's kColsPerThread elements of one dout row, kept in T until added,
// so the rows in flight cost only their own bytes of registers.
template <typename T, bool kVectorized>
struct RowSlice {
  static constexpr int kCount = Vec16<T>::kCount;
  Vec16<T> vectors[kColsPerThread / kCount];  // column j is vectors[j / kCount].values[j % kCount]

  __device__ __forceinline__ void load(const T* __restrict__ dout_row, std::int64_t chunk, std::int64_t dim) {
    if constexpr (kVectorized) {
      const T* src = dout_row + column_of<true>(chunk, 0);
#pragma unroll
      for (int v = 0; v < kColsPerThread / kCount; ++v) vectors[v] = load16(src + v * kCount);
    } else {
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        const std::int64_t d = column_of<false>(chunk, j);
        // A column past dim is added but never stored.
        vectors[j / kCount].values[j % kCount] = d < dim ? dout_row[d] : from_float<T>(0.0f);
      }
    }
  }

  // acc[j] += column j: one fp32 rounding per column, as the host's.
  __device__ __forceinline__ void add_to(float (&acc)[kColsPerThread]) const {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) acc[j] += to_float(vectors[j / kCount].values[j % kCount]);
  }
};

template <bool kVectorized>
__device__ __forceinline__ void store_row(float* __restrict__ dtable_row, std::int64_t chunk, std::int64_t dim,
                                          const float (&acc)[kColsPerThread]) {
  if constexpr (kVectorized) {
    constexpr int kCount = Vec16<float>::kCount;
    float* dst = dtable_row + column_of<true>(chunk, 0);
#pragma unroll
    for (int j = 0; j < kColsPerThread; j += kCount) {
      Vec16<float> out;
#pragma unroll
      for (int e = 0; e < kCount; ++e) out.values[e] = acc[j + e];
      store16(dst + j, out);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const std::int64_t d = column_of<false>(chunk, j);
      if (d < dim) dtable_row[d] = acc[j];
    }
  }
}

// Block (blockIdx.x, blockIdx.y) writes dtable row v = blockIdx.x, columns
// [blockIdx.y * kColumnChunk, + kColumnChunk): per column, the fp32 sum from
// 0 of dout over the positions naming v's global id, in increasing position
// order (tiles in order, each tile's matches compacted in order).
template <typename T, bool kVectorized, typename Latency>
__global__ void __launch_bounds__(kBackwardThreads, Latency::kBlocksPerSm)
    backward_kernel(const T* __restrict__ dout, const std::int32_t* __restrict__ tokens, float* __restrict__ dtable,
                    std::int64_t dim, std::int64_t positions, std::int64_t vocab_offset) {
  __shared__ int matches[kTokenTile];
  __shared__ int counts[33];
  const std::int64_t v = blockIdx.x;
  // Below 2^31 (check_embedding); a token outside the slice never equals it.
  const auto id = static_cast<std::int32_t>(v + vocab_offset);
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.y) * kColumnChunk;
  // A vectorized thread past dim has no column; it still ballots its tokens.
  const bool has_columns = !kVectorized || column_of<true>(chunk, 0) < dim;
  float acc[kColsPerThread] = {};
  for (std::int64_t start = 0; start < positions; start += kTokenTile) {
    const int count = compact_tile_matches(tokens, start, positions, id, matches, counts);
    if (!has_columns) continue;
    // A batch's loads are issued together, then added in list order. The
    // guards depend on count alone: uniform over the block.
    constexpr int kBatch = Latency::kRowsInFlight;
    for (int i = 0; i < count; i += kBatch) {
      RowSlice<T, kVectorized> rows[kBatch];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        if (i + r < count) rows[r].load(dout + (start + matches[i + r]) * dim, chunk, dim);
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        if (i + r < count) rows[r].add_to(acc);
      }
    }
  }
  if (has_columns) store_row<kVectorized>(dtable + v * dim, chunk, dim, acc);
}

// One backward launch's arguments; run<T, kVectorized>() picks the latency
// hiding and launches.
struct BackwardLaunch {
  dim3 grid;
  bool deep = false;  // DeepLatencyHiding, else WideLatencyHiding
  const void* dout = nullptr;
  const std::int32_t* tokens = nullptr;
  float* dtable = nullptr;
  std::int64_t dim = 0, positions = 0, vocab_offset = 0;
  cudaStream_t stream = nullptr;

  template <typename T, bool kVectorized>
  void run() const {
    const auto* typed = static_cast<const T*>(dout);
    if (deep) {
      backward_kernel<T, kVectorized, DeepLatencyHiding>
          <<<grid, kBackwardThreads, 0, stream>>>(typed, tokens, dtable, dim, positions, vocab_offset);
    } else {
      backward_kernel<T, kVectorized, WideLatencyHiding>
          <<<grid, kBackwardThreads, 0, stream>>>(typed, tokens, dtable, dim, positions, vocab_offset);
    }
  }
};

void check_pointer(const char* op, const void* pointer, const char* name) {
  SG_CHECK(pointer != nullptr, op, ": ", name, " is null; pass a device pointer");
}

}  // namespace

void launch_embedding_forward(const EmbeddingDesc& desc, const void* table, const std::int32_t* tokens, void* out,
                              std::int32_t* error_flag, cudaStream_t stream) {
  check_embedding(desc);
  check_pointer("embedding_forward", table, "table");
  check_pointer("embedding_forward", tokens, "tokens");
  check_pointer("embedding_forward", out, "out");
  check_pointer("embedding_forward", error_flag, "error_flag");
  const int blocks = blocks_for(desc.positions() * desc.dim);
  if (dtype_size(desc.dtype) == 4) {
    forward_kernel<std::uint32_t><<<blocks, kThreadsPerBlock, 0, stream>>>(
        static_cast<const std::uint32_t*>(table), tokens, static_cast<std::uint32_t*>(out), error_flag, desc.vocab,
        desc.dim, desc.positions(), desc.vocab_offset, desc.valid_ids());
  } else {
    forward_kernel<std::uint16_t><<<blocks, kThreadsPerBlock, 0, stream>>>(
        static_cast<const std::uint16_t*>(table), tokens, static_cast<std::uint16_t*>(out), error_flag, desc.vocab,
        desc.dim, desc.positions(), desc.vocab_offset, desc.valid_ids());
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_embedding_backward(const EmbeddingDesc& desc, const void* dout, const std::int32_t* tokens, float* dtable,
                               cudaStream_t stream) {
  check_embedding(desc);
  check_pointer("embedding_backward", dout, "dout");
  check_pointer("embedding_backward", tokens, "tokens");
  check_pointer("embedding_backward", dtable, "dtable");
  // One block per (row, column chunk); rows on x, whose limit (2^31 - 1)
  // every vocabulary below 2^31 fits.
  const std::int64_t chunks = (desc.dim + kColumnChunk - 1) / kColumnChunk;
  SG_CHECK(chunks <= 65535, "embedding_backward: dim ", desc.dim, " needs ", chunks, " column chunks of ",
           kColumnChunk, ", more than the grid's 65535; split the table's columns");
  const dim3 grid(static_cast<unsigned>(desc.vocab), static_cast<unsigned>(chunks));
  // 16-byte accesses where every dout and dtable row starts aligned and a
  // thread's columns are whole vectors.
  const bool vectorized = desc.dim % kColsPerThread == 0 && is_aligned16(dout) && is_aligned16(dtable);
  const BackwardLaunch launch{.grid = grid,
                              .deep = desc.vocab * chunks <= kDeepGridBlocks,
                              .dout = dout,
                              .tokens = tokens,
                              .dtable = dtable,
                              .dim = desc.dim,
                              .positions = desc.positions(),
                              .vocab_offset = desc.vocab_offset,
                              .stream = stream};
  auto launch_typed = [&]<typename T>() {
    if (vectorized) {
      launch.run<T, true>();
    } else {
      launch.run<T, false>();
    }
  };
  switch (desc.dtype) {
    case DType::kFloat32: launch_typed.template operator()<float>(); break;
    case DType::kBFloat16: launch_typed.template operator()<__nv_bfloat16>(); break;
    case DType::kFloat16: launch_typed.template operator()<__half>(); break;
    default: SG_THROW(ErrorCode::kInternal, "embedding_backward: dtype ", dtype_name(desc.dtype), " passed the check");
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
