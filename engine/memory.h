// Memory facts shared by every allocator of the engine: the alignment of
// every address StepGraph hands out, and the memory of a graph pool.
//
// Note [256-byte alignment]
// Every allocation (persistent, eager, host arenas) and every offset the
// planner gives a pool value is a multiple of kAllocationAlignment. cuBLASLt
// picks its fastest kernels only for 16-byte aligned operands and our
// kernels load 16-byte vectors; 256 bytes also keeps each tensor on its own
// DRAM burst and matches what cudaMalloc returns. Kernel launchers check the
// 16 bytes they need; the engine guarantees 256.
#pragma once

#include <cstdint>

namespace stepgraph {

inline constexpr std::int64_t kAllocationAlignment = 256;

// `bytes` rounded up to a multiple of kAllocationAlignment.
constexpr std::int64_t align_allocation(std::int64_t bytes) {
  return (bytes + kAllocationAlignment - 1) / kAllocationAlignment * kAllocationAlignment;
}

// The memory of one static graph pool (device or host), shared by the graphs
// of a step and by the pool tensors that outlive it. release() frees it at
// once; later, base() is null and those tensors report the release instead
// of touching freed memory.
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;
  virtual void* base() const = 0;  // null once released
  virtual std::int64_t bytes() const = 0;
  virtual void release() = 0;
  bool released() const { return base() == nullptr; }
};

}  // namespace stepgraph
