// Internal to the attention kernels (attention.cu dispatches to these): the
// plain kernels (attention_simple.cu, any dtype, head_dim <= 256) and the
// tensor-core kernels (attention_forward.cu, attention_backward.cu: bf16 and
// fp16, head_dim 64 and 128). Arguments are checked by the caller.
#pragma once

#include <cstdint>

#include "kernels/attention.h"

namespace stepgraph::kernels::attention_detail {

// The pointers of one launch (device memory).
struct AttentionPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;   // backward
  const float* lse = nullptr;  // backward
  const void* dout = nullptr;  // backward
  const std::int32_t* cu_seqlens = nullptr;
  void* out_mut = nullptr;  // forward: out
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
void forward_wgmma(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);

// delta[h, t] = dout . out of query t, head h (fp32).
void backward_delta(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);
void backward_simple(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);
void backward_wgmma(const AttentionDesc& desc, const AttentionPointers& p, CUstream_st* stream);

}  // namespace stepgraph::kernels::attention_detail
