#include "layers/context_parallel_attention.h"

#include <string_view>

#include "engine/error.h"
#include "ops/collective_ops.h"

namespace stepgraph {
namespace {

// The plan is this rank's, for this attention, and q holds this rank's share of its tokens.
void check_plan(std::string_view what, const Communicator& cp, const ops::AttentionParams& params,
                const ops::ContextParallelPlan& plan, const Tensor& q) {
  const ops::ContextParallelParams& p = plan.params;
  SG_CHECK(p.ranks == cp.world_size() && p.rank == cp.rank(), what, ": the plan is for rank ", p.rank, " of ", p.ranks,
           " but runs on ", cp.describe(), "; make it with .ranks = cp.world_size(), .rank = cp.rank()");
  SG_CHECK(p.causal == params.causal, what, ": the plan is for ", p.causal ? "causal" : "non-causal",
           " attention but params.causal is ", params.causal ? "true" : "false",
           "; make the plan with the attention's causal");
  SG_CHECK(q.shape().rank() == 2 && q.shape().dim(0) * p.ranks == p.tokens, what, ": q must hold this rank's ",
           p.tokens / p.ranks, " of the plan's ", p.tokens, " tokens, got ", q.shape());
}

// x of every rank, in stream order: [T, ...].
Tensor gather_stream(Context& ctx, Communicator& cp, const Tensor& x) {
  return ops::zigzag_to_stream(ctx, cp.world_size(), ops::all_gather(ctx, cp, x));
}

// The sum over ranks of x [T, ...] (stream order), this rank's rows.
Tensor reduce_to_owner(Context& ctx, Communicator& cp, const Tensor& x) {
  return ops::reduce_scatter(ctx, cp, ops::zigzag_from_stream(ctx, cp.world_size(), x), ReduceOp::kSum);
}

}  // namespace

ops::AttentionForward context_parallel_attention_forward(Context& ctx, Communicator& cp,
                                                         const ops::AttentionParams& params,
                                                         const ops::ContextParallelPlan& plan, const Tensor& q,
                                                         const Tensor& k, const Tensor& v) {
  check_plan("context-parallel attention forward", cp, params, plan, q);
  const Tensor k_all = gather_stream(ctx, cp, k);
  const Tensor v_all = gather_stream(ctx, cp, v);
  return ops::segment_attention_forward(ctx, params, q, k_all, v_all, plan.q_offsets, plan.kv_ranges);
}

ops::AttentionGrads context_parallel_attention_backward(Context& ctx, Communicator& cp,
                                                        const ops::AttentionParams& params,
                                                        const ops::ContextParallelPlan& plan, const Tensor& q,
                                                        const Tensor& k, const Tensor& v, const Tensor& out,
                                                        const Tensor& lse, const Tensor& dout) {
  check_plan("context-parallel attention backward", cp, params, plan, q);
  const Tensor k_all = gather_stream(ctx, cp, k);
  const Tensor v_all = gather_stream(ctx, cp, v);
  const ops::AttentionGrads all =
      ops::segment_attention_backward(ctx, params, q, k_all, v_all, out, lse, dout, plan.q_offsets, plan.kv_ranges);
  return {.dq = all.dq, .dk = reduce_to_owner(ctx, cp, all.dk), .dv = reduce_to_owner(ctx, cp, all.dv)};
}

}  // namespace stepgraph
