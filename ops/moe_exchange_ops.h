// Expert-parallel exchange ops: a MoE layer's permuted rows go to the ranks
// that own their experts and come back, with every count on the device and
// every shape static, so the exchange traces and captures like any op.
//
//   Tensor counts = ops::ep_counts(ctx, comm, plan.splits);            // int32 [P, E]
//   ops::EpDispatch in = ops::ep_dispatch(ctx, comm, x_perm, counts);  // rows [P*R, H], splits [E/P]
//   (rows past the splits' sum: zero by NCCL, unspecified by peer copies)
//   ...grouped GEMMs over in.rows with in.splits (this rank's experts)...
//   Tensor y_perm = ops::ep_combine(ctx, comm, y_rows, counts);        // [R, H], x_perm's order
//
// Note [Expert-parallel exchange]
// An expert-parallel group of P ranks shares E global experts, E % P == 0:
// rank q owns experts [q L, (q + 1) L), L = E / P. Each rank holds x_perm
// [R, H] (R = tokens * k rows, grouped by global expert, as moe_permute
// makes them) and splits int32 [E] on the device.
//   1. ep_counts all-gathers the splits: counts [P, E], row p = rank p's
//      splits. A collective of static size; the values stay on the device.
//   2. ep_dispatch plans from counts on the device (Note [Expert-parallel
//      plan] in kernels/moe_exchange.h), packs slot q = the rows for rank q's
//      experts (x_perm's rows [c_r[q L], c_r[(q + 1) L]), zero-padded to R
//      rows), exchanges slots with P - 1 send_recv calls (step s sends slot
//      r + s to rank r + s and receives from rank r - s: every rank issues the
//      same sequence, which NCCL matches by order), and unpacks: rows [P R, H]
//      grouped by local expert e, within e by source rank p in rank order;
//      splits [L] the rows per local expert; rows past their sum are zero.
//   3. ep_combine is the reverse: the expert rows [P R, H] in dispatch's
//      layout go back to their source ranks and land at the rows they came
//      from in x_perm's order, so ep_combine(ep_dispatch(x)) == x bit for bit.
// That padded exchange of the bound R is the fallback that needs no peer
// access: it moves P R rows per rank whatever the routing. Traced on a
// communicator whose transport is peer copies (peer_transport(), chosen and
// logged when it is made; ep_exchange_by_peer_copies), dispatch and combine
// move exactly the counted rows instead, straight into the receivers' pool
// values through the captured step's peer window (Note [The pool as
// symmetric memory] in engine/peer_window.h):
//   - ep_routes computes, on the device from counts, where every run of this
//     rank's rows lands in each receiver's buffer, in the layout above (Note
//     [Expert-parallel routes] in kernels/moe_exchange_peer.h).
//   - ep_peer_copy, a collective whose one output is this rank's receive
//     buffer (announced in the window in its first signal slot), takes P
//     slots, s + p pairing with rank p. In stream order on the communication
//     stream: post every peer's ready flag of slot s + r (my buffer is free:
//     every reader of the bytes it reuses is done), await mine from every
//     peer, copy (a kernel of EpPeerOptions::blocks blocks, a few so it runs
//     beside the GEMMs, writes each run into its receiver's buffer through
//     the peer mapping, its own rows locally), post every peer's data flag of
//     slot s + r (after the copy's writes), await all P - 1 data flags: then
//     the buffer is whole and the grouped GEMMs may read it. Each flag has
//     one writer and one waiter, and each waiter clears its flag before the
//     writer can post it again, so the graph replays forever.
//   - Nothing overflows: the routes come from the clamped sums, so a sender
//     writes at most R rows of a dispatch, all below the receiver's bound P R,
//     and a combine returns to each rank at most the c_q[E] <= R rows it sent.
//   - Rows past the received sum are not written: the dispatched buffer keeps
//     whatever the pool held there. Its readers need nothing else: the grouped
//     linears run with SplitSum::kAtMostRows, whose products write zeros past
//     the splits' sum and leave those rows out of every gradient (Note
//     [Expert-parallel MoE] in layers/moe_mlp.h), and ep_combine reads only
//     the counted rows. Zeroing them would cost a write of up to (P - 1) R
//     rows per exchange, more than the routed rows themselves when routing is
//     balanced. A combine does zero its y_perm rows that no expert returns
//     (past c_r[E]: only where counts were clamped), so y_perm is the
//     padded path's bit for bit.
//   - The counts stay an NCCL all-gather: P E int32 values, one small
//     collective; by peer writes it would need the same two rounds of flags
//     as a copy, for no fewer synchronisations.
// Eager calls keep the padded exchange (their buffers are no pool values),
// and so does a communicator without peer copies (another host,
// NCCL_P2P_DISABLE=1; HostWorld(..., peer_copies = false) on host). Both
// transports give the same splits, the same y_perm and the same rows up to
// the sum, bit for bit. Nothing reads a count on the host, and no routing can
// overflow a buffer: the plan clamps bad counts the same way on every rank.
// Both directions are pure data movement, so each is the other's backward.
#pragma once

#include <cstdint>
#include <string>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/op.h"
#include "engine/tensor.h"
#include "kernels/moe_exchange.h"
#include "kernels/moe_exchange_peer.h"

namespace stepgraph::ops {

struct EpPlanParams {
  int rank = 0;           // this rank in the expert-parallel group
  int ranks = 1;          // P
  std::int64_t rows = 0;  // R
  bool operator==(const EpPlanParams&) const = default;
  std::string to_string() const;
};

struct EpCopyParams {
  kernels::EpDirection direction = kernels::EpDirection::kDispatch;
  int rank = 0;
  int ranks = 1;
  std::int64_t rows = 0;     // R
  std::int64_t experts = 0;  // E
  bool operator==(const EpCopyParams&) const = default;
  std::string to_string() const;
};

// How a captured exchange by peer copies runs (the NCCL path ignores it).
struct EpPeerOptions {
  // Thread blocks of the copy kernel, 1 to kernels::kMaxEpPeerCopyBlocks: a
  // few, so the copy runs beside the experts' GEMMs.
  int blocks = 8;
};

// The route table of the peer transport (Note [Expert-parallel routes]).
struct EpRoutesParams {
  kernels::EpDirection direction = kernels::EpDirection::kDispatch;
  int rank = 0;
  int ranks = 1;
  std::int64_t rows = 0;  // R
  bool operator==(const EpRoutesParams&) const = default;
  std::string to_string() const;
};

// The peer copy of one exchange: a collective on `communicator` whose output
// (this rank's receive buffer) its peers write through the captured step's
// peer window, with the flags of signal slots [slot, slot + ranks).
struct EpPeerParams {
  std::uint64_t communicator = 0;
  std::string group;  // the communicator's name, for dumps and errors
  kernels::EpDirection direction = kernels::EpDirection::kDispatch;
  int rank = 0;
  int ranks = 1;
  std::int64_t rows = 0;     // R
  std::int64_t experts = 0;  // E
  std::int64_t slot = 0;
  int blocks = EpPeerOptions{}.blocks;
  bool operator==(const EpPeerParams&) const = default;
  std::string to_string() const;
};

struct EpDispatch {
  Tensor rows;    // [P*R, H]: by local expert, then by source rank
  Tensor splits;  // int32 [E/P]: rows per local expert
};

// splits int32 [E] -> counts int32 [P, E]: every rank's splits, in rank order.
Tensor ep_counts(Context& ctx, Communicator& comm, const Tensor& splits);
// x_perm [R, H] grouped by global expert; counts from ep_counts.
EpDispatch ep_dispatch(Context& ctx, Communicator& comm, const Tensor& x_perm, const Tensor& counts,
                       const EpPeerOptions& options = {});
// y_rows [P*R, H] in ep_dispatch's layout -> y_perm [R, H] in x_perm's order.
Tensor ep_combine(Context& ctx, Communicator& comm, const Tensor& y_rows, const Tensor& counts,
                  const EpPeerOptions& options = {});
// The backwards, by reuse: d x_perm = ep_combine(d rows), d y_rows = ep_dispatch(d y_perm).rows.
Tensor ep_dispatch_backward(Context& ctx, Communicator& comm, const Tensor& d_rows, const Tensor& counts,
                            const EpPeerOptions& options = {});
Tensor ep_combine_backward(Context& ctx, Communicator& comm, const Tensor& d_y_perm, const Tensor& counts,
                           const EpPeerOptions& options = {});

// Whether ep_dispatch / ep_combine traced now on `comm` take the peer
// transport (a traced call on a communicator with peer copies and more than
// one rank); otherwise the padded NCCL exchange.
bool ep_exchange_by_peer_copies(const Context& ctx, const Communicator& comm);

const OpDef& ep_splits_row_op();
const OpDef& ep_plan_op();
const OpDef& ep_pack_op();
const OpDef& ep_unpack_op();
const OpDef& ep_routes_op();
const OpDef& ep_peer_copy_op();

}  // namespace stepgraph::ops
