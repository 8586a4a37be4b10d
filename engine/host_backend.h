// HostBackend: runs every op's host reference now, on aligned host memory.
// Streams are only names here (work runs in call order, which every plan
// allows), so waits are nothing to do. Recording a schedule keeps it;
// launching runs it with the host references. See Note [One backend per
// context] in backend.h.
#pragma once

#include <memory>

#include "engine/backend.h"

namespace stepgraph {

std::unique_ptr<Backend> make_host_backend(int stream_count);

}  // namespace stepgraph
