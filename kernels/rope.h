// Rotary position embedding (RoPE) over packed variable-length sequences:
// the CUDA kernels (rope.cu) and their fp32 host reference (rope_host.cc).
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

struct CUstream_st;

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
// check_rope, and kv_heads > 0 dividing desc.heads.
void check_qkv_rope(const RopeDesc& desc, std::int64_t kv_heads);

// Device pointers; positions come from cu_seqlens on the device (clamped as
// in kernels/attention.h). out may alias x (in place), dx may alias dy.
void launch_rope_forward(const RopeDesc& desc, const void* x, const std::int32_t* cu_seqlens, void* out,
                         CUstream_st* stream);
void launch_rope_backward(const RopeDesc& desc, const void* dy, const std::int32_t* cu_seqlens, void* dx,
                          CUstream_st* stream);

// MultiheadAttention's split of the fused QKV projection, with the rotation
// fused into the copy it needs anyway: qkv [T, (H + 2 Hkv) D] (q's H heads,
// then k's Hkv, then v's Hkv, per token) -> q [T, H, D] and k [T, Hkv, D]
// rotated, v [T, Hkv, D] copied; desc.heads is H. The backward merges
// dq, dk (rotated back) and dv into dqkv [T, (H + 2 Hkv) D].
void launch_qkv_split_rope(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv,
                           const std::int32_t* cu_seqlens, void* q, void* k, void* v, CUstream_st* stream);
void launch_qkv_merge_rope_backward(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                                    const void* dv, const std::int32_t* cu_seqlens, void* dqkv, CUstream_st* stream);

// The same with each token's position given (positions int32 [T], device
// memory; e.g. a context-parallel rank's, kernels/context_parallel_plan.h)
// instead of derived from cu_seqlens; desc.sequences is not read. With the
// positions cu_seqlens gives, the bits are the cu_seqlens entry points'.
void launch_qkv_split_rope_at(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv,
                              const std::int32_t* positions, void* q, void* k, void* v, CUstream_st* stream);
void launch_qkv_merge_rope_backward_at(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                                       const void* dv, const std::int32_t* positions, void* dqkv, CUstream_st* stream);

namespace host {

void qkv_split_rope(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv, const std::int32_t* cu_seqlens,
                    void* q, void* k, void* v);
void qkv_merge_rope_backward(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                             const void* dv, const std::int32_t* cu_seqlens, void* dqkv);

// The positions variants (host memory; any int32 positions).
void qkv_split_rope_at(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv, const std::int32_t* positions,
                       void* q, void* k, void* v);
void qkv_merge_rope_backward_at(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                                const void* dv, const std::int32_t* positions, void* dqkv);

// out = rope(x); dx = the inverse rotation of dy. Host memory; cu_seqlens as
// kernels::host::check_cu_seqlens requires (an Error otherwise).
void rope_forward(const RopeDesc& desc, const void* x, const std::int32_t* cu_seqlens, void* out);
void rope_backward(const RopeDesc& desc, const void* dy, const std::int32_t* cu_seqlens, void* dx);

}  // namespace host
}  // namespace stepgraph::kernels
