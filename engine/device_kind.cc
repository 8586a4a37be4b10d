#include "engine/device_kind.h"

namespace stepgraph {

std::string_view device_name(Device device) {
  switch (device) {
    case Device::kCuda: return "cuda";
    case Device::kHost: return "host";
  }
  return "unknown";
}

}  // namespace stepgraph
