// StreamCapture: the one place where work launched on a stream is recorded
// into a CUDA graph instead of running.
//
//   StreamCapture capture(stream.get());
//   launch_work(stream.get());          // recorded, not run
//   Graph graph = capture.end();
//
// Work on other streams joins the capture by waiting on an event recorded on
// a captured stream (fork), and must be joined back (the captured stream
// waits on an event recorded on the side stream) before end().
#pragma once

#include <cuda_runtime_api.h>

#include "engine/cuda_graph.h"

namespace stepgraph {

class StreamCapture {
 public:
  // Begins capturing `stream` (thread-local mode: other threads' CUDA calls
  // are unaffected). The legacy default stream cannot be captured: that is an
  // Error naming the fix.
  explicit StreamCapture(cudaStream_t stream);
  // An unfinished capture is ended and its graph discarded (logged).
  ~StreamCapture();
  StreamCapture(const StreamCapture&) = delete;
  StreamCapture& operator=(const StreamCapture&) = delete;

  // Ends the capture and returns the recorded graph. Once only.
  Graph end();

 private:
  cudaStream_t stream_;
  bool active_ = true;
};

}  // namespace stepgraph
