// The CUDA side of kernels/context_parallel_plan.h: one launch. Block 0's
// first warp walks the sequences 32 at a time and writes the segment table
// (cu_seqlens read safely, as Note [Safe cu_seqlens] does); the other blocks
// write one position a thread.
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/context_parallel_plan.h"
#include "kernels/packed_sequences.cuh"
#include "kernels/safe_offsets.cuh"

namespace stepgraph::kernels {
namespace {

constexpr int kThreads = 128;

struct PlanParams {
  int tokens, sequences, chunk, local_tokens;
  int starts[2];  // the stream starts of the rank's two chunks
  bool causal;
};

// Table entries of sequences s0 .. s0 + 31 (lane s0 + lane), and the q_offsets
// entries they end. `carry` is c'[s0] in, c'[s0 + 32] out.
__device__ void write_segments(const PlanParams& p, const std::int32_t* cu_seqlens, int s0, int* carry,
                               std::int32_t* q_offsets, std::int32_t* kv_ranges) {
  const int s = s0 + (static_cast<int>(threadIdx.x) & 31);
  int begin = 0;
  int end = 0;
  warp_safe_ranges(cu_seqlens, p.sequences, p.tokens, s0, carry, &begin, &end);
  if (s >= p.sequences) return;
  const std::int64_t S = p.sequences;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int x0 = p.starts[half];
    // Entry S (chunk one's end, chunk two's start) is c either way.
    q_offsets[half * S + s + 1] = half * p.chunk + clamp_to(end - x0, 0, p.chunk);
    const bool empty = max(begin, x0) >= min(end, x0 + p.chunk);
    std::int32_t* range = kv_ranges + 2 * (half * S + s);
    range[0] = empty ? 0 : begin;
    range[1] = empty ? 0 : (p.causal ? min(end, x0 + p.chunk) : end);
  }
}

__global__ void __launch_bounds__(kThreads) context_parallel_plan_kernel(PlanParams p,
                                                                         const std::int32_t* __restrict__ cu_seqlens,
                                                                         std::int32_t* __restrict__ q_offsets,
                                                                         std::int32_t* __restrict__ kv_ranges,
                                                                         std::int32_t* __restrict__ positions) {
  if (blockIdx.x == 0) {
    if (threadIdx.x >= 32) return;
    if (threadIdx.x == 0) q_offsets[0] = 0;
    int carry = 0;
    for (int s0 = 0; s0 < p.sequences; s0 += 32) write_segments(p, cu_seqlens, s0, &carry, q_offsets, kv_ranges);
    return;
  }
  const int t = static_cast<int>((blockIdx.x - 1) * kThreads + threadIdx.x);
  if (t >= p.local_tokens) return;
  const int stream = t < p.chunk ? p.starts[0] + t : p.starts[1] + (t - p.chunk);
  positions[t] = stream - sequence_start_of(cu_seqlens, p.sequences, p.tokens, stream);
}

}  // namespace

void launch_context_parallel_plan(const ContextParallelPlanDesc& desc, const std::int32_t* cu_seqlens,
                                  std::int32_t* q_offsets, std::int32_t* kv_ranges, std::int32_t* positions,
                                  CUstream_st* stream) {
  check_context_parallel_plan(desc);
  SG_CHECK(cu_seqlens != nullptr && q_offsets != nullptr && kv_ranges != nullptr && positions != nullptr,
           "context-parallel plan: cu_seqlens, q_offsets, kv_ranges and positions must be device pointers, got a "
           "null one");
  const auto c = static_cast<int>(desc.chunk());
  const PlanParams p{.tokens = static_cast<int>(desc.tokens),
                     .sequences = static_cast<int>(desc.sequences),
                     .chunk = c,
                     .local_tokens = static_cast<int>(desc.local_tokens()),
                     .starts = {desc.rank * c, (2 * desc.ranks - 1 - desc.rank) * c},
                     .causal = desc.causal};
  const auto blocks = static_cast<unsigned>(1 + (desc.local_tokens() + kThreads - 1) / kThreads);
  context_parallel_plan_kernel<<<blocks, kThreads, 0, stream>>>(p, cu_seqlens, q_offsets, kv_ranges, positions);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
