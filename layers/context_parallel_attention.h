// Context-parallel attention: each rank of a CP group holds T / N tokens of
// the global batch (Note [Context-parallel token layout] in
// kernels/context_parallel_plan.h) and computes its queries' attention over
// every rank's keys and values.
//
// Note [Context-parallel attention by all-gather]
// Forward: K and V are all-gathered (one all-gather each, every rank's two
// chunks), put in stream order (zigzag_to_stream), and the rank's queries
// attend to them through the plan's segment table (segment attention,
// bottom-right causal): each query sees exactly the keys it sees on one rank
// over the whole batch, summed in the same order, so out and lse are one
// rank's bits wherever the kernels are the same (no sum crosses ranks).
// Backward: K and V are gathered again (only the local q, k, v, out and lse
// are saved: a long context's gathered K/V would be N times the local
// tensors, kept per layer until its backward), the segment backward gives dq
// (local; one rank's bits on the host and the plain kernels, within rounding
// on the tensor cores, whose segment backward tiles the keys by 128 tokens
// of T rather than of each sequence) and partial dk, dv of all T tokens, and a
// reduce-scatter (after zigzag_from_stream) adds every rank's partials into
// their owners' rows: dk and dv sum across ranks, in the dtype of q.
// Everything is ops (collectives on the communication stream, buffers in the
// pool, nothing read on the host), so eager equals graph.
//
//   const ops::ContextParallelPlan plan =
//       ops::context_parallel_plan(ctx, {.ranks = cp.world_size(), .rank = cp.rank(), .tokens = T}, cu_seqlens);
//   ops::AttentionForward f = context_parallel_attention_forward(ctx, cp, params, plan, q, k, v);
//   ops::AttentionGrads g = context_parallel_attention_backward(ctx, cp, params, plan, q, k, v, f.out, f.lse, dout);
//
// The ring of KV blocks that overlaps the exchange with the attention is the
// other algorithm (DESIGN.md). Measured bound (the GPT `long` at CP=2, 32k,
// two H200s, benchmarks/results/step_bench_cp2_long_2xh200.log): the
// graphed step's all-gathers and reduce-scatters take 16.6 ms on the
// communication stream and all its exposed communication, the gradient
// all-reduce's included, is 13.3 ms of 277.9 (5%), while the attention
// kernels take 180 ms; a ring could win at most those 5% and would split
// each rank's attention into 2N - 1 launches of smaller blocks merged by
// log-sum-exp. All-gather stays until the attention itself is faster.
#pragma once

#include "engine/communicator.h"
#include "engine/context.h"
#include "ops/attention_ops.h"
#include "ops/context_parallel_ops.h"

namespace stepgraph {

// q [T / N, H D], k, v [T / N, Hkv D]: this rank's tokens (its two chunks, in
// order). Returns out [T / N, H D] and lse fp32 [H, T / N].
ops::AttentionForward context_parallel_attention_forward(Context& ctx, Communicator& cp,
                                                         const ops::AttentionParams& params,
                                                         const ops::ContextParallelPlan& plan, const Tensor& q,
                                                         const Tensor& k, const Tensor& v);

// dq, dk, dv of this rank's tokens, from the forward's inputs, out, lse and dout.
ops::AttentionGrads context_parallel_attention_backward(Context& ctx, Communicator& cp,
                                                        const ops::AttentionParams& params,
                                                        const ops::ContextParallelPlan& plan, const Tensor& q,
                                                        const Tensor& k, const Tensor& v, const Tensor& out,
                                                        const Tensor& lse, const Tensor& dout);

}  // namespace stepgraph
