#include "ops/moe_exchange_ops.h"

#include <cstring>
#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/elementwise.h"
#include "kernels/moe_exchange.h"
#include "ops/collective_ops.h"
#include "ops/moe_exchange_operands.h"
#include "ops/moe_exchange_peer.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string EpPlanParams::to_string() const { return detail::concat("rank=", rank, "/", ranks, " rows=", rows); }

std::string EpCopyParams::to_string() const {
  return detail::concat(ep_direction_name(direction), " rank=", rank, "/", ranks, " rows=", rows, " experts=", experts);
}

namespace {

constexpr std::string_view kSplitsRow = "ep_splits_row";
constexpr std::string_view kPlan = "ep_plan";
constexpr std::string_view kPack = "ep_pack";
constexpr std::string_view kUnpack = "ep_unpack";

// --- operands -----------------------------------------------------------------

template <typename F>
struct EpSplitsOperands {
  F splits;  // int32 [E]
};

template <typename F, typename V>
void visit_operands(const NoParams&, EpSplitsOperands<F>& o, V& v) {
  v({"splits"}, o.splits);
}

template <typename F>
struct EpPlanOutputs {
  F plan;    // int32 [plan_ints] (Note [Expert-parallel plan])
  F splits;  // int32 [E/P]
};

template <typename F, typename V>
void visit_operands(const EpPlanParams&, EpPlanOutputs<F>& o, V& v) {
  v({"plan"}, o.plan);
  v({"splits"}, o.splits);
}

template <typename F>
struct EpPackOperands {
  F rows;  // dispatch: x_perm [R, H]; combine: the expert rows [P*R, H]
  F plan;
};

template <typename F, typename V>
void visit_operands(const EpCopyParams&, EpPackOperands<F>& o, V& v) {
  v({"rows"}, o.rows);
  v({"plan"}, o.plan);
}

// One [R, H] slot per peer, in rank order: a pack's outputs, an unpack's inputs.
template <typename F>
struct EpSlots {
  std::vector<F> slots;
};

template <typename F, typename V>
void visit_operands(const EpCopyParams& p, EpSlots<F>& o, V& v) {
  v.list("slots", o.slots, static_cast<std::size_t>(p.ranks));
  for (std::size_t i = 0; i < o.slots.size(); ++i)
    v({.name = "slots", .index = static_cast<std::int64_t>(i)}, o.slots[i]);
}

template <typename F>
struct EpUnpackOperands {
  F plan;
  std::vector<F> slots;  // [R, H] from each peer, in rank order
};

template <typename F, typename V>
void visit_operands(const EpCopyParams& p, EpUnpackOperands<F>& o, V& v) {
  v({"plan"}, o.plan);
  v.list("slots", o.slots, static_cast<std::size_t>(p.ranks));
  for (std::size_t i = 0; i < o.slots.size(); ++i)
    v({.name = "slots", .index = static_cast<std::int64_t>(i)}, o.slots[i]);
}

// --- descriptors and checks -----------------------------------------------------

void check_plan_meta(std::string_view op, const EpCopyParams& p, const TensorMeta& plan) {
  const TensorMeta want{Shape{ep_plan_desc(p, p.experts).plan_ints()}, DType::kInt32};
  SG_CHECK(plan == want, "op ", op, ": plan must be ", want.shape, " int32 (ep_plan's), got ", plan.shape, " ",
           dtype_name(plan.dtype));
}

void check_row_matrix(std::string_view op, const char* what, const TensorMeta& rows, std::int64_t want_rows) {
  SG_CHECK(rows.shape.rank() == 2 && rows.shape.dim(0) == want_rows, "op ", op, ": ", what, " must be [", want_rows,
           ", H], got ", rows.shape);
}

std::vector<TensorMeta> check_splits_row(const OpParams&, std::span<const TensorMeta> in) {
  const auto o = bind_metas<EpSplitsOperands>(kSplitsRow, NoParams{}, in);
  SG_CHECK(o.splits.dtype == DType::kInt32 && o.splits.shape.rank() == 1, "op ", kSplitsRow,
           ": splits must be int32 [E] (moe_plan's splits), got ", o.splits.shape, " ", dtype_name(o.splits.dtype));
  return {TensorMeta{Shape{1, o.splits.shape.dim(0)}, DType::kInt32}};
}

std::vector<TensorMeta> check_plan(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<EpPlanParams>();
  const auto o = bind_metas<EpCountsOperands>(kPlan, p, in);
  check_ep_counts(kPlan, o.counts, p.ranks);
  const kernels::EpPlanDesc desc = ep_plan_desc(p, o.counts.shape.dim(1));
  kernels::check_ep_plan(desc);
  return output_metas(p, EpPlanOutputs<TensorMeta>{.plan = {Shape{desc.plan_ints()}, DType::kInt32},
                                                   .splits = {Shape{desc.local_experts()}, DType::kInt32}});
}

std::vector<TensorMeta> check_pack(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<EpCopyParams>();
  const auto o = bind_metas<EpPackOperands>(kPack, p, in);
  const bool dispatch = p.direction == kernels::EpDirection::kDispatch;
  check_row_matrix(kPack, dispatch ? "x_perm" : "y_rows", o.rows, dispatch ? p.rows : p.ranks * p.rows);
  check_plan_meta(kPack, p, o.plan);
  kernels::check_ep_copy(ep_copy_desc(p, o.rows));
  EpSlots<TensorMeta> out;
  out.slots.assign(static_cast<std::size_t>(p.ranks), TensorMeta{Shape{p.rows, o.rows.shape.dim(1)}, o.rows.dtype});
  return output_metas(p, std::move(out));
}

std::vector<TensorMeta> check_unpack(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<EpCopyParams>();
  const auto o = bind_metas<EpUnpackOperands>(kUnpack, p, in);
  check_plan_meta(kUnpack, p, o.plan);
  const TensorMeta& first = o.slots.at(0);
  for (std::size_t i = 0; i < o.slots.size(); ++i) {
    SG_CHECK(o.slots[i].dtype == first.dtype, "op ", kUnpack, ": slots[", i, "] is ", dtype_name(o.slots[i].dtype),
             " but slots[0] is ", dtype_name(first.dtype), "; every rank must exchange the same dtype");
    check_row_matrix(kUnpack, "every slot", o.slots[i], p.rows);
    SG_CHECK(o.slots[i].shape == first.shape, "op ", kUnpack, ": slots[", i, "] is ", o.slots[i].shape,
             " but slots[0] is ", first.shape);
  }
  kernels::check_ep_copy(ep_copy_desc(p, first));
  const std::int64_t rows = p.direction == kernels::EpDirection::kDispatch ? p.ranks * p.rows : p.rows;
  return {TensorMeta{Shape{rows, first.shape.dim(1)}, first.dtype}};
}

std::vector<void*> addresses(const std::vector<Operand>& operands) {
  std::vector<void*> out;
  for (const Operand& o : operands) out.push_back(o.data);
  return out;
}

}  // namespace

// --- ops ----------------------------------------------------------------------------

const OpDef& ep_splits_row_op() {
  static const OpDef op{
      .name = kSplitsRow,
      .check = check_splits_row,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<EpSplitsOperands>(NoParams{}, a);
            kernels::launch_copy_bytes(a.outputs[0], o.splits.data, static_cast<std::size_t>(o.splits.meta->bytes()),
                                       s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<EpSplitsOperands>(NoParams{}, a);
            const auto bytes = static_cast<std::size_t>(o.splits.meta->bytes());
            if (bytes > 0) std::memcpy(a.outputs[0], o.splits.data, bytes);
          },
  };
  return op;
}
SG_REGISTER_OP(ep_splits_row_op);

const OpDef& ep_plan_op() {
  static const OpDef op{
      .name = kPlan,
      .check = check_plan,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<EpPlanParams>();
            const auto o = bind_args<EpCountsOperands>(p, a);
            const auto out = bind_outputs<EpPlanOutputs>(p, a);
            kernels::launch_ep_plan(ep_plan_desc(p, o.counts.shape().dim(1)), o.counts.as<std::int32_t>(),
                                    out.plan.as<std::int32_t>(), out.splits.as<std::int32_t>(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<EpPlanParams>();
            const auto o = bind_args<EpCountsOperands>(p, a);
            const auto out = bind_outputs<EpPlanOutputs>(p, a);
            kernels::host::ep_plan(ep_plan_desc(p, o.counts.shape().dim(1)), o.counts.as<std::int32_t>(),
                                   out.plan.as<std::int32_t>(), out.splits.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(ep_plan_op);

const OpDef& ep_pack_op() {
  static const OpDef op{
      .name = kPack,
      .check = check_pack,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<EpCopyParams>();
            const auto o = bind_args<EpPackOperands>(p, a);
            const std::vector<void*> slots = addresses(bind_outputs<EpSlots>(p, a).slots);
            kernels::launch_ep_pack(ep_copy_desc(p, *o.rows.meta), o.plan.as<std::int32_t>(), o.rows.data, slots.data(),
                                    s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<EpCopyParams>();
            const auto o = bind_args<EpPackOperands>(p, a);
            const std::vector<void*> slots = addresses(bind_outputs<EpSlots>(p, a).slots);
            kernels::host::ep_pack(ep_copy_desc(p, *o.rows.meta), o.plan.as<std::int32_t>(), o.rows.data, slots.data());
          },
  };
  return op;
}
SG_REGISTER_OP(ep_pack_op);

const OpDef& ep_unpack_op() {
  static const OpDef op{
      .name = kUnpack,
      .check = check_unpack,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<EpCopyParams>();
            const auto o = bind_args<EpUnpackOperands>(p, a);
            const std::vector<void*> slots = addresses(o.slots);
            const std::vector<const void*> in(slots.begin(), slots.end());
            kernels::launch_ep_unpack(ep_copy_desc(p, *o.slots[0].meta), o.plan.as<std::int32_t>(), in.data(),
                                      a.outputs[0], s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<EpCopyParams>();
            const auto o = bind_args<EpUnpackOperands>(p, a);
            const std::vector<void*> slots = addresses(o.slots);
            const std::vector<const void*> in(slots.begin(), slots.end());
            kernels::host::ep_unpack(ep_copy_desc(p, *o.slots[0].meta), o.plan.as<std::int32_t>(), in.data(),
                                     a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(ep_unpack_op);

// --- calls ----------------------------------------------------------------------------

namespace {

// counts must be int32 [P, E] before anything is traced, so the error names
// the caller's argument.
void check_call(std::string_view what, Communicator& comm, const Tensor& rows, const char* rows_name,
                const Tensor& counts, const EpPeerOptions& options) {
  SG_CHECK(rows.defined() && counts.defined(), what, ": ", rows_name, " and counts must be defined tensors");
  SG_CHECK(options.blocks >= 1 && options.blocks <= kernels::kMaxEpPeerCopyBlocks, what,
           ": EpPeerOptions::blocks must be in [1, ", kernels::kMaxEpPeerCopyBlocks, "], got ", options.blocks);
  SG_CHECK(rows.shape().rank() == 2, what, ": ", rows_name, " must be a matrix [rows, H], got ", rows.shape());
  check_ep_counts(what, counts.meta(), comm.world_size());
}

struct Plan {
  Tensor plan;
  Tensor splits;
};

Plan make_plan(Context& ctx, Communicator& comm, const Tensor& counts, std::int64_t rows) {
  const EpPlanParams p{comm.rank(), comm.world_size(), rows};
  auto out =
      bind_results<EpPlanOutputs>(p, ctx.call(ep_plan_op(), p, flatten(kPlan, p, EpCountsOperands<Tensor>{counts})));
  return {out.plan.set_name("ep.plan"), out.splits};
}

EpCopyParams copy_params(Communicator& comm, kernels::EpDirection direction, std::int64_t rows, const Tensor& counts) {
  return {direction, comm.rank(), comm.world_size(), rows, counts.shape().dim(1)};
}

// Slot q of `packed` goes to rank q; returns the slots received, slot p from
// rank p (this rank's own slot stays). See Note [Expert-parallel exchange].
std::vector<Tensor> exchange(Context& ctx, Communicator& comm, const std::vector<Tensor>& packed) {
  const int n = comm.world_size();
  const int r = comm.rank();
  std::vector<Tensor> received(static_cast<std::size_t>(n));
  received[static_cast<std::size_t>(r)] = packed[static_cast<std::size_t>(r)];
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    const int from = (r - s + n) % n;
    received[static_cast<std::size_t>(from)] = send_recv(ctx, comm, packed[static_cast<std::size_t>(to)], to, from);
  }
  return received;
}

// Plan, pack, exchange, unpack: `rows` rows of R per rank; or, traced on a
// communicator with peer copies, routes and the peer copy (the plan only
// for the dispatch's splits).
Tensor move(Context& ctx, Communicator& comm, kernels::EpDirection direction, const Tensor& rows, const Tensor& counts,
            std::int64_t R, Tensor* splits, const EpPeerOptions& options) {
  const bool by_peer_copies = ep_exchange_by_peer_copies(ctx, comm) && R > 0;
  if (by_peer_copies && splits == nullptr) return ep_peer_move(ctx, comm, direction, rows, counts, R, options);
  const Plan plan = make_plan(ctx, comm, counts, R);
  if (splits != nullptr) *splits = plan.splits;
  if (by_peer_copies) return ep_peer_move(ctx, comm, direction, rows, counts, R, options);
  const EpCopyParams p = copy_params(comm, direction, R, counts);
  const std::vector<Tensor> packed =
      ctx.call(ep_pack_op(), p, flatten(kPack, p, EpPackOperands<Tensor>{rows, plan.plan}));
  const std::vector<Tensor> received = exchange(ctx, comm, packed);
  return ctx.call(ep_unpack_op(), p, flatten(kUnpack, p, EpUnpackOperands<Tensor>{plan.plan, received})).front();
}

}  // namespace

Tensor ep_counts(Context& ctx, Communicator& comm, const Tensor& splits) {
  SG_CHECK(splits.defined(), "ep_counts: splits must be a defined int32 [E] tensor");
  const Tensor row =
      ctx.call(ep_splits_row_op(), NoParams{}, flatten(kSplitsRow, NoParams{}, EpSplitsOperands<Tensor>{splits}))
          .front();
  return all_gather(ctx, comm, row).set_name("ep.counts");
}

bool ep_exchange_by_peer_copies(const Context& ctx, const Communicator& comm) {
  return ctx.tracing() && comm.peer_transport() == PeerTransport::kPeerCopy && comm.world_size() > 1;
}

EpDispatch ep_dispatch(Context& ctx, Communicator& comm, const Tensor& x_perm, const Tensor& counts,
                       const EpPeerOptions& options) {
  check_call("ep_dispatch", comm, x_perm, "x_perm", counts, options);
  EpDispatch out;
  out.rows =
      move(ctx, comm, kernels::EpDirection::kDispatch, x_perm, counts, x_perm.shape().dim(0), &out.splits, options);
  out.rows.set_name("ep.rows");
  out.splits.set_name("ep.splits");
  return out;
}

Tensor ep_combine(Context& ctx, Communicator& comm, const Tensor& y_rows, const Tensor& counts,
                  const EpPeerOptions& options) {
  check_call("ep_combine", comm, y_rows, "y_rows", counts, options);
  const int n = comm.world_size();
  SG_CHECK(y_rows.shape().dim(0) % n == 0, "ep_combine: y_rows ", y_rows.shape(), " must have P * R rows (P = ", n,
           "), as ep_dispatch's rows have");
  return move(ctx, comm, kernels::EpDirection::kCombine, y_rows, counts, y_rows.shape().dim(0) / n, nullptr, options)
      .set_name("ep.y_perm");
}

Tensor ep_dispatch_backward(Context& ctx, Communicator& comm, const Tensor& d_rows, const Tensor& counts,
                            const EpPeerOptions& options) {
  return ep_combine(ctx, comm, d_rows, counts, options);
}

Tensor ep_combine_backward(Context& ctx, Communicator& comm, const Tensor& d_y_perm, const Tensor& counts,
                           const EpPeerOptions& options) {
  return ep_dispatch(ctx, comm, d_y_perm, counts, options).rows;
}

}  // namespace stepgraph::ops
