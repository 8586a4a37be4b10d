// The edge of the C API: exceptions become result codes and a thread-local
// last-error message; C enums become engine values.
#include <algorithm>
#include <cmath>
#include <exception>
#include <string>

#include "capi/handles.h"
#include "engine/logging.h"

namespace {
thread_local std::string last_error;

sg_result fail(sg_result code, std::string message) noexcept {
  try {
    last_error = std::move(message);
  } catch (...) {
    // Out of memory while keeping the message: the code still says what happened.
  }
  return code;
}
}  // namespace

extern "C" const char* sg_last_error(void) { return last_error.c_str(); }

extern "C" const char* sg_result_name(int result) {
  if (result == SG_OK) return "ok";
  if (result < SG_ERROR_INVALID_ARGUMENT || result > SG_ERROR_INTERNAL) return "unknown";
  // The engine's stable names, NUL-terminated literals.
  return stepgraph::error_code_name(static_cast<stepgraph::ErrorCode>(result)).data();
}

extern "C" int sg_api_version(void) { return SG_API_VERSION; }

namespace stepgraph::capi {

sg_result run_guarded(const char* function, const std::function<void()>& body) noexcept {
  try {
    body();
    return SG_OK;
  } catch (const Error& error) {
    return fail(static_cast<sg_result>(error.code()), error.what());
  } catch (const std::bad_alloc&) {
    return fail(SG_ERROR_OUT_OF_MEMORY, std::string(function) + ": out of host memory");
  } catch (const std::exception& error) {
    // Not a stepgraph::Error: a bug or a library failing in a way we did not check.
    try {
      logger().error("{}: unexpected exception: {}", function, error.what());
    } catch (...) {
    }
    return fail(SG_ERROR_INTERNAL, std::string("[internal] ") + function + ": " + error.what());
  } catch (...) {
    return fail(SG_ERROR_INTERNAL, std::string("[internal] ") + function + ": unknown exception");
  }
}

void require(const void* pointer, const char* function, const char* what) {
  SG_CHECK(pointer != nullptr, function, ": ", what, " is NULL");
}

bool to_flag(int value, const char* function, const char* what) {
  SG_CHECK(value == 0 || value == 1, function, ": ", what, " is a flag (0 or 1), got ", value);
  return value == 1;
}

float checked_eps(float eps, const char* function, const char* what) {
  SG_CHECK(std::isfinite(eps) && eps >= 0.0f, function, ": ", what, " must be finite and >= 0, got ", eps);
  return eps;
}

void copy_string(std::string_view text, char* buffer, std::size_t capacity, std::size_t* length) {
  if (length != nullptr) *length = text.size();
  if (buffer == nullptr || capacity == 0) return;
  const std::size_t n = std::min(text.size(), capacity - 1);
  text.copy(buffer, n);
  buffer[n] = '\0';
}

Device to_device(sg_device device) {
  switch (device) {
    case SG_DEVICE_CUDA: return Device::kCuda;
    case SG_DEVICE_HOST: return Device::kHost;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "device ", static_cast<int>(device),
           " is not an sg_device (SG_DEVICE_CUDA = 0, SG_DEVICE_HOST = 1)");
}

sg_device to_c_device(Device device) {
  switch (device) {
    case Device::kCuda: return SG_DEVICE_CUDA;
    case Device::kHost: return SG_DEVICE_HOST;
  }
  SG_THROW(ErrorCode::kInternal, "device ", static_cast<int>(device), " has no sg_device");
}

DType to_dtype(sg_dtype dtype) {
  const int value = static_cast<int>(dtype);
  SG_CHECK(value >= 0 && value < static_cast<int>(kAllDTypes.size()), "dtype ", value,
           " is not an sg_dtype (0 = float32 ... 6 = int64)");
  return static_cast<DType>(value);
}

sg_dtype from_dtype(DType dtype) { return static_cast<sg_dtype>(dtype); }

kernels::NormKind to_norm_kind(sg_norm_kind kind) {
  switch (kind) {
    case SG_NORM_LAYERNORM: return kernels::NormKind::kLayerNorm;
    case SG_NORM_RMSNORM: return kernels::NormKind::kRMSNorm;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "norm kind ", static_cast<int>(kind),
           " is not an sg_norm_kind (SG_NORM_LAYERNORM = 0, SG_NORM_RMSNORM = 1)");
}

PoolReportPolicy to_policy(sg_pool_report_policy policy) {
  switch (policy) {
    case SG_POOL_REPORT_WARN: return PoolReportPolicy::kWarn;
    case SG_POOL_REPORT_ERROR: return PoolReportPolicy::kError;
    case SG_POOL_REPORT_FREE: return PoolReportPolicy::kFree;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "pool report policy ", static_cast<int>(policy),
           " is not an sg_pool_report_policy (warn = 0, error = 1, free = 2)");
}

}  // namespace stepgraph::capi
