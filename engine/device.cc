#include "engine/device.h"

#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <cstdio>

#include "engine/cuda_check.h"
#include "engine/error.h"

namespace stepgraph {
namespace {

std::string reason_for(cudaError_t status) {
  switch (status) {
    case cudaErrorNoDevice: return "no CUDA device: the driver reports no GPU (cudaErrorNoDevice)";
    case cudaErrorInsufficientDriver:
      return "no CUDA device: no CUDA driver is loaded, or it is older than this CUDA runtime "
             "(cudaErrorInsufficientDriver)";
    default:
      return std::string("no CUDA device: cudaGetDeviceCount failed with ") + cudaGetErrorName(status) + " (" +
             cudaGetErrorString(status) + ")";
  }
}

}  // namespace

DeviceCount cuda_device_count() noexcept {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return {0, reason_for(status)};
  }
  if (count == 0) return {0, reason_for(cudaErrorNoDevice)};
  return {count, ""};
}

DeviceProperties device_properties(int index) {
  const DeviceCount found = cuda_device_count();
  SG_CHECK_CODE(found.count > 0, ErrorCode::kNoDevice, found.no_device_reason);
  SG_CHECK_CODE(index >= 0 && index < found.count, ErrorCode::kNoDevice, "no CUDA device with index ", index, "; ",
                found.count, " device(s) found (indices 0..", found.count - 1, ")");
  cudaDeviceProp prop{};
  SG_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  DeviceProperties out;
  out.index = index;
  out.name = prop.name;
  out.compute_major = prop.major;
  out.compute_minor = prop.minor;
  out.total_memory_bytes = prop.totalGlobalMem;
  out.multiprocessor_count = prop.multiProcessorCount;
  out.l2_cache_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  out.max_shared_memory_per_block_optin = prop.sharedMemPerBlockOptin;
  return out;
}

DeviceMemory device_memory(int index) {
  (void)device_properties(index);  // the same clear error for a bad index
  int previous = 0;
  SG_CUDA_CHECK(cudaGetDevice(&previous));
  SG_CUDA_CHECK(cudaSetDevice(index));
  DeviceMemory memory;
  const cudaError_t status = cudaMemGetInfo(&memory.free_bytes, &memory.total_bytes);
  SG_CUDA_CHECK(cudaSetDevice(previous));
  SG_CUDA_CHECK(status);
  return memory;
}

std::string describe(const DeviceProperties& p) {
  char gib[32];
  std::snprintf(gib, sizeof(gib), "%.1f", static_cast<double>(p.total_memory_bytes) / (1024.0 * 1024.0 * 1024.0));
  return detail::concat(p.name, " (device ", p.index, ", sm_", p.compute_major, p.compute_minor, ", ",
                        p.multiprocessor_count, " SMs, ", gib, " GiB)");
}

void cuda_profiler_start() { SG_CUDA_CHECK(cudaProfilerStart()); }

void cuda_profiler_stop() { SG_CUDA_CHECK(cudaProfilerStop()); }

}  // namespace stepgraph
