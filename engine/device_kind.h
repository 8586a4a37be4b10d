// Where a Context runs its ops: a CUDA device, or the host references.
#pragma once

#include <cstdint>
#include <string_view>

namespace stepgraph {

enum class Device : std::uint8_t { kCuda, kHost };
std::string_view device_name(Device device);  // "cuda", "host"

}  // namespace stepgraph
