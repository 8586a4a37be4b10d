// Context parallelism's ops (Note [Context-parallel token layout] in
// kernels/context_parallel_plan.h): the plan of a rank's attention, computed
// on the device from the global cu_seqlens, and the reordering of a tensor
// gathered from every rank (rank-major: each rank's two chunks) into stream
// order and back.
//
//   ContextParallelPlan plan = ops::context_parallel_plan(ctx, {.ranks = N, .rank = r, .tokens = T}, cu_seqlens);
//   Tensor k_all = ops::zigzag_to_stream(ctx, N, ops::all_gather(ctx, comm, k));   // [T, ...], stream order
//   Tensor dk_mine = ops::reduce_scatter(ctx, comm, ops::zigzag_from_stream(ctx, N, dk_all), ReduceOp::kSum);
//
// Nothing is read on the host: a captured step takes any packing of T
// tokens into S sequences that the host writes into cu_seqlens.
#pragma once

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/op.h"
#include "engine/tensor.h"

namespace stepgraph::ops {

struct ContextParallelParams {
  int ranks = 1;            // N, the context-parallel group's size
  int rank = 0;             // r, this rank's place in it
  std::int64_t tokens = 0;  // T, the global batch (divides by 2N)
  bool causal = true;       // the attention the plan is for

  bool operator==(const ContextParallelParams&) const = default;
  std::string to_string() const;
};

struct ContextParallelPlan {
  ContextParallelParams params;
  Tensor q_offsets;  // int32 [2S + 1]: the local queries' segments
  Tensor kv_ranges;  // int32 [2S, 2]: each segment's keys in the stream-ordered K/V
  Tensor positions;  // int32 [T / N]: each local token's position within its sequence
};

ContextParallelPlan context_parallel_plan(Context& ctx, const ContextParallelParams& params, const Tensor& cu_seqlens);

// x [T, ...] gathered rank-major (rank rho's rows: chunk rho, then chunk
// 2N - 1 - rho) -> the same rows in stream order; and the inverse. T divides by 2N.
Tensor zigzag_to_stream(Context& ctx, int ranks, const Tensor& x);
Tensor zigzag_from_stream(Context& ctx, int ranks, const Tensor& x);

// cu_seqlens -> q_offsets, kv_ranges, positions
const OpDef& context_parallel_plan_op();
// x -> its rows reordered
const OpDef& zigzag_reorder_op();

}  // namespace stepgraph::ops
