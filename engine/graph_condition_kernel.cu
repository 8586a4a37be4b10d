#include "engine/graph_condition_kernel.h"

#include <cstdint>

#include "engine/cuda_check.h"

namespace stepgraph {
namespace {

__global__ void set_condition_if_zero(cudaGraphConditionalHandle handle, const std::int32_t* flag) {
  cudaGraphSetConditional(handle, *flag == 0 ? 1u : 0u);
}

}  // namespace

void launch_set_condition_if_zero(cudaGraphConditionalHandle handle, const void* flag, cudaStream_t stream) {
  set_condition_if_zero<<<1, 1, 0, stream>>>(handle, static_cast<const std::int32_t*>(flag));
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph
