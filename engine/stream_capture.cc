#include "engine/stream_capture.h"

#include "engine/cuda_check.h"
#include "engine/logging.h"

namespace stepgraph {

StreamCapture::StreamCapture(cudaStream_t stream) : stream_(stream) {
  SG_CHECK_CODE(stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread,
                ErrorCode::kInvalidArgument,
                "graph capture needs a non-default stream; create a stepgraph::Stream (or pass the "
                "context's stream) instead of the legacy default stream");
  SG_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
}

StreamCapture::~StreamCapture() {
  if (!active_) return;
  cudaGraph_t discarded = nullptr;
  const cudaError_t status = cudaStreamEndCapture(stream_, &discarded);
  if (discarded != nullptr) cudaGraphDestroy(discarded);
  logger().warn("a stream capture was abandoned before end() (cudaStreamEndCapture: {}); its graph is discarded",
                cudaGetErrorString(status));
  (void)cudaGetLastError();
}

Graph StreamCapture::end() {
  SG_CHECK_CODE(active_, ErrorCode::kInvalidState, "StreamCapture::end() called twice");
  active_ = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t status = cudaStreamEndCapture(stream_, &graph);
  // A failed capture also sets the thread's last error; cleared here, or the
  // next launch's cudaGetLastError check would report it as its own.
  if (status != cudaSuccess) (void)cudaGetLastError();
  if (status == cudaErrorStreamCaptureUnjoined) {
    SG_THROW(ErrorCode::kInvalidState,
             "graph capture ended with a side stream not joined back: record an event on each forked "
             "stream and make the captured stream wait on it before end()");
  }
  SG_CUDA_CHECK(status);
  return Graph(graph);
}

}  // namespace stepgraph
