#include "engine/error.h"

#include "engine/logging.h"

namespace stepgraph {
namespace {

std::string format_what(ErrorCode code, const std::string& message, const SourcePlace& place) {
  return detail::concat("[", error_code_name(code), "] ", message, " (", place.file, ":", place.line, " in ",
                        place.function, ")");
}

}  // namespace

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kInvalidState: return "invalid_state";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kNoDevice: return "no_device";
    case ErrorCode::kOutOfMemory: return "out_of_memory";
    case ErrorCode::kCuda: return "cuda";
    case ErrorCode::kCublas: return "cublas";
    case ErrorCode::kNccl: return "nccl";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

Error::Error(ErrorCode code, std::string message, SourcePlace place)
    : std::runtime_error(format_what(code, message, place)), code_(code), message_(std::move(message)), place_(place) {}

namespace detail {

void raise(ErrorCode code, std::string message, SourcePlace place) {
  logger().debug("raising [{}] at {}:{} in {}: {}", error_code_name(code), place.file, place.line, place.function,
                 message);
  throw Error(code, std::move(message), place);
}

}  // namespace detail
}  // namespace stepgraph
