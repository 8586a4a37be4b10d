#include "engine/peer_flag_kernel.h"

#include "engine/cuda_check.h"

namespace stepgraph {
namespace {

__device__ std::uint32_t load_acquire_system(const std::uint32_t* flag) {
  std::uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ std::uint64_t global_time_ns() {
  std::uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void await_flag(std::uint32_t* flag, std::uint64_t timeout_ns) {
  const std::uint64_t start = global_time_ns();
  while (load_acquire_system(flag) != 1u) {
    if (global_time_ns() - start > timeout_ns) __trap();
    __nanosleep(100);
  }
  *flag = 0u;  // this wait's reset: the peer posts again only after the next wait began (the Note)
}

}  // namespace

void launch_await_flag(std::uint32_t* flag, std::uint64_t timeout_ns, cudaStream_t stream) {
  await_flag<<<1, 1, 0, stream>>>(flag, timeout_ns);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph
