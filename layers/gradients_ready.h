// The hook between a backward and an optimizer that overlaps it: a backward
// calls `ready(group)` as soon as the gradients of one parameter group are
// final (ResidualStack::backward: one group per block, the final norm, the head), so
// that group's update can start while the backward goes on (AdamW::GroupedStep).
#pragma once

#include <cstddef>
#include <functional>

namespace stepgraph {

using GradientsReady = std::function<void(std::size_t group)>;
// A backward taking its hook (possibly empty: nobody listens).
using BackwardWithReady = std::function<void(const GradientsReady& ready)>;

}  // namespace stepgraph
