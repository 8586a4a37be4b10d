#include "ops/collective_ops.h"

#include <string>

#include "engine/error.h"
#include "ops/op_registration.h"

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
  TensorMeta meta;  // recv: the received tensor
  bool operator==(const CollectiveParams&) const = default;
  std::string to_string() const {
    std::string text = detail::concat("comm=", group, "#", communicator, " rank=", rank, "/", world_size);
    text += detail::concat(" op=", reduce_op_name(op)) + (peer >= 0 ? detail::concat(" peer=", peer) : "");
    return text + (from >= 0 ? detail::concat(" from=", from) : "");
  }
};

using P2P = CollectiveParams::PointToPoint;

CollectiveParams params_for(Context& ctx, Communicator& comm, std::string_view what, ReduceOp op = ReduceOp::kSum,
                            int peer = -1, P2P p2p = P2P::kNone, TensorMeta meta = {}) {
  comm.check_device(ctx.device(), what);
  return {comm.id(), comm.name(), comm.rank(), comm.world_size(), op, peer, -1, p2p, meta};
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
    case P2P::kSendRecv: return {p.communicator, p.peer, p.from, signature};
    case P2P::kNone: break;
  }
  if (p.peer >= 0) signature += detail::concat(" root=", p.peer);
  return {p.communicator, -1, -1, signature};
}

void check_one_input(std::string_view op, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs.size() == 1, "op ", op, " takes 1 input, got ", inputs.size());
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

std::int64_t numel(const KernelArgs& a, bool output) {
  return output ? a.output_metas[0].numel() : a.input_metas[0].numel();
}

// Runs the call on the communicator: `stream` is null on host.
void all_reduce_run(const OpParams& p, const KernelArgs& a, CUstream_st* stream, bool in_place) {
  void* out = in_place ? a.inputs[0] : a.outputs[0];
  comm_of(p).all_reduce(a.inputs[0], out, numel(a, false), a.input_metas[0].dtype, of(p).op, stream);
}

}  // namespace

const OpDef& all_reduce_op() {
  static const OpDef op{
      .name = "all_reduce",
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            check_one_input("all_reduce", in);
            check_reducible("all_reduce", in[0]);
            return std::vector<TensorMeta>{in[0]};
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
          [](const OpParams&, std::span<const TensorMeta> in) {
            check_one_input("all_reduce_", in);
            check_reducible("all_reduce_", in[0]);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs = {0},
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
  std::vector<std::int64_t> counts;
  for (const TensorMeta& meta : a.input_metas) counts.push_back(meta.numel());
  comm_of(p).all_reduce_many(a.inputs, counts, a.input_metas.empty() ? DType::kFloat32 : a.input_metas[0].dtype,
                             of(p).op, s);
}

std::vector<int> all_inputs(const OpParams&, std::size_t count) {
  std::vector<int> indices(count);
  for (std::size_t i = 0; i < count; ++i) indices[i] = static_cast<int>(i);
  return indices;
}
}  // namespace

const OpDef& all_reduce_many_op() {
  static const OpDef op{
      .name = "all_reduce_many_",
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            SG_CHECK(!in.empty(), "op all_reduce_many_ takes at least one tensor");
            for (std::size_t i = 0; i < in.size(); ++i) {
              check_reducible("all_reduce_many_", in[i]);
              SG_CHECK(in[i].dtype == in[0].dtype, "op all_reduce_many_: tensor ", i, " is ", dtype_name(in[i].dtype),
                       " but tensor 0 is ", dtype_name(in[0].dtype), "; one call reduces one dtype");
            }
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = all_inputs,
      .launch_cuda = all_reduce_many_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { all_reduce_many_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(all_reduce_many_op);

namespace {
void reduce_scatter_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  comm_of(p).reduce_scatter(a.inputs[0], a.outputs[0], numel(a, true), a.input_metas[0].dtype, of(p).op, s);
}
void all_gather_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  comm_of(p).all_gather(a.inputs[0], a.outputs[0], numel(a, false), a.input_metas[0].dtype, s);
}
void broadcast_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  comm_of(p).broadcast(a.inputs[0], a.inputs[0], numel(a, false), a.input_metas[0].dtype, of(p).peer, s);
}
void send_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  comm_of(p).send(a.inputs[0], numel(a, false), a.input_metas[0].dtype, of(p).peer, s);
}
void recv_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  comm_of(p).recv(a.outputs[0], numel(a, true), a.output_metas[0].dtype, of(p).peer, s);
}
void send_recv_run(const OpParams& p, const KernelArgs& a, CUstream_st* s) {
  comm_of(p).send_recv(a.inputs[0], of(p).peer, a.outputs[0], of(p).from, numel(a, false), a.input_metas[0].dtype, s);
}
}  // namespace

const OpDef& reduce_scatter_op() {
  static const OpDef op{
      .name = "reduce_scatter",
      .check =
          [](const OpParams& p, std::span<const TensorMeta> in) {
            check_one_input("reduce_scatter", in);
            check_reducible("reduce_scatter", in[0]);
            const std::int64_t rows = leading("reduce_scatter", in[0]);
            const int n = of(p).world_size;
            SG_CHECK(rows % n == 0, "op reduce_scatter: x ", in[0].shape, " has ", rows,
                     " rows, not a multiple of the world size ", n, "; pad it so every rank gets equal rows");
            return std::vector<TensorMeta>{{with_leading(in[0].shape, rows / n), in[0].dtype}};
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
            SG_CHECK(in.size() == 2, "op reduce_scatter_into_ takes x and out, got ", in.size(), " tensors");
            check_reducible("reduce_scatter_into_", in[0]);
            const int n = of(p).world_size;
            SG_CHECK(in[1].dtype == in[0].dtype && in[1].numel() * n == in[0].numel(),
                     "op reduce_scatter_into_: out must hold x's ", in[0].numel(), " ", dtype_name(in[0].dtype),
                     " elements / ", n, " ranks, got ", in[1].numel(), " ", dtype_name(in[1].dtype));
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs = {1},
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            comm_of(p).reduce_scatter(a.inputs[0], a.inputs[1], a.input_metas[1].numel(), a.input_metas[0].dtype,
                                      of(p).op, s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            comm_of(p).reduce_scatter(a.inputs[0], a.inputs[1], a.input_metas[1].numel(), a.input_metas[0].dtype,
                                      of(p).op, nullptr);
          },
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
            check_one_input("all_gather", in);
            const std::int64_t rows = leading("all_gather", in[0]);
            return std::vector<TensorMeta>{{with_leading(in[0].shape, rows * of(p).world_size), in[0].dtype}};
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
          [](const OpParams&, std::span<const TensorMeta> in) {
            check_one_input("broadcast_", in);
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs = {0},
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
          [](const OpParams&, std::span<const TensorMeta> in) {
            check_one_input("send", in);
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
            SG_CHECK(in.empty(), "op recv takes no inputs, got ", in.size());
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
      .check =
          [](const OpParams&, std::span<const TensorMeta> in) {
            check_one_input("send_recv", in);
            return std::vector<TensorMeta>{in[0]};
          },
      .launch_cuda = send_recv_run,
      .run_host = [](const OpParams& p, const KernelArgs& a) { send_recv_run(p, a, nullptr); },
      .collective = collective_call,
  };
  return op;
}
SG_REGISTER_OP(send_recv_op);

Tensor all_reduce(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op) {
  return ctx.call(all_reduce_op(), params_for(ctx, comm, "all_reduce", op), {x})[0];
}

void all_reduce_(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op) {
  ctx.call(all_reduce_inplace_op(), params_for(ctx, comm, "all_reduce_", op), {x});
}

void all_reduce_many_(Context& ctx, Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op) {
  ctx.call(all_reduce_many_op(), params_for(ctx, comm, "all_reduce_many_", op), tensors);
}

Tensor reduce_scatter(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op) {
  return ctx.call(reduce_scatter_op(), params_for(ctx, comm, "reduce_scatter", op), {x})[0];
}

void reduce_scatter_into_(Context& ctx, Communicator& comm, const Tensor& x, const Tensor& out, ReduceOp op) {
  ctx.call(reduce_scatter_into_op(), params_for(ctx, comm, "reduce_scatter_into_", op), {x, out});
}

Tensor all_gather(Context& ctx, Communicator& comm, const Tensor& x) {
  return ctx.call(all_gather_op(), params_for(ctx, comm, "all_gather"), {x})[0];
}

void broadcast_(Context& ctx, Communicator& comm, const Tensor& x, int root) {
  SG_CHECK(root >= 0 && root < comm.world_size(), "broadcast_: root must be a rank in [0, ", comm.world_size(),
           "), got ", root);
  ctx.call(broadcast_inplace_op(), params_for(ctx, comm, "broadcast_", ReduceOp::kSum, root), {x});
}

void send(Context& ctx, Communicator& comm, const Tensor& x, int peer) {
  SG_CHECK(peer >= 0 && peer < comm.world_size() && peer != comm.rank(), "send: peer must be another rank in [0, ",
           comm.world_size(), "), got ", peer, " on rank ", comm.rank());
  ctx.call(send_op(), params_for(ctx, comm, "send", ReduceOp::kSum, peer, P2P::kSend), {x});
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
  return ctx.call(send_recv_op(), params, {x})[0];
}

}  // namespace stepgraph::ops
