#include "engine/cuda_allocator.h"

#include <limits>

#include "engine/cuda_check.h"
#include "engine/logging.h"

namespace stepgraph {

CudaCachingAllocator::CudaCachingAllocator(int device) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  SG_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
  std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
  SG_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
}

CudaCachingAllocator::~CudaCachingAllocator() {
  if (pool_ != nullptr && cudaMemPoolDestroy(pool_) != cudaSuccess) {
    logger().error("cudaMemPoolDestroy failed at context exit");
  }
}

void* CudaCachingAllocator::allocate(std::int64_t bytes, cudaStream_t stream) {
  void* address = nullptr;
  SG_CUDA_CHECK(cudaMallocFromPoolAsync(&address, static_cast<std::size_t>(bytes), pool_, stream));
  return address;
}

void CudaCachingAllocator::free(void* address, cudaStream_t stream) noexcept {
  if (const cudaError_t status = cudaFreeAsync(address, stream); status != cudaSuccess) {
    logger().error("cudaFreeAsync failed: {}", cudaGetErrorString(status));
  }
}

}  // namespace stepgraph
