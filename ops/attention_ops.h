// Causal self-attention over packed sequences and the fused QKV split with
// rotary embedding (kernels/attention.h, kernels/rope.h) as ops. Tensors
// are 2-D, heads side by side in a row, so the projections around them are
// plain Linears:
//
//   QkvSplit s = ops::qkv_split_rope(ctx, rope, qkv, cu_seqlens);   // qkv [T, (H + 2 Hkv) D]
//   AttentionForward a = ops::attention_forward(ctx, params, s.q, s.k, s.v, cu_seqlens);
//   // a.out [T, H D], a.lse fp32 [H, T]: saved for the backward
//   AttentionGrads g = ops::attention_backward(ctx, params, s.q, s.k, s.v, a.out, a.lse, dout, cu_seqlens);
//   Tensor dqkv = ops::qkv_merge_rope_backward(ctx, rope, g.dq, g.dk, g.dv, cu_seqlens);
//
// Segment attention (Note [Segment attention] in kernels/attention.h): the
// queries' segments and the keys each reads, in separate layouts, e.g. a
// context-parallel rank's queries over the gathered K/V:
//
//   AttentionForward a = ops::segment_attention_forward(ctx, params, q, k, v, q_offsets, kv_ranges);
//   // q [Tq, H D], k, v [Tk, Hkv D], q_offsets int32 [G + 1], kv_ranges int32 [G, 2]
//   AttentionGrads g = ops::segment_attention_backward(ctx, params, q, k, v, a.out, a.lse, dout,
//                                                      q_offsets, kv_ranges);  // dk, dv [Tk, Hkv D]
//
// cu_seqlens is int32 [S + 1] (S >= 1): read on the device only, so a
// captured step takes any packing of the same T and S that the host writes
// into it between replays (it is a step input, bound like the tokens).
#pragma once

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/attention.h"
#include "kernels/rope.h"

namespace stepgraph::ops {

struct AttentionParams {
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;  // divides heads
  std::int64_t head_dim = 0;
  bool causal = true;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)

  bool operator==(const AttentionParams&) const = default;
  std::string to_string() const;
};

struct RopeParams {
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t rotary_dim = 0;  // 0: head_dim
  float base = 10000.0f;

  bool operator==(const RopeParams&) const = default;
  std::string to_string() const;
};

struct QkvSplit {
  Tensor q;  // [T, H D], rotated
  Tensor k;  // [T, Hkv D], rotated
  Tensor v;  // [T, Hkv D]
};

struct AttentionForward {
  Tensor out;  // [T, H D], q's dtype
  Tensor lse;  // fp32 [H, T]
};

struct AttentionGrads {
  Tensor dq;  // [T, H D]
  Tensor dk;  // [T, Hkv D]
  Tensor dv;  // [T, Hkv D]
};

QkvSplit qkv_split_rope(Context& ctx, const RopeParams& params, const Tensor& qkv, const Tensor& cu_seqlens);
Tensor qkv_merge_rope_backward(Context& ctx, const RopeParams& params, const Tensor& dq, const Tensor& dk,
                               const Tensor& dv, const Tensor& cu_seqlens);
// The same at given rotary positions, int32 [T] (a context-parallel rank's
// tokens: ContextParallelPlan::positions) instead of cu_seqlens'; other ops
// (other keys), the same kernels.
QkvSplit qkv_split_rope_at(Context& ctx, const RopeParams& params, const Tensor& qkv, const Tensor& positions);
Tensor qkv_merge_rope_backward_at(Context& ctx, const RopeParams& params, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, const Tensor& positions);
AttentionForward attention_forward(Context& ctx, const AttentionParams& params, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& cu_seqlens);
AttentionGrads attention_backward(Context& ctx, const AttentionParams& params, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  const Tensor& cu_seqlens);

AttentionForward segment_attention_forward(Context& ctx, const AttentionParams& params, const Tensor& q,
                                           const Tensor& k, const Tensor& v, const Tensor& q_offsets,
                                           const Tensor& kv_ranges);
AttentionGrads segment_attention_backward(Context& ctx, const AttentionParams& params, const Tensor& q,
                                          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                                          const Tensor& dout, const Tensor& q_offsets, const Tensor& kv_ranges);

// qkv, cu_seqlens -> q, k, v
const OpDef& qkv_split_rope_op();
// dq, dk, dv, cu_seqlens -> dqkv
const OpDef& qkv_merge_rope_backward_op();
// qkv, positions -> q, k, v
const OpDef& qkv_split_rope_at_op();
// dq, dk, dv, positions -> dqkv
const OpDef& qkv_merge_rope_backward_at_op();
// q, k, v, cu_seqlens -> out, lse
const OpDef& attention_forward_op();
// q, k, v, out, lse, dout, cu_seqlens -> dq, dk, dv, workspace (uint8 scratch)
const OpDef& attention_backward_op();
// q, k, v, q_offsets, kv_ranges -> out, lse
const OpDef& segment_attention_forward_op();
// q, k, v, out, lse, dout, q_offsets, kv_ranges -> dq, dk, dv, scratch
const OpDef& segment_attention_backward_op();

}  // namespace stepgraph::ops
