// CudaBackend: the engine's one CUDA adapter. Streams (a main stream and
// high-priority side streams), events for the waits between them, the
// caching allocator for eager work, device memory for persistent tensors and
// graph pools, and the recording of schedules by stream capture into CUDA
// graphs that are instantiated once and launched whole. See Note [One backend
// per context] in backend.h.
#pragma once

#include <memory>

#include "engine/backend.h"

namespace stepgraph {

std::unique_ptr<Backend> make_cuda_backend(int stream_count);

}  // namespace stepgraph
