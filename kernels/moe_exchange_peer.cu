// The expert-parallel peer copy's kernels: the route table (one block: warps
// scan the ranks' counts, 32 at a time; then a thread per segment; warp 0
// scans the lengths) and the copy (a few blocks, one warp per row,
// grid-stride, the widest word that the row length and every pointer allow;
// pure copies, so any dtype moves bit for bit). The copy's stores go to the
// receivers' memory through their peer mappings; its last fence makes them
// visible before the flag the op posts after it (Note [Expert-parallel
// exchange] in ops/moe_exchange_ops.h).
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/moe_exchange_device.cuh"
#include "kernels/moe_exchange_peer.cuh"
#include "kernels/moe_exchange_peer.h"
#include "kernels/moe_routing.h"

namespace stepgraph::kernels {
namespace {

constexpr int kRouteThreads = 256;
constexpr int kCopyWarps = 8;

// See Note [Expert-parallel routes]; the host reference is host::ep_routes.
__global__ void __launch_bounds__(kRouteThreads)
    routes_kernel(EpPlanDesc d, EpDirection direction, const std::int32_t* __restrict__ counts, std::int32_t* routes) {
  __shared__ std::int32_t rows[kMaxExperts];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t P = d.ranks, E = d.experts, W = E + 1;
  const ep::RouteOffsets at = ep::route_offsets(d);
  std::int32_t* clamped = routes + at.clamped;

  for (std::int64_t p = warp; p < P; p += kRouteThreads / 32) {
    const std::int64_t total = ep::warp_clamped_sums(
        counts + p * E, E, d.rows, [&](std::int64_t, std::int64_t g, std::int32_t c_at, std::int32_t) {
          if (g < E) clamped[p * W + g] = c_at;
        });
    if (lane == 0) clamped[p * W + E] = static_cast<std::int32_t>(min(total, d.rows));
  }
  __syncthreads();  // the block's global writes are visible to the block after it
  for (std::int64_t t = threadIdx.x; t < E; t += kRouteThreads) {
    const ep::Segment s = ep::route_segment(d, direction, clamped, t);
    rows[t] = static_cast<std::int32_t>(s.rows);
    routes[at.src + t] = static_cast<std::int32_t>(s.src);
    routes[at.dst + t] = static_cast<std::int32_t>(s.dst);
  }
  if (threadIdx.x == 0) routes[at.filled] = static_cast<std::int32_t>(ep::route_filled(d, direction, clamped));
  __syncthreads();
  if (warp != 0) return;
  const std::int64_t carry =
      ep::warp_starts(rows, E, [&](std::int64_t t, std::int32_t start) { routes[at.start + t] = start; });
  if (lane == 0) routes[at.start + E] = static_cast<std::int32_t>(carry);
}

template <typename W>
__global__ void __launch_bounds__(kCopyWarps * 32)
    peer_copy_kernel(EpCopyDesc c, const std::int32_t* __restrict__ routes, const W* __restrict__ rows,
                     ep::RankRows<W> out, std::int64_t words) {
  const std::int64_t n = ep::peer_copy_rows(c, routes);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kCopyWarps;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  for (std::int64_t o = static_cast<std::int64_t>(blockIdx.x) * kCopyWarps + threadIdx.x / 32; o < n; o += warps) {
    const ep::PeerRow row = ep::peer_copy_row(c, routes, o);
    ep::copy_row<W>(out.at[row.receiver] + row.dst * words, row.src < 0 ? nullptr : rows + row.src * words, words,
                    lane);
  }
  // The rows land in the peers' memory before the stream's next operation
  // (the flag post) is seen there.
  __threadfence_system();
}

}  // namespace

void launch_ep_routes(const EpPlanDesc& desc, EpDirection direction, const std::int32_t* counts, std::int32_t* routes,
                      cudaStream_t stream) {
  check_ep_plan(desc);
  SG_CHECK(counts != nullptr && routes != nullptr, "ep_routes: counts and routes must not be null");
  routes_kernel<<<1, kRouteThreads, 0, stream>>>(desc, direction, counts, routes);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_ep_peer_copy(const EpCopyDesc& desc, int blocks, const std::int32_t* routes, const void* rows,
                         void* const* receivers, cudaStream_t stream) {
  check_ep_peer_copy(desc, blocks);
  const EpPlanDesc& d = desc.plan;
  if (d.rows == 0) return;
  SG_CHECK(routes != nullptr && rows != nullptr && receivers != nullptr,
           "ep_peer_copy: routes, rows and receivers must not be null");
  // The most rows one copy writes: a dispatch sends at most R rows, a
  // combine returns at most P*R and zeroes at most R.
  const std::int64_t bound = desc.direction == EpDirection::kDispatch ? d.rows : (d.ranks + 1) * d.rows;
  const std::int64_t needed = (bound + kCopyWarps - 1) / kCopyWarps;
  const auto grid = static_cast<unsigned>(needed < blocks ? needed : blocks);
  ep::with_word(desc.row_bytes, rows, receivers, d.ranks, [&](auto word) {
    using W = decltype(word);
    ep::RankRows<W> out{};
    for (int q = 0; q < d.ranks; ++q) out.at[q] = static_cast<W*>(receivers[q]);
    peer_copy_kernel<W><<<grid, kCopyWarps * 32, 0, stream>>>(desc, routes, static_cast<const W*>(rows), out,
                                                              static_cast<std::int64_t>(desc.row_bytes / sizeof(W)));
  });
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
