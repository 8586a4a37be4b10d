// Collective ops: NCCL's collectives as ops like any other (eager, traced,
// host), over a Communicator (engine/communicator.h; see Note [Collectives
// are ops]). They run on the context's communication stream when it has one
// (Context::set_communication_stream), so the planner's events order them
// against the compute streams, and their outputs are planned in the pool.
//
//   ops::all_reduce_(ctx, comm, grad, ReduceOp::kSum);      // in place: gradients
//   Tensor shard = ops::reduce_scatter(ctx, comm, x);        // [N n, ...] -> [n, ...]
//   Tensor full = ops::all_gather(ctx, comm, shard);         // [n, ...] -> [N n, ...]
//
// Every rank must call the same collectives in the same order with the same
// shapes; a captured step checks this before recording (graphs/collective_check.h).
#pragma once

#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/op.h"
#include "engine/tensor.h"

namespace stepgraph::ops {

Tensor all_reduce(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op);
void all_reduce_(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op);  // in place
// Every tensor reduced in place, issued together (one NCCL group): a bucket
// of gradients. One dtype for all.
void all_reduce_many_(Context& ctx, Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op);
// x [N n, ...] (N the world size): rank r gets the reduction of rows [r n, (r + 1) n).
Tensor reduce_scatter(Context& ctx, Communicator& comm, const Tensor& x, ReduceOp op);
// The same into an existing tensor of x.numel() / N elements (a persistent
// shard the optimizer reads through its table).
void reduce_scatter_into_(Context& ctx, Communicator& comm, const Tensor& x, const Tensor& out, ReduceOp op);
// x [n, ...]: every rank gets [N n, ...], rank r's rows at [r n, (r + 1) n).
Tensor all_gather(Context& ctx, Communicator& comm, const Tensor& x);
// Every rank's x becomes root's x.
void broadcast_(Context& ctx, Communicator& comm, const Tensor& x, int root);
// Point to point: send(x) on rank a to b pairs with recv(meta) on b from a.
void send(Context& ctx, Communicator& comm, const Tensor& x, int peer);
Tensor recv(Context& ctx, Communicator& comm, const TensorMeta& meta, int peer);
// Sends x to `to` and returns what `from` sent (x's shape), issued together:
// the step of a ring (every rank calls it with its neighbours) that a
// send followed by a recv would deadlock on NCCL.
Tensor send_recv(Context& ctx, Communicator& comm, const Tensor& x, int to, int from);
// One step of a ring that every rank of `comm` takes together: sends x to
// rank r + 1 and returns what rank r - 1 sent. A send_recv whose captured
// form moves the bytes by peer copies where the communicator has them (Note
// [The pool as symmetric memory]): every rank makes the same calls, so they
// share signal slots in trace order.
Tensor ring_shift(Context& ctx, Communicator& comm, const Tensor& x);

const OpDef& all_reduce_op();
const OpDef& all_reduce_inplace_op();
const OpDef& all_reduce_many_op();
const OpDef& reduce_scatter_op();
const OpDef& reduce_scatter_into_op();
const OpDef& all_gather_op();
const OpDef& broadcast_inplace_op();
const OpDef& send_op();
const OpDef& recv_op();
const OpDef& send_recv_op();

}  // namespace stepgraph::ops
