// Host helpers of the cross-entropies (cross_entropy_parts.h).
#include <cstdint>
#include <cstring>

#include "kernels/cross_entropy_parts.h"

namespace stepgraph::kernels::host {

std::int64_t load_label(DType dtype, const void* labels, std::int64_t i) {
  const auto* bytes = static_cast<const std::uint8_t*>(labels);
  if (dtype == DType::kInt32) {
    std::int32_t value;
    std::memcpy(&value, bytes + i * 4, 4);
    return value;
  }
  std::int64_t value;
  std::memcpy(&value, bytes + i * 8, 8);
  return value;
}

}  // namespace stepgraph::kernels::host
