// Internal to the attention kernels (attention.cu dispatches to these): the
// plain kernels (attention_simple.cu, any dtype, head_dim <= 256) and the
// tensor-core kernels (attention_forward.cu, attention_backward.cu: bf16 and
// fp16, head_dim 64 and 128), which also run segment attention
// (attention_segments.cu). Arguments are checked by the caller.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/attention.h"

namespace stepgraph::kernels::attention_detail {

// The pointers of one launch (device memory).
struct AttentionPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;                 // backward
  const float* lse = nullptr;                // backward
  const void* dout = nullptr;                // backward
  const std::int32_t* cu_seqlens = nullptr;  // segment attention: q_offsets
  // Segment attention (Note [Segment attention]): the ranges [G, 2]; null for self-attention.
  const std::int32_t* kv_ranges = nullptr;
  void* out_mut = nullptr;   // forward: out
  float* lse_mut = nullptr;  // forward: lse
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* delta = nullptr;  // backward scratch [H, T]
  // Tensor-core backward scratch (Note [Attention backward in one pass, deterministic]).
  float* dq_accum = nullptr;     // [T, H, D]
  int* dq_semaphores = nullptr;  // [H, T]
};

void forward_simple(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);
// Self-attention when p.kv_ranges is null (kv_tokens = desc.tokens); else
// segment attention over kv_tokens keys (desc.tokens: the query tokens,
// desc.sequences: the segments).
void forward_wgmma(const AttentionDesc& desc, std::int64_t kv_tokens, const AttentionPointers& p, CUstream_st* stream);

// delta[h, t] = dout . out of query t, head h (fp32).
void backward_delta(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);
void backward_simple(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);
// As forward_wgmma; p.dq_accum and p.dq_semaphores from BackwardWorkspace.
void backward_wgmma(const AttentionDesc& desc, std::int64_t kv_tokens, const AttentionPointers& p, CUstream_st* stream);

// The backward's scratch over desc.tokens query tokens (self or segment
// attention): delta [H, T] fp32; on the tensor-core path also the dQ
// semaphores [H, T] int32 and the fp32 dQ sums [T, H, D]; each 256-byte aligned.
struct BackwardWorkspace {
  std::size_t delta = 0, semaphores = 0, dq_accum = 0;
  explicit BackwardWorkspace(const AttentionDesc& desc) {
    const auto rows = static_cast<std::size_t>(desc.heads * desc.tokens);
    delta = aligned256(rows * sizeof(float));
    if (attention_uses_tensor_cores(desc)) {
      semaphores = aligned256(rows * sizeof(int));
      dq_accum = aligned256(rows * static_cast<std::size_t>(desc.head_dim) * sizeof(float));
    }
  }
  std::size_t bytes() const { return delta + semaphores + dq_accum; }
  // The pointers into a workspace of bytes() bytes.
  void place(void* workspace, AttentionPointers* p) const {
    auto* scratch = static_cast<unsigned char*>(workspace);
    p->delta = reinterpret_cast<float*>(scratch);
    p->dq_semaphores = semaphores != 0 ? reinterpret_cast<int*>(scratch + delta) : nullptr;
    p->dq_accum = dq_accum != 0 ? reinterpret_cast<float*>(scratch + delta + semaphores) : nullptr;
  }

 private:
  static std::size_t aligned256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }
};

}  // namespace stepgraph::kernels::attention_detail
