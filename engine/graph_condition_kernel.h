// The kernel that sets a CUDA conditional node's condition (graph_conditional.cc).
#pragma once

#include <cuda_runtime_api.h>

namespace stepgraph {

// Sets `handle`'s condition to 1 where the int32 at `flag` is zero, else 0,
// when the launch runs (one thread; recorded under stream capture).
void launch_set_condition_if_zero(cudaGraphConditionalHandle handle, const void* flag, cudaStream_t stream);

}  // namespace stepgraph
