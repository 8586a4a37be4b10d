// Host helpers of the Hopper (TMA + wgmma) kernels: TMA descriptors of
// row-major tensors read in 128-byte-swizzled boxes, and the current device's
// SM count. One place, so every TMA kernel encodes its descriptors alike.
#pragma once

#include <cuda.h>

#include <array>
#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

// A TMA descriptor of a row-major tensor at `base` of element type `dtype`
// (bf16, fp16 or fp32), dims innermost first (kRank 2 or 3), read or written
// in boxes of `box` elements whose innermost extent is 128 bytes (64 16-bit or
// 32 fp32 elements), laid out in shared memory with the 128-byte swizzle (Note
// [wgmma operand tiles] in tile/wgmma_pipeline.cuh). Boxes past the tensor's
// bounds are zero-filled. An Error when the driver rejects it (a base not
// 16-byte aligned, a row pitch not a multiple of 16 bytes).
template <int kRank>
CUtensorMap swizzled_tensor_map(DType dtype, const void* base, const std::array<std::int64_t, kRank>& dims,
                                const std::array<int, kRank>& box);

int sm_count();

}  // namespace stepgraph::kernels
