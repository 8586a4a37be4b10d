// Argument checks of the expert-parallel peer copy and the host references of
// its kernels: the same route table (Note [Expert-parallel routes]) and the
// same rows (kernels/moe_exchange_peer.cuh) as the CUDA kernels; pure byte
// copies, so host and device agree bit for bit. On host, receivers[q] is rank
// q's buffer by its address (a thread world shares one process).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "engine/error.h"
#include "kernels/moe_exchange_peer.cuh"
#include "kernels/moe_exchange_peer.h"

namespace stepgraph::kernels {

void check_ep_peer_copy(const EpCopyDesc& desc, int blocks) {
  check_ep_copy(desc);
  SG_CHECK(blocks >= 1 && blocks <= kMaxEpPeerCopyBlocks, "expert-parallel peer copy: blocks must be in [1, ",
           kMaxEpPeerCopyBlocks, "], got ", blocks, " (EpPeerOptions::blocks)");
}

namespace host {

void ep_routes(const EpPlanDesc& desc, EpDirection direction, const std::int32_t* counts, std::int32_t* routes) {
  check_ep_plan(desc);
  const ep::RouteOffsets at = ep::route_offsets(desc);
  const std::int64_t P = desc.ranks, E = desc.experts, W = E + 1;
  std::int32_t* clamped = routes + at.clamped;
  for (std::int64_t p = 0; p < P; ++p) {
    std::int64_t sum = 0;
    for (std::int64_t g = 0; g <= E; ++g) {
      clamped[p * W + g] = static_cast<std::int32_t>(std::min(sum, desc.rows));
      if (g < E) sum += std::max(counts[p * E + g], 0);
    }
  }
  std::int64_t running = 0;
  for (std::int64_t t = 0; t < E; ++t) {
    const ep::Segment s = ep::route_segment(desc, direction, clamped, t);
    routes[at.start + t] = static_cast<std::int32_t>(running);
    routes[at.src + t] = static_cast<std::int32_t>(s.src);
    routes[at.dst + t] = static_cast<std::int32_t>(s.dst);
    running += s.rows;
  }
  routes[at.start + E] = static_cast<std::int32_t>(running);
  routes[at.filled] = static_cast<std::int32_t>(ep::route_filled(desc, direction, clamped));
}

void ep_peer_copy(const EpCopyDesc& desc, const std::int32_t* routes, const void* rows, void* const* receivers) {
  check_ep_copy(desc);
  const std::size_t B = desc.row_bytes;
  const std::int64_t n = ep::peer_copy_rows(desc, routes);
  for (std::int64_t o = 0; o < n; ++o) {
    const ep::PeerRow row = ep::peer_copy_row(desc, routes, o);
    auto* dst = static_cast<std::uint8_t*>(receivers[row.receiver]) + row.dst * B;
    if (row.src < 0) {
      std::memset(dst, 0, B);
    } else {
      std::memcpy(dst, static_cast<const std::uint8_t*>(rows) + row.src * B, B);
    }
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
