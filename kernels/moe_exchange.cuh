// Where each row of an expert-parallel pack or unpack comes from, read from
// the plan (Note [Expert-parallel plan] in kernels/moe_exchange.h). Shared by
// the CUDA kernels and the host references, so both move the same rows.
// Compiled by nvcc (host and device) and by the host compiler.
#pragma once

#include <cstdint>

#include "kernels/moe_exchange.h"

#if defined(__CUDACC__)
#define SG_EP_HD __host__ __device__ __forceinline__
#else
#define SG_EP_HD inline
#endif

namespace stepgraph::kernels::ep {

// The plan's three tables.
struct PlanView {
  const std::int32_t* send_off;  // [P + 1]
  const std::int32_t* out_off;   // [E + 1]
  const std::int32_t* in_off;    // [E]
};

SG_EP_HD PlanView view(const EpPlanDesc& d, const std::int32_t* plan) {
  const std::int32_t* out = plan + (d.ranks + 1);
  return {plan, out, out + (d.experts + 1)};
}

// The last i in [0, n) with table[i * stride] <= value (table[0] <= value,
// the table ascending): the segment that holds `value`, if any does.
SG_EP_HD std::int64_t last_at_most(const std::int32_t* table, std::int64_t n, std::int64_t stride, std::int64_t value) {
  std::int64_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (table[mid * stride] <= value) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Rows a pack writes: one slot of R rows per peer.
SG_EP_HD std::int64_t pack_rows(const EpCopyDesc& c) { return c.plan.ranks * c.plan.rows; }
// Rows an unpack writes: the dispatched rows [P*R], or y_perm [R].
SG_EP_HD std::int64_t unpack_rows(const EpCopyDesc& c) {
  return c.direction == EpDirection::kDispatch ? c.plan.ranks * c.plan.rows : c.plan.rows;
}

// Row o of the packed slots (slot o / R, row o % R): its row in the pack's
// input, or -1 (a padding row, zero).
SG_EP_HD std::int64_t pack_source(const EpCopyDesc& c, const std::int32_t* plan, std::int64_t o) {
  const EpPlanDesc& d = c.plan;
  const PlanView v = view(d, plan);
  const std::int64_t slot = o / d.rows;
  const std::int64_t j = o % d.rows;
  if (c.direction == EpDirection::kDispatch) {
    // x_perm rows for peer `slot`, in x_perm order.
    return j < v.send_off[slot + 1] - v.send_off[slot] ? v.send_off[slot] + j : -1;
  }
  // Back to source rank p = slot: its segments e*P + p in expert order.
  const std::int64_t p = slot;
  const std::int64_t e = last_at_most(v.in_off + p, d.local_experts(), d.ranks, j);
  const std::int64_t s = e * d.ranks + p;
  const std::int64_t k = j - v.in_off[s];
  return k < v.out_off[s + 1] - v.out_off[s] ? v.out_off[s] + k : -1;
}

// Row o of the unpack's output: its row in slots[*slot], or -1 (zero).
SG_EP_HD std::int64_t unpack_source(const EpCopyDesc& c, const std::int32_t* plan, std::int64_t o, int* slot) {
  const EpPlanDesc& d = c.plan;
  const PlanView v = view(d, plan);
  if (c.direction == EpDirection::kDispatch) {
    const std::int64_t s = last_at_most(v.out_off, d.experts, 1, o);
    *slot = static_cast<int>(s % d.ranks);
    return o < v.out_off[s + 1] ? v.in_off[s] + (o - v.out_off[s]) : -1;
  }
  // Peer q's slot holds what this rank sent it, back in x_perm order.
  const std::int64_t q = last_at_most(v.send_off, d.ranks, 1, o);
  *slot = static_cast<int>(q);
  return o < v.send_off[q + 1] ? o - v.send_off[q] : -1;
}

}  // namespace stepgraph::kernels::ep
