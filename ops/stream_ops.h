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
// waits for the last writes of `tensors` (an optimizer group's weight
// gradients, issued a group earlier and almost always done; with
// step-scoped gradients also the group's masters, which its update writes
// after reading the gradients), and the values those writers read can be
// reused from there on. The op runs no kernel; the wait is the planner's
// (graph) or the context's stream order (eager). ResidualStack joins one
// group behind, and makes a block with attention two groups (attention,
// MLP), so the MLP's gradients and inputs leave before the attention's
// backward (on an H100: small 1.43 -> 1.35 ms, its MLP updates overlapping
// sooner; large's step-scoped peak 16.07 -> 15.82 GiB, moe's 19.95 -> 19.79).
//
//   ops::order_after(ctx, join_tensors_of(group_before));  // after a group's backward
#pragma once

#include <span>

#include "engine/context.h"
#include "engine/op.h"

namespace stepgraph::ops {

void order_after(Context& ctx, std::span<const Tensor> tensors);

const OpDef& order_after_op();

}  // namespace stepgraph::ops
