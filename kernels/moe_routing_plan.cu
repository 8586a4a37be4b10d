// The stable permutation plan and the validated split offsets (See Note
// [Stable permutation] and Note [Routing error word] in kernels/moe_routing.h).
//
// Plan, three kernels; the grid depends only on the entry count T*k:
//   1. count:   a warp per chunk of kChunk entries counts each expert in
//               shared memory, 32 entries at a time (__match_any_sync groups
//               the lanes of one expert; the group's lowest lane adds its size).
//   2. scan:    one block: splits[e] = sum over chunks, offsets = exclusive
//               scan over experts, and each chunk's first row per expert
//               (offsets[e] + counts of the earlier chunks), in place.
//   3. scatter: a warp per chunk again; an entry's row is its chunk's base for
//               its expert plus the entries of that expert before it in the
//               chunk (the group's lanes below it, then the running count).
// Workspace: chunks * E int32 (counts, then bases); fully rewritten each launch.
#include <cstddef>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/moe_routing.h"

namespace stepgraph::kernels {
namespace {

constexpr int kChunk = 1024;  // entries per warp
constexpr int kPlanWarps = 8;
constexpr int kScanThreads = 1024;  // >= kMaxExperts

static_assert(kScanThreads >= kMaxExperts, "the scans hold one expert per thread");

std::int64_t chunks_of(const PlanDesc& desc) { return (desc.entries() + kChunk - 1) / kChunk; }

// The count and scatter kernels' layout: a warp per chunk of kChunk entries,
// each warp with `experts` int32 slots of the block's shared memory.
struct WarpChunk {
  int lane;
  std::int32_t* slots;
  std::int64_t chunk;
};
__device__ __forceinline__ WarpChunk warp_chunk(std::int32_t* shared, int experts) {
  const int warp = threadIdx.x / 32;
  return {static_cast<int>(threadIdx.x % 32), shared + warp * experts,
          static_cast<std::int64_t>(blockIdx.x) * kPlanWarps + warp};
}

__device__ __forceinline__ std::int32_t valid_expert(std::int32_t e, int experts, bool& out_of_range) {
  out_of_range = e < 0 || e >= experts;
  return out_of_range ? 0 : e;
}

__global__ void __launch_bounds__(kPlanWarps * 32)
    plan_count_kernel(const std::int32_t* __restrict__ chosen, std::int64_t entries, int experts, std::int64_t chunks,
                      std::int32_t* __restrict__ chunk_counts, std::int32_t* __restrict__ error_word) {
  extern __shared__ std::int32_t shared_counts[];
  const auto [lane, counts, chunk] = warp_chunk(shared_counts, experts);
  if (chunk >= chunks) return;  // whole warps; no block barrier below
  for (int e = lane; e < experts; e += 32) counts[e] = 0;
  __syncwarp();
  bool any_bad = false;
  const std::int64_t end = min(entries, (chunk + 1) * kChunk);
  for (std::int64_t base = chunk * kChunk; base < end; base += 32) {
    const std::int64_t i = base + lane;
    bool bad = false;
    const std::int32_t e = i < end ? valid_expert(chosen[i], experts, bad) : -1;
    any_bad |= bad;
    const unsigned group = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(group) - 1) counts[e] += __popc(group);
    __syncwarp();
  }
  for (int e = lane; e < experts; e += 32) chunk_counts[chunk * experts + e] = counts[e];
  if (any_bad) atomicOr(error_word, kExpertOutOfRange);  // an OR: order does not matter
}

// Exclusive scan of one value per thread over the block (kScanThreads threads).
__device__ std::int64_t block_exclusive_scan(std::int64_t value, std::int64_t* scratch, std::int64_t& total) {
  const int tid = threadIdx.x;
  __syncthreads();  // a previous scan's readers are done with scratch
  scratch[tid] = value;
  __syncthreads();
  for (int offset = 1; offset < kScanThreads; offset *= 2) {
    const std::int64_t add = tid >= offset ? scratch[tid - offset] : 0;
    __syncthreads();
    scratch[tid] += add;
    __syncthreads();
  }
  total = scratch[kScanThreads - 1];
  return scratch[tid] - value;
}

__global__ void __launch_bounds__(kScanThreads)
    plan_scan_kernel(std::int32_t* __restrict__ chunk_counts, std::int64_t chunks, int experts,
                     std::int32_t* __restrict__ splits, std::int32_t* __restrict__ offsets) {
  __shared__ std::int64_t scratch[kScanThreads];
  const int e = threadIdx.x;
  std::int64_t count = 0;
  if (e < experts) {
    for (std::int64_t c = 0; c < chunks; ++c) count += chunk_counts[c * experts + e];
  }
  std::int64_t total = 0;
  const std::int64_t first = block_exclusive_scan(count, scratch, total);
  if (e < experts) {
    splits[e] = static_cast<std::int32_t>(count);
    offsets[e] = static_cast<std::int32_t>(first);
    std::int64_t running = first;
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int32_t here = chunk_counts[c * experts + e];
      chunk_counts[c * experts + e] = static_cast<std::int32_t>(running);
      running += here;
    }
  }
  if (e == 0) offsets[experts] = static_cast<std::int32_t>(total);
}

__global__ void __launch_bounds__(kPlanWarps * 32)
    plan_scatter_kernel(const std::int32_t* __restrict__ chosen, std::int64_t entries, int experts, int topk,
                        std::int64_t chunks, const std::int32_t* __restrict__ chunk_bases,
                        std::int32_t* __restrict__ positions, std::int32_t* __restrict__ sources) {
  extern __shared__ std::int32_t shared_next[];
  const auto [lane, next, chunk] = warp_chunk(shared_next, experts);
  if (chunk >= chunks) return;
  for (int e = lane; e < experts; e += 32) next[e] = chunk_bases[chunk * experts + e];
  __syncwarp();
  const unsigned below = (1u << lane) - 1u;
  const std::int64_t end = min(entries, (chunk + 1) * kChunk);
  for (std::int64_t base = chunk * kChunk; base < end; base += 32) {
    const std::int64_t i = base + lane;
    bool bad = false;
    const std::int32_t e = i < end ? valid_expert(chosen[i], experts, bad) : -1;
    const unsigned group = __match_any_sync(0xffffffffu, e);
    if (e >= 0) {
      const std::int32_t row = next[e] + __popc(group & below);
      positions[i] = row;
      sources[row] = static_cast<std::int32_t>(i / topk);
    }
    __syncwarp();  // every lane has read next[e] before the leader moves it
    if (e >= 0 && lane == __ffs(group) - 1) next[e] += __popc(group);
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kScanThreads)
    split_offsets_kernel(const std::int32_t* __restrict__ splits, int experts, std::int64_t tokens, bool at_most,
                         std::int32_t* __restrict__ offsets, std::int32_t* __restrict__ error_word) {
  __shared__ std::int64_t scratch[kScanThreads];
  const int e = threadIdx.x;
  const std::int32_t split = e < experts ? splits[e] : 0;
  const int negative = __syncthreads_or(split < 0);
  std::int64_t clamped_total = 0;
  const std::int64_t before = block_exclusive_scan(split < 0 ? 0 : split, scratch, clamped_total);
  if (e < experts) offsets[e + 1] = static_cast<std::int32_t>(min(before + max(split, 0), tokens));
  // The raw sum: with a negative split, clamped_total is not it.
  std::int64_t raw_total = 0;
  block_exclusive_scan(split, scratch, raw_total);
  if (e == 0) {
    offsets[0] = 0;
    const bool bad_sum = at_most ? raw_total > tokens : raw_total != tokens;
    const std::int32_t error = (negative ? kSplitNegative : 0) | (bad_sum ? kSplitSumMismatch : 0);
    if (error != 0) *error_word |= error;  // the only writer in this launch
  }
}

}  // namespace

std::size_t moe_plan_workspace_bytes(const PlanDesc& desc) {
  check_plan(desc);
  return static_cast<std::size_t>(chunks_of(desc) * desc.experts) * sizeof(std::int32_t);
}

void launch_moe_plan(const PlanDesc& desc, const std::int32_t* experts, std::int32_t* splits, std::int32_t* offsets,
                     std::int32_t* positions, std::int32_t* sources, void* workspace, std::int32_t* error_word,
                     cudaStream_t stream) {
  check_plan(desc);
  SG_CHECK(experts != nullptr && splits != nullptr && offsets != nullptr && positions != nullptr &&
               sources != nullptr && error_word != nullptr,
           "moe_plan: experts, splits, offsets, positions, sources and error_word must not be null");
  SG_CHECK(workspace != nullptr, "moe_plan: workspace is null; allocate moe_plan_workspace_bytes(desc)");
  const std::int64_t chunks = chunks_of(desc);
  const int E = static_cast<int>(desc.experts);
  auto* chunk_counts = static_cast<std::int32_t*>(workspace);
  const auto blocks = static_cast<unsigned>((chunks + kPlanWarps - 1) / kPlanWarps);
  const std::size_t shared = static_cast<std::size_t>(kPlanWarps) * E * sizeof(std::int32_t);
  plan_count_kernel<<<blocks, kPlanWarps * 32, shared, stream>>>(experts, desc.entries(), E, chunks, chunk_counts,
                                                                 error_word);
  SG_CUDA_CHECK(cudaGetLastError());
  plan_scan_kernel<<<1, kScanThreads, 0, stream>>>(chunk_counts, chunks, E, splits, offsets);
  SG_CUDA_CHECK(cudaGetLastError());
  plan_scatter_kernel<<<blocks, kPlanWarps * 32, shared, stream>>>(experts, desc.entries(), E, desc.topk, chunks,
                                                                   chunk_counts, positions, sources);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_split_offsets(std::int64_t experts, std::int64_t tokens, const std::int32_t* splits, std::int32_t* offsets,
                          std::int32_t* error_word, cudaStream_t stream, SplitSum sum) {
  SG_CHECK(experts >= 1 && experts <= kMaxExperts, "split_offsets: experts must be in [1, ", kMaxExperts, "], got ",
           experts);
  SG_CHECK(tokens >= 0 && tokens < (std::int64_t{1} << 31), "split_offsets: tokens must be in [0, 2^31), got ", tokens);
  SG_CHECK(splits != nullptr && offsets != nullptr && error_word != nullptr,
           "split_offsets: splits, offsets and error_word must not be null");
  split_offsets_kernel<<<1, kScanThreads, 0, stream>>>(splits, static_cast<int>(experts), tokens,
                                                       sum == SplitSum::kAtMostRows, offsets, error_word);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
