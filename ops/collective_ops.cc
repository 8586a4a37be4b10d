#include "ops/collective_ops.h"

#include <string>

#include "engine/error.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {
namespace {

// What a collective call needs besides its tensors. Plain values: the
// communicator by id with its rank and size (Note [Collectives are ops]).
struct CollectiveParams {
  std::uint64_t communicator = 0;
  std::string group;  // the communicator's name, for dumps and errors
  int rank = 0;
  int world_size = 1;
  ReduceOp op = ReduceOp::kSum;
  int peer = -1;  // broadcast: the root; send/recv: the other rank; send_recv: the receiver
  int from = -1;  // send_recv: the sender
  enum class PointToPoint : std::uint8_t { kNone, kSend, kRecv, kSendRecv };
  PointToPoint p2p = PointToPoint::kNone;
  // send_recv traced on a communicator with peer copies: its signal slot
  // (Note [The pool as symmetric memory]); -1: NCCL (eager, or no peer copies).
  std::int64_t slot = -1;
  TensorMeta meta;  // recv: the received tensor
  bool operator==(const CollectiveParams&) const = default;
  std::string to_string() const {
    std::string text = detail::concat("comm=", group, "#", communicator, " rank=", rank, "/", world_size);
    text += detail::concat(" op=", reduce_op_name(op)) + (peer >= 0 ? detail::concat(" peer=", peer) : "");
    text += from >= 0 ? detail::concat(" from=", from) : "";
    return text + (slot >= 0 ? detail::concat(" slot=", slot) : "");
  }
};

using P2P = CollectiveParams::PointToPoint;

// A collective that reads its source (all_reduce, reduce_scatter, all_gather, send, send_recv)
// takes ReadOperand (ops/operands.h).

// The tensor an in-place collective reads and writes (all_reduce_, broadcast_).
template <typename F>
struct InPlaceOperands {
  F x;
};

template <typename F, typename V>
void visit_operands(const CollectiveParams&, InPlaceOperands<F>& o, V& v) {
  v({.name = "x", .use = Use::kWrite}, o.x);
}

template <typename F>
struct ScatterIntoOperands {
  F x;
  F out;  // this rank's share, written
};

template <typename F, typename V>
void visit_operands(const CollectiveParams&, ScatterIntoOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v({.name = "out", .use = Use::kWrite}, o.out);
}

// all_reduce_many_: every input is reduced in place.
template <typename F>
struct ManyOperands {
  std::vector<F> tensors;
};

template <typename F, typename V>
void visit_operands(const CollectiveParams&, ManyOperands<F>& o, V& v) {
  v.list("tensors", o.tensors, kRestOfInputs);
  for (std::size_t i = 0; i < o.tensors.size(); ++i) {
    v({.name = "tensors", .index = static_cast<std::int64_t>(i), .use = Use::kWrite}, o.tensors[i]);
  }
}

// recv reads nothing.
CollectiveParams params_for(Context& ctx, Communicator& comm, std::string_view what, ReduceOp op = ReduceOp::kSum,
                            int peer = -1, P2P p2p = P2P::kNone, TensorMeta meta = {}) {
  comm.check_device(ctx.device(), what);
  return {comm.id(), comm.name(), comm.rank(), comm.world_size(), op, peer, -1, p2p, -1, meta};
}

const CollectiveParams& of(const OpParams& params) { return params.as<CollectiveParams>(); }
Communicator& comm_of(const OpParams& params) { return find_communicator(of(params).communicator); }
CollectiveCall collective_call(const OpParams& params) {
  const CollectiveParams& p = of(params);
  std::string signature = detail::concat("group=", p.group, " size=", p.world_size, " op=", reduce_op_name(p.op));
  // A root is the same rank everywhere; a peer differs by rank and is matched pairwise.
  using P2P = CollectiveParams::PointToPoint;
  switch (p.p2p) {
    case P2P::kSend: return {p.communicator, p.peer, -1, signature};
    case P2P::kRecv: return {p.communicator, -1, p.peer, signature};
    case P2P::kSendRecv:
      if (p.slot >= 0) signature += detail::concat(" slot=", p.slot);  // both ranks must agree on the slot
      return {p.communicator, p.peer, p.from, signature, p.slot};
    case P2P::kNone: break;
  }
  if (p.peer >= 0) signature += detail::concat(" root=", p.peer);
  return {p.communicator, -1, -1, signature};
}

// The one tensor a collective reads (or writes in place), after the count check.
template <template <typename> class Operands = ReadOperand>
TensorMeta x_of(std::string_view op, const OpParams& params, std::span<const TensorMeta> inputs) {
  return bind_metas<Operands>(op, of(params), inputs).x;
}

void check_reducible(std::string_view op, const TensorMeta& x) {
  SG_CHECK_CODE(!is_fp8(x.dtype), ErrorCode::kUnsupported, "op ", op, ": fp8 tensors cannot be reduced, got ",
                dtype_name(x.dtype), "; reduce in bf16 or fp32");
}

// Rows of x: the leading dimension, which reduce_scatter splits and all_gather joins.
std::int64_t leading(std::string_view op, const TensorMeta& x) {
  SG_CHECK(x.shape.rank() >= 1, "op ", op, ": x must have at least one dimension (the one split across ranks), got ",
           x.shape);
  return x.shape.dim(0);
}

Shape with_leading(const Shape& shape, std::int64_t rows) {
  std::vector<std::int64_t> dims(shape.dims().begin(), shape.dims().end());
  dims[0] = rows;
  return Shape(dims);
}

// The result of a collective that makes one (reduce_scatter, all_gather, recv, send_recv).
template <typename F>
struct Received {
  F out;
};

template <typename F, typename V>
void visit_operands(const CollectiveParams&, Received<F>& o, V& v) {
  v({"out"}, o.out);
}

Operand source(const OpParams& p, const KernelArgs& a) { return bind_args<ReadOperand>(of(p), a).x; }
Operand received(const OpParams& p, const KernelArgs& a) { return bind_outputs<Received>(of(p), a).out; }

// Runs the call on the communicator: `stream` is null on host.
void all_reduce_run(const OpParams& p, const KernelArgs& a, CUstream_st* stream, bool in_place) {
  const Operand x = in_place ? bind_args<InPlaceOperands>(of(p), a).x : bind_args<ReadOperand>(of(p), a).x;
  comm_of(p).all_reduce(x.data, in_place ? x.data : received(p, a).data, x.numel(), x.dtype(), of(p).op, stream);
}

}  // namespace

const OpDef& all_reduce_op() {
  static const OpDef op{
      .name = "all_reduce",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            const TensorMeta x = x_of("all_reduce", p, in);
            check_reducible("all_reduce", x);
            return std::vector<TensorMeta>{x};
          },
      .launch_cuda = [](const OpParams& p, const KernelArgs& a,
                        CUstream_st* s) { all_reduce_run(p, a, s, /*in_place=*/false); },
      .run_host = [](const OpParams& p, const KernelArgs& a) { all_reduce_run(p, a, nullptr, /*in_place=*/false); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(all_reduce_op);

const OpDef& all_reduce_inplace_op() {
  static const OpDef op{
      .name = "all_reduce_",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            check_reducible("all_reduce_", x_of<InPlaceOperands>("all_reduce_", p, in));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<InPlaceOperands, CollectiveParams>,
      .launch_cuda = [](const OpParams& p, const KernelArgs& a,
                        CUstream_st* s) { all_reduce_run(p, a, s, /*in_place=*/true); },
      .run_host = [](const OpParams& p, const KernelArgs& a) { all_reduce_run(p, a, nullptr, /*in_place=*/true); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(all_reduce_inplace_op);

namespace {
void all_reduce_many_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const auto o = bind_args<ManyOperands>(of(p), a);
  std::vector<void*> addresses;
  std::vector<std::int64_t> counts;
  for (const Operand& t : o.tensors) {
    addresses.push_back(t.data);
    counts.push_back(t.numel());
  }
  comm_of(p).all_reduce_many(addresses, counts, o.tensors.empty() ? DType::kFloat32 : o.tensors[0].dtype(), of(p).op,
                             s);
}
}  // namespace

const OpDef& all_reduce_many_op() {
  static const OpDef op{
      .name = "all_reduce_many_",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            const auto tensors = bind_metas<ManyOperands>("all_reduce_many_", of(p), in).tensors;
            SG_CHECK(!tensors.empty(), "op all_reduce_many_ takes at least one tensor");
            for (std::size_t i = 0; i < tensors.size(); ++i) {
              check_reducible("all_reduce_many_", tensors[i]);
              SG_CHECK(tensors[i].dtype == tensors[0].dtype, "op all_reduce_many_: tensor ", i, " is ",
                       dtype_name(tensors[i].dtype), " but tensor 0 is ", dtype_name(tensors[0].dtype),
                       "; one call reduces one dtype");
            }
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<ManyOperands, CollectiveParams>,
      .launch_cuda = all_reduce_many_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { all_reduce_many_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(all_reduce_many_op);

namespace {

void reduce_scatter_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const Operand x = source(p, a), out = received(p, a);
  comm_of(p).reduce_scatter(x.data, out.data, out.numel(), x.dtype(), of(p).op, s);
}
void reduce_scatter_into_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const auto o = bind_args<ScatterIntoOperands>(of(p), a);
  comm_of(p).reduce_scatter(o.x.data, o.out.data, o.out.numel(), o.x.dtype(), of(p).op, s);
}
void all_gather_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const Operand x = source(p, a);
  comm_of(p).all_gather(x.data, received(p, a).data, x.numel(), x.dtype(), s);
}
void broadcast_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const Operand x = bind_args<InPlaceOperands>(of(p), a).x;
  comm_of(p).broadcast(x.data, x.data, x.numel(), x.dtype(), of(p).peer, s);
}
void send_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const Operand x = source(p, a);
  comm_of(p).send(x.data, x.numel(), x.dtype(), of(p).peer, s);
}
void recv_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  const Operand out = received(p, a);
  comm_of(p).recv(out.data, out.numel(), out.dtype(), of(p).peer, s);
}
// Through the pool's peer window where the captured step shared one (Note
// [The pool as symmetric memory]); NCCL (or the host mailbox) otherwise.
void send_recv_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  if (of(p).slot >= 0) {
    const Operand x = source(p, a);
    const Operand out = received(p, a);
    if (const auto window = find_peer_window(of(p).communicator, of(p).slot, out.data)) {
      comm_of(p).window_send_recv(*window, of(p).slot, x.data, of(p).peer, out.data, of(p).from,
                                  x.numel() * static_cast<std::int64_t>(dtype_size(x.dtype())), s);
      return;
    }
  }
  const Operand x = source(p, a);
  comm_of(p).send_recv(x.data, of(p).peer, received(p, a).data, of(p).from, x.numel(), x.dtype(), s);
}
}  // namespace

const OpDef& reduce_scatter_op() {
  static const OpDef op{
      .name = "reduce_scatter",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            const TensorMeta x = x_of("reduce_scatter", p, in);
            check_reducible("reduce_scatter", x);
            const std::int64_t rows = leading("reduce_scatter", x);
            const int n = of(p).world_size;
            SG_CHECK(rows % n == 0, "op reduce_scatter: x ", x.shape, " has ", rows,
                     " rows, not a multiple of the world size ", n, "; pad it so every rank gets equal rows");
            return std::vector<TensorMeta>{{with_leading(x.shape, rows / n), x.dtype}};
          },
      .launch_cuda = reduce_scatter_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { reduce_scatter_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(reduce_scatter_op);

const OpDef& reduce_scatter_into_op() {
  static const OpDef op{
      .name = "reduce_scatter_into_",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            const auto o = bind_metas<ScatterIntoOperands>("reduce_scatter_into_", of(p), in);
            check_reducible("reduce_scatter_into_", o.x);
            const int n = of(p).world_size;
            SG_CHECK(o.out.dtype == o.x.dtype && o.out.numel() * n == o.x.numel(),
                     "op reduce_scatter_into_: out must hold x's ", o.x.numel(), " ", dtype_name(o.x.dtype),
                     " elements / ", n, " ranks, got ", o.out.numel(), " ", dtype_name(o.out.dtype));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<ScatterIntoOperands, CollectiveParams>,
      .launch_cuda = reduce_scatter_into_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { reduce_scatter_into_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(reduce_scatter_into_op);

const OpDef& all_gather_op() {
  static const OpDef op{
      .name = "all_gather",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            const TensorMeta x = x_of("all_gather", p, in);
            const std::int64_t rows = leading("all_gather", x);
            return std::vector<TensorMeta>{{with_leading(x.shape, rows * of(p).world_size), x.dtype}};
          },
      .launch_cuda = all_gather_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { all_gather_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(all_gather_op);

const OpDef& broadcast_inplace_op() {
  static const OpDef op{
      .name = "broadcast_",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            x_of<InPlaceOperands>("broadcast_", p, in);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<InPlaceOperands, CollectiveParams>,
      .launch_cuda = broadcast_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { broadcast_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(broadcast_inplace_op);

const OpDef& send_op() {
  static const OpDef op{
      .name = "send",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            x_of("send", p, in);
            return std::vector<TensorMeta>{};
          },
      .launch_cuda = send_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { send_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(send_op);

const OpDef& recv_op() {
  static const OpDef op{
      .name = "recv",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            bind_metas<NoOperands>("recv", of(p), in);
            return std::vector<TensorMeta>{of(p).meta};
          },
      .launch_cuda = recv_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { recv_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(recv_op);

// In the uniformity check a send_recv is the send to `to` and the receive from
// `from`, each matched with its partner's (graphs/collective_check.h).
const OpDef& send_recv_op() {
  static const OpDef op{
      .name = "send_recv",
      .check = [](const OpParams& p,
                  std::span<const TensorMeta> in) { return std::vector<TensorMeta>{x_of("send_recv", p, in)}; },
      .launch_cuda = send_recv_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { send_recv_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(send_recv_op);

Tensor all_reduce(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op) {
  const CollectiveParams p = params_for(ctx, comm, "all_reduce", op);
  return ctx.call(all_reduce_op(), p, flatten("all_reduce", p, ReadOperand<Tensor>{x}))[0];
}

void all_reduce_(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op) {
  const CollectiveParams p = params_for(ctx, comm, "all_reduce_", op);
  ctx.call(all_reduce_inplace_op(), p, flatten("all_reduce_", p, InPlaceOperands<Tensor>{x}));
}

void all_reduce_many_(Context& ctx, Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op) {
  const CollectiveParams p = params_for(ctx, comm, "all_reduce_many_", op);
  ctx.call(all_reduce_many_op(), p, flatten("all_reduce_many_", p, ManyOperands<Tensor>{tensors}));
}

Tensor reduce_scatter(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op) {
  const CollectiveParams p = params_for(ctx, comm, "reduce_scatter", op);
  return ctx.call(reduce_scatter_op(), p, flatten("reduce_scatter", p, ReadOperand<Tensor>{x}))[0];
}

void reduce_scatter_into_(Context& ctx, Communicator& comm, const Tensor& x, const Tensor& out, ReduceOp op) {
  const CollectiveParams p = params_for(ctx, comm, "reduce_scatter_into_", op);
  ctx.call(reduce_scatter_into_op(), p,
           flatten("reduce_scatter_into_", p, ScatterIntoOperands<Tensor>{.x = x, .out = out}));
}

Tensor all_gather(Context& ctx, Communicator& comm, const Tensor& x) {
  const CollectiveParams p = params_for(ctx, comm, "all_gather");
  return ctx.call(all_gather_op(), p, flatten("all_gather", p, ReadOperand<Tensor>{x}))[0];
}

void broadcast_(Context& ctx, Communicator& comm, const Tensor& x, int root) {
  SG_CHECK(root >= 0 && root < comm.world_size(), "broadcast_: root must be a rank in [0, ", comm.world_size(),
           "), got ", root);
  const CollectiveParams p = params_for(ctx, comm, "broadcast_", ReduceOp::kSum, root);
  ctx.call(broadcast_inplace_op(), p, flatten("broadcast_", p, InPlaceOperands<Tensor>{x}));
}

void send(Context& ctx, Communicator& comm, const Tensor& x, int peer) {
  SG_CHECK(peer >= 0 && peer < comm.world_size() && peer != comm.rank(), "send: peer must be another rank in [0, ",
           comm.world_size(), "), got ", peer, " on rank ", comm.rank());
  const CollectiveParams p = params_for(ctx, comm, "send", ReduceOp::kSum, peer, P2P::kSend);
  ctx.call(send_op(), p, flatten("send", p, ReadOperand<Tensor>{x}));
}

Tensor recv(Context& ctx, Communicator& comm, const TensorMeta& meta, int peer) {
  SG_CHECK(peer >= 0 && peer < comm.world_size() && peer != comm.rank(), "recv: peer must be another rank in [0, ",
           comm.world_size(), "), got ", peer, " on rank ", comm.rank());
  return ctx.call(recv_op(), params_for(ctx, comm, "recv", ReduceOp::kSum, peer, P2P::kRecv, meta), {})[0];
}

}  // namespace stepgraph::ops

namespace stepgraph::ops {

Tensor send_recv(Context& ctx, Communicator& comm, const Tensor& x, int to, int from) {
  for (const int peer : {to, from}) {
    SG_CHECK(peer >= 0 && peer < comm.world_size() && peer != comm.rank(),
             "send_recv: both peers must be other ranks in [0, ", comm.world_size(), "), got to=", to, " from=", from,
             " on rank ", comm.rank());
  }
  CollectiveParams params = params_for(ctx, comm, "send_recv", ReduceOp::kSum, to, P2P::kSendRecv);
  params.from = from;
  return ctx.call(send_recv_op(), params, flatten("send_recv", params, ReadOperand<Tensor>{x}))[0];
}

Tensor ring_shift(Context& ctx, Communicator& comm, const Tensor& x) {
  const int n = comm.world_size();
  SG_CHECK(n > 1, "ring_shift: a ring needs at least two ranks, ", comm.describe(), " has one");
  const int r = comm.rank();
  CollectiveParams params = params_for(ctx, comm, "ring_shift", ReduceOp::kSum, (r + 1) % n, P2P::kSendRecv);
  params.from = (r - 1 + n) % n;
  // Eager calls move bytes through NCCL; a traced one takes a signal slot so
  // that its captured step can move them by peer copies.
  if (ctx.tracing() && comm.peer_transport() == PeerTransport::kPeerCopy) params.slot = comm.take_signal_slot();
  return ctx.call(send_recv_op(), params, flatten("ring_shift", params, ReadOperand<Tensor>{x}))[0];
}

}  // namespace stepgraph::ops
