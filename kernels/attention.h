// Causal self-attention over packed variable-length sequences:
// the CUDA kernels (attention.cu: flash-attention style, online softmax, no
// S x S matrix) and their plain fp32 host reference (attention_host.cc).
//
// Layout (flash-attention's varlen layout): the sequences of a batch are
// packed end to end into T tokens; cu_seqlens int32 [S + 1] holds their
// starts (cu_seqlens[0] = 0, cu_seqlens[S] = T, non-decreasing; a sequence
// may be empty). Per token:
//   q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]   (bf16 or fp32; Hkv divides H:
//                                                 grouped-query attention, query
//                                                 head h reads kv head h / (H / Hkv))
//   out [T, H, D]  (q's dtype),  lse fp32 [H, T]  (the log-sum-exp of each
//                                                 query's scaled scores, saved
//                                                 for the backward)
// Token i of a sequence attends to tokens j <= i of the same sequence
// (causal) or to all of them (causal = false), with scores scale * q.k.
//
// Backward, from dout [T, H, D]: dq [T, H, D], dk and dv [T, Hkv, D] (q's
// dtype; a kv head's gradients sum over the query heads that read it).
// With P = exp(scale q.k - lse) recomputed from the saved lse:
//   dv_j = sum_i P_ij dout_i     dP_ij = dout_i . v_j     delta_i = dout_i . out_i
//   dS_ij = P_ij (dP_ij - delta_i)   dq_i = scale sum_j dS_ij k_j   dk_j = scale sum_i dS_ij q_i
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"
#include "kernels/host_device.h"

struct CUstream_st;

namespace stepgraph::kernels {

struct AttentionDesc {
  DType dtype = DType::kBFloat16;  // q, k, v, out and the gradients
  std::int64_t tokens = 0;         // T, all sequences packed
  std::int64_t sequences = 0;      // S
  std::int64_t heads = 0;          // H, query heads
  std::int64_t kv_heads = 0;       // Hkv, divides H
  std::int64_t head_dim = 0;       // D
  bool causal = true;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)

  float softmax_scale() const;
};

// An Error naming what is wrong: dtype not bf16/fp16/fp32, a non-positive
// size, kv_heads not dividing heads, a negative or non-finite scale.
void check_attention(const AttentionDesc& desc);

// --- CUDA ------------------------------------------------------------------
// Device pointers. cu_seqlens is read on the device only (never copied to
// the host), so a captured launch takes any packing of the same T and S; the
// kernels read cu_seqlens[0] as 0 and cu_seqlens[S] as T, and the entries
// between clamped into [0, T] and made non-decreasing (Note [Safe cu_seqlens]
// in kernels/tile/attention_tile.cuh), so whatever it holds nothing is read or
// written out of bounds: a malformed packing gives that valid packing's
// result, never a fault. The grid is sized from T, S and H alone. Results are
// deterministic: no atomics on the gradients, so two launches on the same
// inputs give the same bits (eager == graph).

// Whether the tensor-core kernels run this shape (bf16 or fp16, head_dim 64
// or 128; Hopper: TMA + wgmma, warp-specialised, FlashAttention-3 style;
// the backward in one pass with dQ summed in a fixed order, Note [Attention
// backward in one pass, deterministic]); otherwise the plain kernels run
// it (any dtype, head_dim <= 256; correct, not fast). The launchers also take
// the plain kernels when a tensor's pointer is not 16-byte aligned.
bool attention_uses_tensor_cores(const AttentionDesc& desc);

// An Error unless the CUDA kernels take this shape (check_attention,
// head_dim <= 256, tokens * heads and sequences < 2^31).
void check_attention_cuda(const AttentionDesc& desc);

void launch_attention_forward(const AttentionDesc& desc, const void* q, const void* k, const void* v,
                              const std::int32_t* cu_seqlens, void* out, float* lse, CUstream_st* stream);

// Device scratch the backward needs (fp32 delta = rowsum(dout * out) [H, T];
// on the tensor-core path also fp32 dQ sums [T, H, D] and int32 semaphores
// [H, T]), 256-byte aligned by the caller.
std::size_t attention_backward_workspace_bytes(const AttentionDesc& desc);

void launch_attention_backward(const AttentionDesc& desc, const void* q, const void* k, const void* v,
                               const void* out, const float* lse, const void* dout, const std::int32_t* cu_seqlens,
                               void* dq, void* dk, void* dv, void* workspace, CUstream_st* stream);

// --- Segment attention: queries and keys in separate layouts ------------------
//
// Note [Segment attention]
// The queries q [Tq, H, D] are cut into G segments by q_offsets int32 [G + 1]
// (a packing of the Tq query tokens, as cu_seqlens packs sequences; a segment
// may be empty), and segment g reads the kv tokens [kv_ranges[g][0],
// kv_ranges[g][1]) of k, v [Tk, Hkv, D] (kv_ranges int32 [G, 2]). Causal is
// bottom-right aligned: query j (0-based) of a segment of q_len queries and
// k_len keys sees the range's first k_len - q_len + j + 1 keys (clipped to
// [0, k_len]); non-causal sees the whole range. A query that sees no key
// (k_len < q_len, or an empty range) gets out 0 and lse -inf, and adds
// nothing to any gradient. The keys a query sees are summed in token order,
// as the self-attention kernels do: self-attention over cu_seqlens is the
// case q_offsets = cu_seqlens, kv_ranges[s] = [cu[s], cu[s + 1]), and gives
// the same bits on the host reference and on the plain CUDA kernels.
// Context parallelism (kernels/context_parallel_plan.h) is the case where
// each segment is a rank's piece of a sequence and its range the sequence's
// tokens up to the piece's end, in the gathered K/V.
//
// Backward, from dout [Tq, H, D]: dq [Tq, H, D]; dk and dv [Tk, Hkv, D] over
// every kv token, zero where no query reads it (a key read by several
// segments sums them in segment order; no atomics).
//
// On the device q_offsets is read as Note [Safe cu_seqlens] reads cu_seqlens
// (over Tq) and each range is clamped (begin into [0, Tk], end into [begin,
// Tk]), so whatever the table holds nothing is read or written out of bounds,
// and a captured launch takes any table of the same G.
// Kernels: where attention_uses_tensor_cores would take the same desc (and
// the pointers are 16-byte aligned), the tensor-core forward and backward of
// self-attention, given the table (attention_forward.cu, attention_backward.cu:
// the same mainloops; a forward block per (segment's query tile, head) reads
// the segment's range; a backward block per (tile of 128 kv tokens, kv head)
// walks the segments whose ranges meet its keys, in segment order). Otherwise
// the plain kernels (attention_segments.cu: any dtype, head_dim <= 256).
struct SegmentAttentionDesc {
  AttentionDesc attention;     // tokens: the query tokens Tq; sequences: the segments G
  std::int64_t kv_tokens = 0;  // Tk
};

// The number of keys query j (0-based) of a segment of q_len queries sees
// among the segment's k_len keys (Note [Segment attention]).
SG_HOST_DEVICE std::int64_t segment_visible_keys(bool causal, std::int64_t q_len, std::int64_t k_len, std::int64_t j) {
  if (!causal) return k_len;
  const std::int64_t n = k_len - q_len + j + 1;
  return n < 0 ? 0 : (n > k_len ? k_len : n);
}

// check_attention, and kv_tokens > 0.
void check_segment_attention(const SegmentAttentionDesc& desc);

// Whether the segment launchers take the tensor-core kernels for this shape:
// exactly when attention_uses_tensor_cores(desc.attention) (and, at launch,
// every tensor's pointer is 16-byte aligned).
bool segment_attention_uses_tensor_cores(const SegmentAttentionDesc& desc);
// check_segment_attention and the CUDA kernels' limits (head_dim <= 256,
// Tq * H, Tk * Hkv and G < 2^31).
void check_segment_attention_cuda(const SegmentAttentionDesc& desc);

void launch_segment_attention_forward(const SegmentAttentionDesc& desc, const void* q, const void* k, const void* v,
                                      const std::int32_t* q_offsets, const std::int32_t* kv_ranges, void* out,
                                      float* lse, CUstream_st* stream);

// Device scratch of the segment backward (fp32 delta [H, Tq]; on the
// tensor-core path also fp32 dQ sums [Tq, H, D] and int32 semaphores [H, Tq],
// as attention_backward_workspace_bytes), 256-byte aligned by the caller.
std::size_t segment_attention_backward_workspace_bytes(const SegmentAttentionDesc& desc);

void launch_segment_attention_backward(const SegmentAttentionDesc& desc, const void* q, const void* k,
                                       const void* v, const void* out, const float* lse, const void* dout,
                                       const std::int32_t* q_offsets, const std::int32_t* kv_ranges, void* dq,
                                       void* dk, void* dv, void* workspace, CUstream_st* stream);

namespace host {

// An Error unless cu_seqlens (host memory, desc.sequences + 1 entries)
// starts at 0, never decreases and ends at desc.tokens.
void check_cu_seqlens(const AttentionDesc& desc, const std::int32_t* cu_seqlens);

// out and lse from q, k, v (host memory): fp32 arithmetic, two passes over
// each query's scores (max, then exp and sums). Every query sees at least
// one key (itself, when causal), so the softmax is always defined.
void attention_forward(const AttentionDesc& desc, const void* q, const void* k, const void* v,
                       const std::int32_t* cu_seqlens, void* out, float* lse);

// dq, dk, dv (overwritten) from the forward's tensors and dout.
void attention_backward(const AttentionDesc& desc, const void* q, const void* k, const void* v, const void* out,
                        const float* lse, const void* dout, const std::int32_t* cu_seqlens, void* dq, void* dk,
                        void* dv);

// An Error unless q_offsets (desc.attention.sequences + 1 entries) packs the
// desc.attention.tokens queries and every kv range lies in [0, kv_tokens)
// with begin <= end.
void check_segments(const SegmentAttentionDesc& desc, const std::int32_t* q_offsets, const std::int32_t* kv_ranges);

// Note [Segment attention] on host memory, with the arithmetic of
// attention_forward / attention_backward above.
void segment_attention_forward(const SegmentAttentionDesc& desc, const void* q, const void* k, const void* v,
                               const std::int32_t* q_offsets, const std::int32_t* kv_ranges, void* out, float* lse);
void segment_attention_backward(const SegmentAttentionDesc& desc, const void* q, const void* k, const void* v,
                                const void* out, const float* lse, const void* dout, const std::int32_t* q_offsets,
                                const std::int32_t* kv_ranges, void* dq, void* dk, void* dv);

}  // namespace host
}  // namespace stepgraph::kernels
