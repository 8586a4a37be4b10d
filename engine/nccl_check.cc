#include "engine/nccl_check.h"

namespace stepgraph::detail {

void raise_nccl(ncclResult_t status, const char* expression, SourcePlace place) {
  std::string text = concat(expression, " failed: ", ncclGetErrorString(status));
  // ncclGetLastError adds the detail NCCL logged for the failing call.
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0') {
    text += concat(" (", last, ")");
  }
  raise(ErrorCode::kNccl, std::move(text), place);
}

}  // namespace stepgraph::detail
