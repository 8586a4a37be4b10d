// Argument checks of the expert-parallel exchange kernels and their host
// references: the same plan (Note [Expert-parallel plan]) and the same row
// sources (kernels/moe_exchange.cuh) as the CUDA kernels; pure byte copies,
// so host and device agree bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "kernels/moe_exchange.cuh"
#include "kernels/moe_exchange.h"
#include "kernels/moe_routing.h"

namespace stepgraph::kernels {

void check_ep_plan(const EpPlanDesc& desc) {
  constexpr std::int64_t kMaxRows = std::numeric_limits<std::int32_t>::max();
  SG_CHECK(desc.ranks >= 1 && desc.ranks <= kMaxEpRanks, "expert-parallel exchange: the group must have 1 to ",
           kMaxEpRanks, " ranks, got ", desc.ranks);
  SG_CHECK(desc.rank >= 0 && desc.rank < desc.ranks, "expert-parallel exchange: rank ", desc.rank, " is not in [0, ",
           desc.ranks, ")");
  SG_CHECK(desc.experts >= 1 && desc.experts <= kMaxExperts, "expert-parallel exchange: experts must be in [1, ",
           kMaxExperts, "], got ", desc.experts);
  SG_CHECK(desc.experts % desc.ranks == 0, "expert-parallel exchange: experts (", desc.experts,
           ") must be a multiple of the expert-parallel ranks (", desc.ranks,
           ") so every rank owns the same number of experts");
  SG_CHECK(desc.rows >= 0 && desc.rows * desc.ranks <= kMaxRows, "expert-parallel exchange: rows (", desc.rows,
           ") times ranks (", desc.ranks, ") must be below 2^31");
}

void check_ep_copy(const EpCopyDesc& desc) {
  check_ep_plan(desc.plan);
  SG_CHECK(desc.row_bytes > 0, "expert-parallel exchange: rows must have at least one element");
}

namespace host {

void ep_plan(const EpPlanDesc& desc, const std::int32_t* counts, std::int32_t* plan, std::int32_t* splits) {
  check_ep_plan(desc);
  const std::int64_t P = desc.ranks, E = desc.experts, L = desc.local_experts(), r = desc.rank;
  std::int32_t* send_off = plan;
  std::int32_t* out_off = plan + (P + 1);
  std::int32_t* in_off = out_off + (E + 1);
  std::vector<std::int32_t> len(static_cast<std::size_t>(E));
  for (std::int64_t p = 0; p < P; ++p) {
    // c_p[g] = min(R, sum of the nonnegative counts before g).
    std::vector<std::int32_t> c(static_cast<std::size_t>(E + 1));
    std::int64_t sum = 0;
    for (std::int64_t g = 0; g <= E; ++g) {
      c[g] = static_cast<std::int32_t>(std::min(sum, desc.rows));
      if (g < E) sum += std::max(counts[p * E + g], 0);
    }
    if (p == r) {
      for (std::int64_t q = 0; q <= P; ++q) send_off[q] = c[q * L];
    }
    for (std::int64_t e = 0; e < L; ++e) {
      const std::int64_t g = r * L + e;
      len[e * P + p] = c[g + 1] - c[g];
      in_off[e * P + p] = c[g] - c[r * L];
    }
  }
  out_off[0] = 0;
  for (std::int64_t s = 0; s < E; ++s) out_off[s + 1] = out_off[s] + len[s];
  for (std::int64_t e = 0; e < L; ++e) splits[e] = out_off[(e + 1) * P] - out_off[e * P];
}

void ep_pack(const EpCopyDesc& desc, const std::int32_t* plan, const void* rows, void* const* slots) {
  check_ep_copy(desc);
  const std::size_t B = desc.row_bytes;
  for (std::int64_t o = 0; o < ep::pack_rows(desc); ++o) {
    auto* dst = static_cast<std::uint8_t*>(slots[o / desc.plan.rows]) + (o % desc.plan.rows) * B;
    const std::int64_t src = ep::pack_source(desc, plan, o);
    if (src < 0) {
      std::memset(dst, 0, B);
    } else {
      std::memcpy(dst, static_cast<const std::uint8_t*>(rows) + src * B, B);
    }
  }
}

void ep_unpack(const EpCopyDesc& desc, const std::int32_t* plan, const void* const* slots, void* rows) {
  check_ep_copy(desc);
  const std::size_t B = desc.row_bytes;
  for (std::int64_t o = 0; o < ep::unpack_rows(desc); ++o) {
    auto* dst = static_cast<std::uint8_t*>(rows) + o * B;
    int slot = 0;
    const std::int64_t src = ep::unpack_source(desc, plan, o, &slot);
    if (src < 0) {
      std::memset(dst, 0, B);
    } else {
      std::memcpy(dst, static_cast<const std::uint8_t*>(slots[slot]) + src * B, B);
    }
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
