// The expert-parallel exchange by peer copies (the peer transport of Note
// [Expert-parallel exchange] in ops/moe_exchange_ops.h): a route table from
// every rank's device counts, and one copy kernel that writes this rank's
// rows straight into every receiver's buffer, exactly the counted rows. The
// flags around the copy are the op's (ops/moe_exchange_ops.h).
//
//   ep_routes     counts int32 [P, E] -> routes int32 [ep_route_ints]
//   ep_peer_copy  rows -> receivers[q] for every rank q (dispatch: x_perm
//                 [R, H] -> [P*R, H] buffers; combine: the expert rows
//                 [P*R, H] -> y_perm [R, H] buffers)
//
// Note [Expert-parallel routes]
// With c_p[g] the clamped running sums of rank p's counts (Note
// [Expert-parallel plan]: the same numbers on every rank) and L = E / P,
// segment (e, p) of rank q's dispatched rows (the rows rank p sends to q's
// local expert e) starts at
//   D(q, e, p) = sum_{p'} (c_p'[qL + e] - c_p'[qL]) + sum_{p' < p} (c_p'[qL + e + 1] - c_p'[qL + e])
// (every rank's rows of q's experts before e, then the ranks before p) and
// holds c_p[qL + e + 1] - c_p[qL + e] rows. Rank r writes segments t = q L + e
// (q the receiver, e its local expert), each a run of rows:
//   dispatch  x_perm rows from c_r[qL + e]       -> q's rows from D(q, e, r)
//   combine   expert rows from D(r, e, q)         -> q's y_perm rows from c_q[rL + e]
// The table of rank r and one direction:
//   clamped [P][E + 1]  c_p[g], every rank's (the kernel's own scratch, kept)
//   start   [E + 1]     where segment t starts in the rows this rank writes
//                       (a scan of the lengths; start[E] is their sum)
//   src     [E]         the segment's first row in this rank's input
//   dst     [E]         its first row in the receiver's buffer
//   filled  [1]         rows of this rank's own output that receive a row:
//                       dispatch the sum of its local splits, combine c_r[E]
// Every offset is built from clamped sums, so a dispatch writes at most R
// rows below P*R in each receiver and a combine at most c_q[E] <= R rows of
// q's y_perm: no routing can overflow a receive buffer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/moe_exchange.h"

namespace stepgraph::kernels {

// Entries of a route table (Note [Expert-parallel routes]).
constexpr std::int64_t ep_route_ints(const EpPlanDesc& d) {
  return d.ranks * (d.experts + 1) + (d.experts + 1) + 2 * d.experts + 1;
}

// The most thread blocks a peer copy may take (it runs beside the GEMMs).
inline constexpr int kMaxEpPeerCopyBlocks = 132;

// 1 <= blocks <= kMaxEpPeerCopyBlocks, besides check_ep_copy.
void check_ep_peer_copy(const EpCopyDesc& desc, int blocks);

// counts [P, E] -> routes [ep_route_ints] of this rank and direction.
void launch_ep_routes(const EpPlanDesc& desc, EpDirection direction, const std::int32_t* counts, std::int32_t* routes,
                      cudaStream_t stream);
// rows -> receivers[q] for every rank q ([P*R, H] for a dispatch, [R, H] for
// a combine; receivers[rank] is this rank's own output), the rows of the
// routes only, by `blocks` blocks. A combine also zeroes its own output's
// rows past `filled` (rows no expert returns); a dispatch leaves the rows of
// its buffers past the received sum as they are.
void launch_ep_peer_copy(const EpCopyDesc& desc, int blocks, const std::int32_t* routes, const void* rows,
                         void* const* receivers, cudaStream_t stream);

namespace host {
void ep_routes(const EpPlanDesc& desc, EpDirection direction, const std::int32_t* counts, std::int32_t* routes);
void ep_peer_copy(const EpCopyDesc& desc, const std::int32_t* routes, const void* rows, void* const* receivers);
}  // namespace host

}  // namespace stepgraph::kernels
