// The group splits the grouped GEMM tests (bf16 and FP8) run every kernel on:
// device offsets [E + 1] of T tokens over E groups.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/grouped_gemm.h"

namespace stepgraph::testing {

inline constexpr kernels::GroupedGemmKind kGroupedKinds[] = {
    kernels::GroupedGemmKind::kForward, kernels::GroupedGemmKind::kDgrad, kernels::GroupedGemmKind::kWgrad};

struct Split {
  std::string name;
  std::vector<std::int32_t> offsets;  // E + 1
};

// Offsets from group sizes: {0, c0, c0 + c1, ...}.
inline std::vector<std::int32_t> offsets_of(const std::vector<std::int32_t>& counts) {
  std::vector<std::int32_t> offsets{0};
  for (std::int32_t c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

// The classes every grouped kernel must handle, for T tokens and E >= 2
// groups: balanced, all tokens in one group, random cuts with an empty
// group, and offsets that leave rows before offsets[0] and after offsets[E]
// in no group.
inline std::vector<Split> common_splits(std::int32_t tokens, std::int32_t experts, std::mt19937& rng) {
  std::vector<Split> out;
  std::vector<std::int32_t> counts(experts, tokens / experts);
  counts.back() += tokens % experts;
  out.push_back({"balanced", offsets_of(counts)});

  std::fill(counts.begin(), counts.end(), 0);
  counts[experts / 2] = tokens;
  out.push_back({"one_group_all", offsets_of(counts)});

  std::uniform_int_distribution<std::int32_t> cut(0, tokens);
  std::vector<std::int32_t> ragged{0};
  for (int e = 1; e < experts; ++e) ragged.push_back(cut(rng));
  std::sort(ragged.begin(), ragged.end());
  ragged.push_back(tokens);
  ragged[1] = ragged[0];  // an empty group
  out.push_back({"ragged_with_empty", ragged});

  std::vector<std::int32_t> partial = ragged;
  partial.front() = std::min<std::int32_t>(7, partial[1]);
  partial.back() = std::max<std::int32_t>(tokens - 11, partial[experts - 1]);
  out.push_back({"partial_cover", partial});
  return out;
}

}  // namespace stepgraph::testing
