// What the expert-parallel exchange's ops share (the plan and padded copies
// in moe_exchange_ops.cc, the routes and peer copy in moe_exchange_peer.cc):
// the counts operand and its check, and the kernels' descriptors from an op's
// parameters. Internal to moe_exchange_ops.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/op.h"
#include "kernels/moe_exchange.h"

namespace stepgraph::ops {

// Every rank's splits, gathered by ep_counts: int32 [P, E].
template <typename F>
struct EpCountsOperands {
  F counts;
};

template <typename P, typename F, typename V>
void visit_operands(const P&, EpCountsOperands<F>& o, V& v) {
  v({"counts"}, o.counts);
}

inline const char* ep_direction_name(kernels::EpDirection direction) {
  return direction == kernels::EpDirection::kDispatch ? "dispatch" : "combine";
}

inline void check_ep_counts(std::string_view op, const TensorMeta& counts, int ranks) {
  SG_CHECK(counts.dtype == DType::kInt32, "op ", op, ": counts must be int32 (from ep_counts), got ",
           dtype_name(counts.dtype));
  SG_CHECK(counts.shape.rank() == 2 && counts.shape.dim(0) == ranks, "op ", op,
           ": counts must be int32 [P, E] with P = ", ranks, " (the expert-parallel ranks), got ", counts.shape,
           "; make them with ep_counts on the same communicator");
}

// The plan of an op's parameters p (rank, ranks, rows) over E experts.
template <typename P>
kernels::EpPlanDesc ep_plan_desc(const P& p, std::int64_t experts) {
  return {p.rank, p.ranks, experts, p.rows};
}

// The row copy of an op's parameters p (ep_plan_desc's, experts, direction)
// moving rows of `rows` [*, H].
template <typename P>
kernels::EpCopyDesc ep_copy_desc(const P& p, const TensorMeta& rows) {
  return {ep_plan_desc(p, p.experts), p.direction,
          static_cast<std::size_t>(rows.shape.dim(1)) * dtype_size(rows.dtype)};
}

}  // namespace stepgraph::ops
