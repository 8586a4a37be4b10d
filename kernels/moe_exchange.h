// Expert-parallel exchange on the device: the plan and the row copies that
// move a MoE layer's permuted rows to the ranks owning their experts and back
// (ops/moe_exchange_ops.h has the exchange itself and its Note). Every count
// is read on the device; shapes depend only on (P, R, H, E).
//
//   ep_plan      counts int32 [P, E] -> plan int32 [plan_ints], splits int32 [E/P]
//   ep_pack      rows -> P slots [R, H], one per peer (dispatch: x_perm [R, H];
//                combine: the expert rows [P*R, H])
//   ep_unpack    P slots [R, H], one per peer -> rows (dispatch: [P*R, H] by
//                local expert; combine: y_perm [R, H] in x_perm order)
// (The peer transport's route table and copy, which move the counted rows
// only: kernels/moe_exchange_peer.h.)
//
// Note [Expert-parallel plan]
// Counts are device values a bad router could make negative or too large, so
// the plan first makes them safe, the same way on every rank: rank p's row
// becomes the clamped running sum c_p[g] = min(R, sum_{g' < g} max(0,
// counts[p][g'])), and p sends c_p[g + 1] - c_p[g] rows of expert g. Every
// rank derives the same numbers from the same counts, so what a sender packs
// is what its receiver unpacks, and no copy leaves its buffer. The plan of
// rank r (L = E/P local experts, segment s = e*P + p: the rows rank p sends
// to local expert e):
//   send_off [P + 1]  c_r[q*L]: rank r's rows for peer q are x_perm[send_off[q], send_off[q + 1])
//   out_off  [E + 1]  where segment s starts in the dispatched rows (a scan over s)
//   in_off   [E]      where segment s starts in rank p's slot for r: c_p[r L + e] - c_p[r L]
// Splits (rows per local expert) are out_off[(e + 1) P] - out_off[e P].
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

// Most ranks of an expert-parallel group: the copy kernels take one pointer
// per peer as a kernel argument.
inline constexpr int kMaxEpRanks = 64;

struct EpPlanDesc {
  int rank = 0;              // r
  int ranks = 1;             // P
  std::int64_t experts = 0;  // E, a multiple of P
  std::int64_t rows = 0;     // R: rows of x_perm (tokens * k)
  constexpr std::int64_t local_experts() const { return experts / ranks; }
  // Entries of the plan: send_off, out_off, in_off.
  constexpr std::int64_t plan_ints() const { return (ranks + 1) + (experts + 1) + experts; }
};

// Which way rows move: to the experts' ranks, or back to the tokens' ranks.
enum class EpDirection : std::uint8_t { kDispatch, kCombine };

struct EpCopyDesc {
  EpPlanDesc plan;
  EpDirection direction = EpDirection::kDispatch;
  std::size_t row_bytes = 0;  // H * dtype size
};

// 1 <= P <= kMaxEpRanks, E % P == 0, 1 <= E <= kMaxExperts (moe_routing.h),
// rank in [0, P), R in [0, 2^31) with P*R < 2^31.
void check_ep_plan(const EpPlanDesc& desc);
void check_ep_copy(const EpCopyDesc& desc);

// counts [P, E] -> plan [plan_ints] and splits [E/P] (Note [Expert-parallel plan]).
void launch_ep_plan(const EpPlanDesc& desc, const std::int32_t* counts, std::int32_t* plan, std::int32_t* splits,
                    cudaStream_t stream);
// rows -> slots[q] [R, H] for every peer q; rows without a source are zero.
void launch_ep_pack(const EpCopyDesc& desc, const std::int32_t* plan, const void* rows, void* const* slots,
                    cudaStream_t stream);
// slots[p] [R, H] from every peer p -> rows; rows without a source are zero.
void launch_ep_unpack(const EpCopyDesc& desc, const std::int32_t* plan, const void* const* slots, void* rows,
                      cudaStream_t stream);

namespace host {
void ep_plan(const EpPlanDesc& desc, const std::int32_t* counts, std::int32_t* plan, std::int32_t* splits);
void ep_pack(const EpCopyDesc& desc, const std::int32_t* plan, const void* rows, void* const* slots);
void ep_unpack(const EpCopyDesc& desc, const std::int32_t* plan, const void* const* slots, void* rows);
}  // namespace host

}  // namespace stepgraph::kernels
