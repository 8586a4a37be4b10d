// The expert-parallel exchange kernels: the plan (one block: a warp scans a
// rank's counts, 32 at a time; warp 0 then scans the segments) and the row
// copies (one warp per output row, grid-stride, the widest word that the row
// length and every pointer allow; pure copies, so any dtype moves bit for bit).
#include <cstdint>
#include <initializer_list>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/moe_exchange.cuh"
#include "kernels/moe_exchange.h"
#include "kernels/moe_exchange_device.cuh"
#include "kernels/moe_routing.h"

namespace stepgraph::kernels {
namespace {

constexpr int kPlanThreads = 256;
constexpr int kCopyWarps = 8;
constexpr std::int64_t kMaxGridBlocks = 132 * 16;

// See Note [Expert-parallel plan]; the host reference is host::ep_plan.
__global__ void __launch_bounds__(kPlanThreads)
    plan_kernel(EpPlanDesc d, const std::int32_t* __restrict__ counts, std::int32_t* __restrict__ plan,
                std::int32_t* __restrict__ splits) {
  __shared__ std::int32_t len[kMaxExperts];
  __shared__ std::int32_t out[kMaxExperts + 1];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t P = d.ranks, E = d.experts, L = d.local_experts(), r = d.rank;
  std::int32_t* send_off = plan;
  std::int32_t* out_off = plan + (P + 1);
  std::int32_t* in_off = out_off + (E + 1);
  const std::int64_t first = r * L;  // this rank's first expert

  for (std::int64_t p = warp; p < P; p += kPlanThreads / 32) {
    std::int32_t base = 0;  // c_p[first]
    ep::warp_clamped_sums(counts + p * E, E, d.rows,
                          [&](std::int64_t g0, std::int64_t g, std::int32_t c_at, std::int32_t c_next) {
                            if (first >= g0 && first < g0 + 32)
                              base = __shfl_sync(0xffffffffu, c_at, static_cast<int>(first - g0));
                            if (g >= E) return;
                            if (p == r && g % L == 0) send_off[g / L] = c_at;
                            if (p == r && g == E - 1) send_off[P] = c_next;
                            if (g >= first && g < first + L) {
                              const std::int64_t s = (g - first) * P + p;
                              len[s] = c_next - c_at;
                              in_off[s] = c_at - base;
                            }
                          });
  }
  __syncthreads();
  if (warp != 0) return;
  const std::int64_t carry = ep::warp_starts(len, E, [&](std::int64_t s, std::int32_t start) {
    out[s] = start;
    out_off[s] = start;
  });
  if (lane == 0) {
    out[E] = static_cast<std::int32_t>(carry);
    out_off[E] = static_cast<std::int32_t>(carry);
  }
  __syncwarp();
  for (std::int64_t e = lane; e < L; e += 32) splits[e] = out[(e + 1) * P] - out[e * P];
}

template <typename W>
__global__ void __launch_bounds__(kCopyWarps * 32)
    pack_kernel(EpCopyDesc c, const std::int32_t* __restrict__ plan, const W* __restrict__ rows, ep::RankRows<W> slots,
                std::int64_t words) {
  const std::int64_t n = ep::pack_rows(c);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kCopyWarps;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (std::int64_t o = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32; o < n; o += warps) {
    const std::int64_t src = ep::pack_source(c, plan, o);
    W* dst = slots.at[o / c.plan.rows] + (o % c.plan.rows) * words;
    ep::copy_row<W>(dst, src < 0 ? nullptr : rows + src * words, words, lane);
  }
}

template <typename W>
__global__ void __launch_bounds__(kCopyWarps * 32)
    unpack_kernel(EpCopyDesc c, const std::int32_t* __restrict__ plan, ep::RankRows<const W> slots,
                  W* __restrict__ rows, std::int64_t words) {
  const std::int64_t n = ep::unpack_rows(c);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kCopyWarps;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (std::int64_t o = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32; o < n; o += warps) {
    int slot = 0;
    const std::int64_t src = ep::unpack_source(c, plan, o, &slot);
    ep::copy_row<W>(rows + o * words, src < 0 ? nullptr : slots.at[slot] + src * words, words, lane);
  }
}

unsigned grid_for_rows(std::int64_t rows) {
  const std::int64_t blocks = (rows + kCopyWarps - 1) / kCopyWarps;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks));
}

}  // namespace

void launch_ep_plan(const EpPlanDesc& desc, const std::int32_t* counts, std::int32_t* plan, std::int32_t* splits,
                    cudaStream_t stream) {
  check_ep_plan(desc);
  SG_CHECK(counts != nullptr && plan != nullptr && splits != nullptr,
           "ep_plan: counts, plan and splits must not be null");
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(desc, counts, plan, splits);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_pack(const EpCopyDesc& desc, const std::int32_t* plan, const void* rows, void* const* slots,
                    cudaStream_t stream) {
  check_ep_copy(desc);
  const std::int64_t n = ep::pack_rows(desc);
  if (n == 0) return;
  SG_CHECK(plan != nullptr && rows != nullptr && slots != nullptr, "ep_pack: plan, rows and slots must not be null");
  ep::with_word(desc.row_bytes, rows, slots, desc.plan.ranks, [&](auto word) {
    using W = decltype(word);
    ep::RankRows<W> out{};
    for (int q = 0; q < desc.plan.ranks; ++q) out.at[q] = static_cast<W*>(slots[q]);
    pack_kernel<W><<<grid_for_rows(n), kCopyWarps * 32, 0, stream>>>(
        desc, plan, static_cast<const W*>(rows), out, static_cast<std::int64_t>(desc.row_bytes / sizeof(W)));
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_unpack(const EpCopyDesc& desc, const std::int32_t* plan, const void* const* slots, void* rows,
                      cudaStream_t stream) {
  check_ep_copy(desc);
  const std::int64_t n = ep::unpack_rows(desc);
  if (n == 0) return;
  SG_CHECK(plan != nullptr && rows != nullptr && slots != nullptr, "ep_unpack: plan, slots and rows must not be null");
  ep::with_word(desc.row_bytes, rows, slots, desc.plan.ranks, [&](auto word) {
    using W = decltype(word);
    ep::RankRows<const W> in{};
    for (int p = 0; p < desc.plan.ranks; ++p) in.at[p] = static_cast<const W*>(slots[p]);
    unpack_kernel<W><<<grid_for_rows(n), kCopyWarps * 32, 0, stream>>>(
        desc, plan, in, static_cast<W*>(rows), static_cast<std::int64_t>(desc.row_bytes / sizeof(W)));
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
