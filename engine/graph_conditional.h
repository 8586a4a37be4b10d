// The CUDA side of a conditional body (Note [Conditional bodies] in
// engine/backend.h): an IF node added to a stream capture, and the capture
// of its body graph on a second stream.
//
//   IfZeroBody body(captured_stream, flag, body_stream);  // the node joins the capture
//   launch_work(body_stream);                             // recorded into the body
//   body.end();                                           // the captured stream continues after the node
#pragma once

#include <cuda_runtime_api.h>

namespace stepgraph {

class IfZeroBody {
 public:
  // `stream` is being captured. Records a one-thread kernel that sets the
  // node's condition to (*flag == 0) at each launch, then the IF node after
  // it, and starts capturing the node's body on `body_stream`.
  IfZeroBody(cudaStream_t stream, const void* flag, cudaStream_t body_stream);
  // An unfinished body's capture is ended (logged).
  ~IfZeroBody();
  IfZeroBody(const IfZeroBody&) = delete;
  IfZeroBody& operator=(const IfZeroBody&) = delete;

  // Ends the body's capture. Once only.
  void end();

 private:
  cudaStream_t body_stream_;
  bool active_ = false;
};

}  // namespace stepgraph
