// Host side of the tensor-core attention launches (attention_forward.cu,
// attention_backward.cu): the TMA maps of the token-major operands and the
// launch of one block per (tile of a sequence or of the keys, head).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "kernels/attention.h"
#include "kernels/tensor_map.h"
#include "kernels/tile/attention_tile.cuh"

namespace stepgraph::kernels::tile {

// The TMA map of a token-major [tokens, heads * D] 16-bit operand, in boxes of
// one 128-byte swizzle atom (64 columns) by `rows` tokens.
template <int D>
CUtensorMap token_major_map(DType dtype, const void* base, std::int64_t heads, std::int64_t tokens, int rows) {
  return swizzled_tensor_map<2>(dtype, base, {heads * D, tokens}, {64, rows});
}

// The maps of q (boxes of C::kBM query rows, desc.tokens of them) and of k
// and v (C::kBN keys, kv_tokens of them: desc.tokens for self-attention).
struct QkvMaps {
  CUtensorMap q, k, v;
};
template <typename C, int D>
QkvMaps qkv_maps(const AttentionDesc& desc, std::int64_t kv_tokens, const void* q, const void* k, const void* v) {
  return {token_major_map<D>(desc.dtype, q, desc.heads, desc.tokens, C::kBM),
          token_major_map<D>(desc.dtype, k, desc.kv_heads, kv_tokens, C::kBN),
          token_major_map<D>(desc.dtype, v, desc.kv_heads, kv_tokens, C::kBN)};
}

// kernel<<<(blocks, heads), C::kThreads, C::kSmemBytes, stream>>>(args...),
// with the kernel's dynamic shared memory limit raised to C::kSmemBytes first.
template <typename C, typename Kernel, typename... Args>
void launch_blocks(Kernel* kernel, std::int64_t blocks, std::int64_t heads, CUstream_st* stream, const Args&... args) {
  SG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(heads));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(args...);
  SG_CUDA_CHECK(cudaGetLastError());
}

// launch_blocks over the tiles of `rows` tokens of desc's packing.
template <typename C, typename Kernel, typename... Args>
void launch_over_tiles(Kernel* kernel, const AttentionDesc& desc, int rows, std::int64_t heads, CUstream_st* stream,
                       const Args&... args) {
  launch_blocks<C>(kernel, attention_tile_bound(desc.tokens, desc.sequences, rows), heads, stream, args...);
}

}  // namespace stepgraph::kernels::tile
