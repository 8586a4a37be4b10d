#include "engine/backend.h"

#include "engine/cuda_backend.h"
#include "engine/error.h"
#include "engine/host_backend.h"

namespace stepgraph {

// The one place a Device picks code. See Note [One backend per context].
std::unique_ptr<Backend> make_backend(Device device, int stream_count) {
  switch (device) {
    case Device::kCuda: return make_cuda_backend(stream_count);
    case Device::kHost: return make_host_backend(stream_count);
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown device ", static_cast<int>(device));
}

}  // namespace stepgraph
