#include "graphs/pool_memory.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "engine/cuda_check.h"
#include "engine/logging.h"

namespace stepgraph {
namespace {

constexpr std::size_t kAlignment = 256;

class CudaPoolMemory final : public PoolMemory {
 public:
  explicit CudaPoolMemory(std::int64_t bytes) : bytes_(bytes) {
    if (bytes > 0) SG_CUDA_CHECK(cudaMalloc(&base_, static_cast<std::size_t>(bytes)));
  }
  ~CudaPoolMemory() override { release(); }
  void* base() const override { return base_; }
  std::int64_t bytes() const override { return bytes_; }
  void release() override {
    if (base_ == nullptr) return;
    // cudaFree waits for the device, so no replay still reads the pool.
    if (const cudaError_t status = cudaFree(base_); status != cudaSuccess) {
      logger().error("cudaFree of a graph pool failed: {}", cudaGetErrorString(status));
    }
    base_ = nullptr;
  }

 private:
  void* base_ = nullptr;
  std::int64_t bytes_;
};

class HostPoolMemory final : public PoolMemory {
 public:
  explicit HostPoolMemory(std::int64_t bytes) : bytes_(bytes) {
    const std::size_t rounded = (static_cast<std::size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
    base_ = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    SG_CHECK_CODE(base_ != nullptr, ErrorCode::kOutOfMemory, "host graph pool of ", bytes, " bytes");
    std::memset(base_, 0, rounded);
  }
  ~HostPoolMemory() override { release(); }
  void* base() const override { return base_; }
  std::int64_t bytes() const override { return bytes_; }
  void release() override {
    std::free(base_);
    base_ = nullptr;
  }

 private:
  void* base_ = nullptr;
  std::int64_t bytes_;
};

}  // namespace

std::shared_ptr<PoolMemory> allocate_pool_memory(Device device, std::int64_t bytes) {
  if (device == Device::kCuda) return std::make_shared<CudaPoolMemory>(bytes);
  return std::make_shared<HostPoolMemory>(bytes);
}

}  // namespace stepgraph
