// Ordering between streams where no data asks for it.
//
// Note [Joining the weight-gradient stream]
// Weight gradients run on a side stream (WeightGradScope) and read saved
// activations there. The planner keeps a value read on a side stream alive
// until that stream joins back into the main stream (Note in
// graphs/planner.h), and nothing in a backward makes the main stream wait for
// the weight-gradient stream: without a join, every activation the weight
// gradients read stays in the pool until the end of the step, and the peak
// holds all of them at once. order_after gives the join: the current stream
// waits for the last writes of `tensors` (a block's weight gradients, issued
// a block earlier and almost always done), and the values those writers read
// can be reused from there on. The op runs no kernel; the wait is the
// planner's (graph) or the context's stream order (eager).
//
//   ops::order_after(ctx, gradients_of(block + 1));  // after block's backward
#pragma once

#include <span>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

void order_after(Context& ctx, std::span<const Tensor> tensors);

const OpDef& order_after_op();

}  // namespace stepgraph::ops
