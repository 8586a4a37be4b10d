// CudaCachingAllocator: stream-ordered device memory for eager tensors.
//
// A cudaMemPool whose release threshold is "never": freed memory stays in the
// pool, so steady-state eager steps allocate without calling the driver.
// Allocation and free are ordered on the stream they are issued on
// (cudaMallocFromPoolAsync / cudaFreeAsync); the caller makes that stream
// wait for every other access before a free (Context does, via StreamOrder).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace stepgraph {

class CudaCachingAllocator {
 public:
  explicit CudaCachingAllocator(int device);
  ~CudaCachingAllocator();  // never throws; every stream must be idle
  CudaCachingAllocator(const CudaCachingAllocator&) = delete;
  CudaCachingAllocator& operator=(const CudaCachingAllocator&) = delete;

  void* allocate(std::int64_t bytes, cudaStream_t stream);
  void free(void* address, cudaStream_t stream) noexcept;

 private:
  cudaMemPool_t pool_ = nullptr;
};

}  // namespace stepgraph
