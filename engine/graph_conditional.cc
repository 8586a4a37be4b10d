#include "engine/graph_conditional.h"

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/graph_condition_kernel.h"
#include "engine/logging.h"

namespace stepgraph {
namespace {

// The capture's graph and the nodes its next work would depend on.
struct CaptureState {
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* dependencies = nullptr;
  std::size_t count = 0;
};

CaptureState capture_state(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CaptureState state;
  SG_CUDA_CHECK(
      cudaStreamGetCaptureInfo(stream, &status, nullptr, &state.graph, &state.dependencies, nullptr, &state.count));
  SG_CHECK_CODE(status == cudaStreamCaptureStatusActive, ErrorCode::kInternal,
                "a conditional body begins on a stream that is not being captured");
  return state;
}

}  // namespace

IfZeroBody::IfZeroBody(cudaStream_t stream, const void* flag, cudaStream_t body_stream) : body_stream_(body_stream) {
  cudaGraphConditionalHandle handle{};
  SG_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, capture_state(stream).graph, 0, 0));
  launch_set_condition_if_zero(handle, flag, stream);

  const CaptureState after_kernel = capture_state(stream);
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node = nullptr;
  SG_CUDA_CHECK(cudaGraphAddNode(&node, after_kernel.graph, after_kernel.dependencies, nullptr, after_kernel.count,
                                 &params));
  SG_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
  // The body graph belongs to the node.
  SG_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body_stream_, params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                              cudaStreamCaptureModeThreadLocal));
  active_ = true;
}

IfZeroBody::~IfZeroBody() {
  if (!active_) return;
  cudaGraph_t body = nullptr;
  const cudaError_t status = cudaStreamEndCapture(body_stream_, &body);
  logger().warn("a conditional body's capture was abandoned before end() (cudaStreamEndCapture: {})",
                cudaGetErrorString(status));
  (void)cudaGetLastError();
}

void IfZeroBody::end() {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "IfZeroBody::end() called twice");
  active_ = false;
  cudaGraph_t body = nullptr;  // the node's own graph, not ours to destroy
  SG_CUDA_CHECK(cudaStreamEndCapture(body_stream_, &body));
}

}  // namespace stepgraph
