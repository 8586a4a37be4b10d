// Expert-parallel exchange ops: a MoE layer's permuted rows go to the ranks
// that own their experts and come back, with every count on the device and
// every shape static, so the exchange traces and captures like any op.
//
//   Tensor counts = ops::ep_counts(ctx, comm, plan.splits);            // int32 [P, E]
//   ops::EpDispatch in = ops::ep_dispatch(ctx, comm, x_perm, counts);  // rows [P*R, H], splits [E/P]
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
// The padded exchange of the bound R is the fallback that needs no peer
// access: it moves P R rows per rank whatever the routing. Nothing reads a
// count on the host, and no routing can overflow a buffer: the plan clamps
// bad counts the same way on every rank. Both directions are pure data
// movement, so each is the other's backward.
#pragma once

#include <cstdint>
#include <string>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/op.h"
#include "engine/tensor.h"
#include "kernels/moe_exchange.h"

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

struct EpDispatch {
  Tensor rows;    // [P*R, H]: by local expert, then by source rank
  Tensor splits;  // int32 [E/P]: rows per local expert
};

// splits int32 [E] -> counts int32 [P, E]: every rank's splits, in rank order.
Tensor ep_counts(Context& ctx, Communicator& comm, const Tensor& splits);
// x_perm [R, H] grouped by global expert; counts from ep_counts.
EpDispatch ep_dispatch(Context& ctx, Communicator& comm, const Tensor& x_perm, const Tensor& counts);
// y_rows [P*R, H] in ep_dispatch's layout -> y_perm [R, H] in x_perm's order.
Tensor ep_combine(Context& ctx, Communicator& comm, const Tensor& y_rows, const Tensor& counts);
// The backwards, by reuse: d x_perm = ep_combine(d rows), d y_rows = ep_dispatch(d y_perm).rows.
Tensor ep_dispatch_backward(Context& ctx, Communicator& comm, const Tensor& d_rows, const Tensor& counts);
Tensor ep_combine_backward(Context& ctx, Communicator& comm, const Tensor& d_y_perm, const Tensor& counts);

const OpDef& ep_splits_row_op();
const OpDef& ep_plan_op();
const OpDef& ep_pack_op();
const OpDef& ep_unpack_op();

}  // namespace stepgraph::ops
