// The peer transport of the expert-parallel exchange (Note [Expert-parallel
// exchange] in ops/moe_exchange_ops.h): internal to moe_exchange_ops.
#pragma once

#include <cstdint>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/tensor.h"
#include "kernels/moe_exchange.h"
#include "ops/moe_exchange_ops.h"

namespace stepgraph::ops {

// Routes from counts, then the peer copy: `rows` (dispatch: x_perm [R, H];
// combine: the expert rows [P*R, H]) written into every rank's receive
// buffer; returns this rank's (dispatch [P*R, H], combine [R, H]). Traced
// only (ep_exchange_by_peer_copies).
Tensor ep_peer_move(Context& ctx, Communicator& comm, kernels::EpDirection direction, const Tensor& rows,
                    const Tensor& counts, std::int64_t R, const EpPeerOptions& options);

}  // namespace stepgraph::ops
