// The route table of the expert-parallel peer copy and the row each step of
// the copy moves (Note [Expert-parallel routes] in kernels/moe_exchange_peer.h).
// Shared by the CUDA kernels and the host references, so both move the same
// rows. Compiled by nvcc (host and device) and by the host compiler.
#pragma once

#include <cstdint>

#include "kernels/moe_exchange.cuh"
#include "kernels/moe_exchange_peer.h"

namespace stepgraph::kernels::ep {

// Where each table of a route table starts.
struct RouteOffsets {
  std::int64_t clamped, start, src, dst, filled;
};

SG_EP_HD RouteOffsets route_offsets(const EpPlanDesc& d) {
  const std::int64_t clamped = 0;
  const std::int64_t start = clamped + d.ranks * (d.experts + 1);
  const std::int64_t src = start + d.experts + 1;
  const std::int64_t dst = src + d.experts;
  return {clamped, start, src, dst, dst + d.experts};
}

// D(q, e, p): where segment (e, p) starts in rank q's dispatched rows, from
// the clamped sums `clamped` [P][E + 1].
SG_EP_HD std::int64_t segment_row(const EpPlanDesc& d, const std::int32_t* clamped, std::int64_t q, std::int64_t e,
                                  std::int64_t p) {
  const std::int64_t W = d.experts + 1, L = d.local_experts(), g = q * L + e;
  std::int64_t row = 0;
  for (std::int64_t other = 0; other < d.ranks; ++other) {
    const std::int32_t* c = clamped + other * W;
    row += c[g] - c[q * L];
    if (other < p) row += c[g + 1] - c[g];
  }
  return row;
}

// One run of rows rank d.rank writes: `rows` rows from input row `src` to the
// receiver's row `dst`.
struct Segment {
  std::int64_t rows, src, dst;
};

// Segment t = q L + e (q the receiver, e its local expert).
SG_EP_HD Segment route_segment(const EpPlanDesc& d, EpDirection direction, const std::int32_t* clamped,
                               std::int64_t t) {
  const std::int64_t W = d.experts + 1, L = d.local_experts(), q = t / L, e = t % L;
  if (direction == EpDirection::kDispatch) {
    const std::int32_t* c = clamped + d.rank * W;
    const std::int64_t g = q * L + e;
    return {c[g + 1] - c[g], c[g], segment_row(d, clamped, q, e, d.rank)};
  }
  const std::int32_t* c = clamped + q * W;
  const std::int64_t g = d.rank * L + e;
  return {c[g + 1] - c[g], segment_row(d, clamped, d.rank, e, q), c[g]};
}

// Rows of this rank's own output that receive a row.
SG_EP_HD std::int64_t route_filled(const EpPlanDesc& d, EpDirection direction, const std::int32_t* clamped) {
  const std::int64_t W = d.experts + 1, L = d.local_experts();
  if (direction == EpDirection::kCombine) return clamped[d.rank * W + d.experts];
  std::int64_t rows = 0;
  for (std::int64_t p = 0; p < d.ranks; ++p) rows += clamped[p * W + (d.rank + 1) * L] - clamped[p * W + d.rank * L];
  return rows;
}

// Rows of each receiver's buffer: [P*R] for a dispatch, y_perm [R] for a combine.
SG_EP_HD std::int64_t receiver_rows(const EpCopyDesc& c) {
  return c.direction == EpDirection::kDispatch ? c.plan.ranks * c.plan.rows : c.plan.rows;
}

// Rows the copy writes: the routes' rows, then (a combine) its own output's
// rows past `filled`, zeroed.
SG_EP_HD std::int64_t peer_copy_rows(const EpCopyDesc& c, const std::int32_t* routes) {
  const RouteOffsets at = route_offsets(c.plan);
  const std::int64_t routed = routes[at.start + c.plan.experts];
  if (c.direction == EpDirection::kDispatch) return routed;
  const std::int64_t filled = routes[at.filled];
  return routed + (filled < c.plan.rows ? c.plan.rows - filled : 0);
}

// Step o of the copy: receiver `receiver`'s row `dst` gets input row `src`
// (-1: zero).
struct PeerRow {
  int receiver;
  std::int64_t dst, src;
};

SG_EP_HD PeerRow peer_copy_row(const EpCopyDesc& c, const std::int32_t* routes, std::int64_t o) {
  const EpPlanDesc& d = c.plan;
  const RouteOffsets at = route_offsets(d);
  const std::int32_t* start = routes + at.start;
  if (o >= start[d.experts]) return {d.rank, routes[at.filled] + (o - start[d.experts]), -1};
  const std::int64_t t = last_at_most(start, d.experts, 1, o);
  const std::int64_t k = o - start[t];
  return {static_cast<int>(t / d.local_experts()), routes[at.dst + t] + k, routes[at.src + t] + k};
}

}  // namespace stepgraph::kernels::ep
