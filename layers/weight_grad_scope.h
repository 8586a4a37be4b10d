// WeightGradScope: where a layer's weight gradients run.
//
// Nothing later in a backward reads a weight gradient (only the optimizer
// does, after the whole backward), while each data gradient feeds the next
// layer: the dgrad chain is the critical path. With a side stream, weight
// gradients go there and overlap that chain; the optimizer and the next
// step wait for them through the planner's events (graph) or the context's
// stream order (eager). With only the main stream this scope does nothing.
// The arithmetic is the same either way, so results are bitwise unchanged.
#pragma once

#include <optional>

#include "engine/context.h"

namespace stepgraph {

class WeightGradScope {
 public:
  static constexpr int kStream = 1;

  explicit WeightGradScope(Context& ctx) {
    if (ctx.stream_count() > kStream) scope_.emplace(ctx, kStream);
  }

 private:
  std::optional<StreamScope> scope_;
};

}  // namespace stepgraph
