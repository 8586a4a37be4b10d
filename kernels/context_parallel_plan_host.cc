// The host side of kernels/context_parallel_plan.h: the checks and the plain
// reference (Note [Context-parallel token layout]).
#include <algorithm>
#include <limits>

#include "engine/error.h"
#include "kernels/attention.h"
#include "kernels/context_parallel_plan.h"

namespace stepgraph::kernels {

void check_context_parallel_plan(const ContextParallelPlanDesc& d) {
  SG_CHECK(d.ranks > 0 && d.rank >= 0 && d.rank < d.ranks,
           "context-parallel plan: rank must be in [0, ranks), got rank ", d.rank, " of ", d.ranks);
  SG_CHECK(d.tokens > 0 && d.sequences > 0, "context-parallel plan: tokens and sequences must be > 0, got ", d.tokens,
           " and ", d.sequences);
  SG_CHECK(d.tokens % (2 * d.ranks) == 0, "context-parallel plan: the batch's ", d.tokens,
           " tokens must divide into 2 x ", d.ranks, " = ", 2 * d.ranks,
           " equal chunks (each rank holds two); pad the batch to a multiple of ", 2 * d.ranks, " tokens");
  SG_CHECK(
      d.tokens <= std::numeric_limits<std::int32_t>::max() && d.segments() < std::numeric_limits<std::int32_t>::max(),
      "context-parallel plan: tokens (", d.tokens, ") and 2 x sequences (", d.segments(), ") must be < 2^31");
}

namespace host {

void context_parallel_plan(const ContextParallelPlanDesc& desc, const std::int32_t* cu_seqlens, std::int32_t* q_offsets,
                           std::int32_t* kv_ranges, std::int32_t* positions) {
  check_context_parallel_plan(desc);
  check_cu_seqlens({.tokens = desc.tokens, .sequences = desc.sequences}, cu_seqlens);
  const std::int64_t c = desc.chunk();
  const std::int64_t S = desc.sequences;
  const std::int64_t starts[2] = {desc.rank * c, (2 * desc.ranks - 1 - desc.rank) * c};
  for (int half = 0; half < 2; ++half) {
    const std::int64_t x0 = starts[half];
    for (std::int64_t s = 0; s <= S; ++s) {
      q_offsets[half * S + s] =
          static_cast<std::int32_t>(half * c + std::clamp<std::int64_t>(cu_seqlens[s] - x0, 0, c));
    }
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
      const bool empty = std::max(begin, x0) >= std::min(end, x0 + c);
      std::int32_t* range = kv_ranges + 2 * (half * S + s);
      range[0] = empty ? 0 : static_cast<std::int32_t>(begin);
      range[1] = empty ? 0 : static_cast<std::int32_t>(desc.causal ? std::min(end, x0 + c) : end);
    }
  }
  std::int64_t s = 0;
  for (std::int64_t t = 0; t < desc.local_tokens(); ++t) {
    const std::int64_t stream = t < c ? starts[0] + t : starts[1] + (t - c);
    if (t == c) s = 0;  // the second chunk starts again from the first sequence
    while (cu_seqlens[s + 1] <= stream) ++s;
    positions[t] = static_cast<std::int32_t>(stream - cu_seqlens[s]);
  }
}

}  // namespace host
}  // namespace stepgraph::kernels
