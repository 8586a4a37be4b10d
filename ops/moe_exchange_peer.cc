// The expert-parallel exchange by peer copies: the route table op and the
// peer copy op, whose protocol is Note [Expert-parallel exchange]'s (in
// ops/moe_exchange_ops.h) over the flags of Note [The pool as symmetric
// memory] (engine/peer_window.h).
#include "ops/moe_exchange_peer.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/peer_window.h"
#include "kernels/moe_exchange_peer.h"
#include "ops/moe_exchange_operands.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

constexpr std::string_view kRoutes = "ep_routes";
constexpr std::string_view kPeerCopy = "ep_peer_copy";

}  // namespace

std::string EpRoutesParams::to_string() const {
  return detail::concat(ep_direction_name(direction), " rank=", rank, "/", ranks, " rows=", rows);
}

std::string EpPeerParams::to_string() const {
  return detail::concat("comm=", group, "#", communicator, " ", ep_direction_name(direction), " rank=", rank, "/",
                        ranks, " rows=", rows, " experts=", experts, " slot=", slot, " blocks=", blocks);
}

namespace {

// --- operands -----------------------------------------------------------------

template <typename F>
struct EpPeerCopyOperands {
  F rows;    // dispatch: x_perm [R, H]; combine: the expert rows [P*R, H]
  F routes;  // int32 [ep_route_ints] (ep_routes' of the same direction)
};

template <typename F, typename V>
void visit_operands(const EpPeerParams&, EpPeerCopyOperands<F>& o, V& v) {
  v({"rows"}, o.rows);
  v({"routes"}, o.routes);
}

// --- checks -----------------------------------------------------------------------

std::vector<TensorMeta> check_routes(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<EpRoutesParams>();
  const auto o = bind_metas<EpCountsOperands>(kRoutes, p, in);
  check_ep_counts(kRoutes, o.counts, p.ranks);
  const kernels::EpPlanDesc desc = ep_plan_desc(p, o.counts.shape.dim(1));
  kernels::check_ep_plan(desc);
  return {TensorMeta{Shape{kernels::ep_route_ints(desc)}, DType::kInt32}};
}

std::vector<TensorMeta> check_peer_copy(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<EpPeerParams>();
  const auto o = bind_metas<EpPeerCopyOperands>(kPeerCopy, p, in);
  const bool dispatch = p.direction == kernels::EpDirection::kDispatch;
  const std::int64_t in_rows = dispatch ? p.rows : p.ranks * p.rows;
  SG_CHECK(o.rows.shape.rank() == 2 && o.rows.shape.dim(0) == in_rows, "op ", kPeerCopy, ": rows must be [", in_rows,
           ", H] (", dispatch ? "x_perm" : "ep_dispatch's rows", "), got ", o.rows.shape);
  const kernels::EpCopyDesc desc = ep_copy_desc(p, o.rows);
  kernels::check_ep_plan(desc.plan);
  const TensorMeta want{Shape{kernels::ep_route_ints(desc.plan)}, DType::kInt32};
  SG_CHECK(o.routes == want, "op ", kPeerCopy, ": routes must be ", want.shape, " int32 (ep_routes'), got ",
           o.routes.shape, " ", dtype_name(o.routes.dtype));
  kernels::check_ep_peer_copy(desc, p.blocks);
  SG_CHECK(p.slot >= 0, "op ", kPeerCopy, ": a signal slot must be taken (Communicator::take_signal_slots), got ",
           p.slot);
  return {TensorMeta{Shape{dispatch ? p.ranks * p.rows : p.rows, o.rows.shape.dim(1)}, o.rows.dtype}};
}

CollectiveCall peer_copy_collective(const OpParams& params) {
  const auto& p = params.as<EpPeerParams>();
  // Every rank's call must take the same slots (their flags pair up).
  return {p.communicator, -1, -1,
          detail::concat("group=", p.group, " size=", p.ranks, " ", ep_direction_name(p.direction), " slot=", p.slot,
                         " experts=", p.experts),
          p.slot};
}

// Note [Expert-parallel exchange]: ready flags, the copy, data flags. Rank
// r's flags of slot `slot + p` pair with rank p: p posts them, r awaits them.
void peer_copy_run(const OpParams& params, const KernelArgs& a, CUstream_st* stream, bool on_cuda) {
  const auto& p = params.as<EpPeerParams>();
  const auto o = bind_args<EpPeerCopyOperands>(p, a);
  void* out = a.outputs[0];
  const std::int64_t bytes = a.output_metas[0].bytes();
  Communicator& comm = find_communicator(p.communicator);
  const auto window = find_peer_window(p.communicator, p.slot, out);
  SG_CHECK_CODE(window != nullptr, ErrorCode::kInvalidState, "op ", kPeerCopy, " (", p.to_string(),
                "): traced for peer copies, but no captured step shared a peer window holding its receive buffer; "
                "run it inside CapturedStep::capture (eager calls take the padded NCCL exchange)");
  const int P = p.ranks, r = p.rank;
  std::vector<void*> receivers(static_cast<std::size_t>(P));
  for (int q = 0; q < P; ++q)
    receivers[static_cast<std::size_t>(q)] = q == r ? out : window->receive_address(q, p.slot, bytes);
  // My buffer is free (stream order: every reader of the bytes it reuses is
  // done): each peer may write its rows.
  for (int s = 1; s < P; ++s) comm.window_post(*window, p.slot + r, PeerFlag::kReady, (r - s + P) % P, stream);
  for (int s = 1; s < P; ++s) {
    const int to = (r + s) % P;
    comm.window_await(*window, p.slot + to, PeerFlag::kReady, to, stream);
  }
  const kernels::EpCopyDesc desc = ep_copy_desc(p, *o.rows.meta);
  if (on_cuda) {
    kernels::launch_ep_peer_copy(desc, p.blocks, o.routes.as<std::int32_t>(), o.rows.data, receivers.data(), stream);
  } else {
    kernels::host::ep_peer_copy(desc, o.routes.as<std::int32_t>(), o.rows.data, receivers.data());
  }
  // A post comes after the stream's earlier writes, the copy's included.
  for (int s = 1; s < P; ++s) comm.window_post(*window, p.slot + r, PeerFlag::kData, (r + s) % P, stream);
  for (int s = 1; s < P; ++s) {
    const int from = (r - s + P) % P;
    comm.window_await(*window, p.slot + from, PeerFlag::kData, from, stream);
  }
}

}  // namespace

const OpDef& ep_routes_op() {
  static const OpDef op{
      .name = kRoutes,
      .check = check_routes,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<EpRoutesParams>();
            const auto o = bind_args<EpCountsOperands>(p, a);
            kernels::launch_ep_routes(ep_plan_desc(p, o.counts.shape().dim(1)), p.direction,
                                      o.counts.as<std::int32_t>(), static_cast<std::int32_t*>(a.outputs[0]), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<EpRoutesParams>();
            const auto o = bind_args<EpCountsOperands>(p, a);
            kernels::host::ep_routes(ep_plan_desc(p, o.counts.shape().dim(1)), p.direction, o.counts.as<std::int32_t>(),
                                     static_cast<std::int32_t*>(a.outputs[0]));
          },
  };
  return op;
}
SG_REGISTER_OP(ep_routes_op);

const OpDef& ep_peer_copy_op() {
  static const OpDef op{
      .name = kPeerCopy,
      .check = check_peer_copy,
      .launch_cuda = [](const OpParams& params, const KernelArgs& a,
                        CUstream_st* s) { peer_copy_run(params, a, s, /*on_cuda=*/true); },
      .run_host = [](const OpParams& params, const KernelArgs& a) { peer_copy_run(params, a, nullptr, false); },
      .collective = peer_copy_collective,
  };
  return op;
}
SG_REGISTER_OP(ep_peer_copy_op);

Tensor ep_peer_move(Context& ctx, Communicator& comm, kernels::EpDirection direction, const Tensor& rows,
                    const Tensor& counts, std::int64_t R, const EpPeerOptions& options) {
  comm.check_device(ctx.device(), direction == kernels::EpDirection::kDispatch ? "ep_dispatch" : "ep_combine");
  const EpRoutesParams routes_params{direction, comm.rank(), comm.world_size(), R};
  const Tensor routes =
      ctx.call(ep_routes_op(), routes_params, flatten(kRoutes, routes_params, EpCountsOperands<Tensor>{counts}))
          .front()
          .set_name("ep.routes");
  const EpPeerParams p{.communicator = comm.id(),
                       .group = comm.name(),
                       .direction = direction,
                       .rank = comm.rank(),
                       .ranks = comm.world_size(),
                       .rows = R,
                       .experts = counts.shape().dim(1),
                       .slot = comm.take_signal_slots(comm.world_size()),
                       .blocks = options.blocks};
  return ctx.call(ep_peer_copy_op(), p, flatten(kPeerCopy, p, EpPeerCopyOperands<Tensor>{rows, routes})).front();
}

}  // namespace stepgraph::ops
