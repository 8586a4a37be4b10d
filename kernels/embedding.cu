// Embedding forward (a gather) and its deterministic backward (contract and
// Note [Deterministic embedding backward] in embedding.h).
//
//   forward:  a grid-stride loop over out's elements, copying raw element
//             bits (no conversion: the gather is exact in every dtype).
//   backward: block (cols x rows_per_block) threads; thread (x, y) owns
//             dtable[v = blockIdx.x * rows_per_block + y, d = blockIdx.y * cols + x].
//             The block stages token tiles in shared memory; every thread
//             walks each tile in order and adds dout of the positions naming
//             its row. A warp shares one row, so the branch is uniform.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/embedding.h"
#include "kernels/launch_config.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kBackwardThreads = 256;
constexpr int kTokenTile = 2048;

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

template <typename T>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_kernel(const T* __restrict__ dout, const std::int32_t* __restrict__ tokens, float* __restrict__ dtable,
                    std::int64_t vocab, std::int64_t dim, std::int64_t positions, std::int64_t vocab_offset) {
  __shared__ std::int32_t tile[kTokenTile];
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const std::int64_t id = v + vocab_offset;  // the global id of row v (a vocabulary slice's row)
  const std::int64_t d = static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const bool owns = v < vocab && d < dim;
  const int thread = threadIdx.y * blockDim.x + threadIdx.x;
  const int threads = blockDim.x * blockDim.y;
  float acc = 0.0f;
  for (std::int64_t start = 0; start < positions; start += kTokenTile) {
    const int count = static_cast<int>(min(static_cast<std::int64_t>(kTokenTile), positions - start));
    __syncthreads();  // the previous tile is no longer read
    for (int i = thread; i < count; i += threads) tile[i] = tokens[start + i];
    __syncthreads();
    if (owns) {
      for (int i = 0; i < count; ++i) {
        if (tile[i] == id) acc += to_float(dout[(start + i) * dim + d]);
      }
    }
  }
  if (owns) dtable[v * dim + d] = acc;
}

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
  // Columns in whole warps (a warp never spans two rows), up to the block.
  const int cols = static_cast<int>(std::min<std::int64_t>((desc.dim + 31) / 32 * 32, kBackwardThreads));
  const int rows_per_block = kBackwardThreads / cols;
  const dim3 block(cols, rows_per_block);
  const std::int64_t row_blocks = (desc.vocab + rows_per_block - 1) / rows_per_block;
  const std::int64_t col_blocks = (desc.dim + cols - 1) / cols;
  SG_CHECK(col_blocks <= 65535, "embedding_backward: dim ", desc.dim, " needs ", col_blocks,
           " column blocks, more than the grid's 65535");
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_blocks));
  auto launch = [&]<typename T>() {
    backward_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(dout), tokens, dtable, desc.vocab, desc.dim,
                                                   desc.positions(), desc.vocab_offset);
  };
  switch (desc.dtype) {
    case DType::kFloat32: launch.template operator()<float>(); break;
    case DType::kBFloat16: launch.template operator()<__nv_bfloat16>(); break;
    case DType::kFloat16: launch.template operator()<__half>(); break;
    default: SG_THROW(ErrorCode::kInternal, "embedding_backward: dtype ", dtype_name(desc.dtype), " passed the check");
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
