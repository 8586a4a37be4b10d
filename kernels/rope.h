// Rotary position embedding (RoPE) over packed variable-length sequences
// (issue 16): the contract the fused kernels will meet, and its fp32 host
// reference (rope_host.cc). The CUDA kernels are not written yet.
//
// x [T, H, D] (bf16, fp16 or fp32), tokens packed as in kernels/attention.h
// (cu_seqlens int32 [S + 1]); a token's position p is its index within its
// sequence, so every sequence starts at 0. The first rotary_dim (even, <= D)
// features rotate in pairs (f, f + rotary_dim / 2) by the angle p * theta_f,
// theta_f = base^(-2 f / rotary_dim) (GPT-NeoX's "rotate half" layout):
//   out[f]            = x[f] cos - x[f + r/2] sin
//   out[f + r/2]      = x[f + r/2] cos + x[f] sin
// the rest pass through. The backward is the inverse rotation (the transpose).
// Rotated queries and keys make q.k depend on their positions' difference only.
#pragma once

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

struct RopeDesc {
  DType dtype = DType::kBFloat16;
  std::int64_t tokens = 0;
  std::int64_t sequences = 0;
  std::int64_t heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t rotary_dim = 0;  // 0: head_dim
  float base = 10000.0f;

  std::int64_t rotated() const { return rotary_dim != 0 ? rotary_dim : head_dim; }
};

// An Error naming what is wrong: dtype, a non-positive size, rotary_dim odd
// or beyond head_dim, base <= 1 or not finite.
void check_rope(const RopeDesc& desc);

namespace host {

// out = rope(x); dx = the inverse rotation of dy. Host memory; cu_seqlens as
// kernels::host::check_cu_seqlens requires (an Error otherwise).
void rope_forward(const RopeDesc& desc, const void* x, const std::int32_t* cu_seqlens, void* out);
void rope_backward(const RopeDesc& desc, const void* dy, const std::int32_t* cu_seqlens, void* dx);

}  // namespace host
}  // namespace stepgraph::kernels
