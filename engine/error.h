// Errors: every failure inside StepGraph is a stepgraph::Error carrying a code,
// a message that says what to do, and the place it was raised.
//
//   SG_CHECK(rank == 2, "gemm needs 2-D operands, got rank ", rank);
//   SG_CHECK_CODE(ok, ErrorCode::kInvalidState, "replay after the pool was released");
//
// This header knows no CUDA; the CUDA/cuBLAS checks live in cuda_check.h and
// the NCCL check in nccl_check.h.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace stepgraph {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // bad input from the caller (shape, dtype, flag, ...)
  kInvalidState = 2,     // a call in the wrong state (replay before capture, ...)
  kUnsupported = 3,      // valid, but not implemented for this combination
  kNoDevice = 4,         // no CUDA device, or the index does not exist
  kOutOfMemory = 5,
  kCuda = 6,       // a CUDA runtime call failed
  kCublas = 7,     // a cuBLAS/cuBLASLt call failed
  kNccl = 8,       // an NCCL call failed
  kIo = 9,         // files: checkpoints, data
  kInternal = 10,  // a StepGraph bug: please report it
};

// "invalid_argument", "cuda", ...: stable names, also used by the C API.
std::string_view error_code_name(ErrorCode code);

struct SourcePlace {
  const char* file = "";
  int line = 0;
  const char* function = "";
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message, SourcePlace place);

  ErrorCode code() const noexcept { return code_; }
  // The message alone, without code and place.
  const std::string& message() const noexcept { return message_; }
  const SourcePlace& place() const noexcept { return place_; }
  // what(): "[invalid_argument] <message> (engine/shape.cc:42 in numel)".

 private:
  ErrorCode code_;
  std::string message_;
  SourcePlace place_;
};

namespace detail {

// Logs the failure where it happens (debug level: STEPGRAPH_LOG=debug shows
// every raise with its place) and throws. Out of line to keep call sites small.
[[noreturn]] void raise(ErrorCode code, std::string message, SourcePlace place);

template <typename... Parts>
std::string concat(const Parts&... parts) {
  if constexpr (sizeof...(parts) == 0) {
    return {};
  } else {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
  }
}

}  // namespace detail
}  // namespace stepgraph

#define SG_HERE \
  ::stepgraph::SourcePlace { __FILE__, __LINE__, __func__ }

// Throws stepgraph::Error(code, message...) unless `cond` holds. The message
// parts are streamed together and evaluated only on failure.
#define SG_CHECK_CODE(cond, code, ...)                                                       \
  do {                                                                                       \
    if (!(cond)) [[unlikely]] {                                                              \
      ::stepgraph::detail::raise((code), ::stepgraph::detail::concat(__VA_ARGS__), SG_HERE); \
    }                                                                                        \
  } while (false)

#define SG_CHECK(cond, ...) SG_CHECK_CODE(cond, ::stepgraph::ErrorCode::kInvalidArgument, __VA_ARGS__)

// Unconditional raise, for switch defaults and unreachable paths.
#define SG_THROW(code, ...) ::stepgraph::detail::raise((code), ::stepgraph::detail::concat(__VA_ARGS__), SG_HERE)
