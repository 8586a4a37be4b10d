// The memory of one static graph pool: one device allocation (cuda) or one
// aligned host arena (host). Shared by the graphs of a step and by the pool
// tensors that outlive it; release() frees it at once, after which those
// tensors and replays report the release instead of touching freed memory.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/tensor.h"

namespace stepgraph {

std::shared_ptr<PoolMemory> allocate_pool_memory(Device device, std::int64_t bytes);

}  // namespace stepgraph
