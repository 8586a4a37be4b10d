// What CUDA devices this process can see.
//
//   DeviceCount found = cuda_device_count();
//   if (found.count == 0) std::cout << found.no_device_reason << "\n";
//   else std::cout << describe(device_properties(0)) << "\n";
#pragma once

#include <cstddef>
#include <string>

namespace stepgraph {

struct DeviceCount {
  int count = 0;
  // When count is 0: why, in words ("no CUDA device: CUDA driver not found
  // (cudaErrorInsufficientDriver)"). Empty otherwise.
  std::string no_device_reason;
};

// Never throws: a machine without a GPU or driver is an answer, not an error.
DeviceCount cuda_device_count() noexcept;

struct DeviceProperties {
  int index = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  std::size_t total_memory_bytes = 0;
  int multiprocessor_count = 0;
  std::size_t l2_cache_bytes = 0;
  std::size_t max_shared_memory_per_block_optin = 0;
};

// Throws Error(kNoDevice) with the reason when `index` names no device.
DeviceProperties device_properties(int index);

// Free and total bytes on the current device, from cudaMemGetInfo.
struct DeviceMemory {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};
DeviceMemory device_memory(int index);

// "NVIDIA H100 80GB HBM3 (device 0, sm_90, 132 SMs, 79.1 GiB)"
std::string describe(const DeviceProperties& properties);

// Opens and closes the range a profiler started with "profile from start off"
// records (ncu --profile-from-start off, nsys --capture-range=cudaProfilerApi):
// how a benchmark names the one step it wants profiled.
void cuda_profiler_start();
void cuda_profiler_stop();

}  // namespace stepgraph
