// The context-parallel plan's host reference (Note [Context-parallel token
// layout] in kernels/context_parallel_plan.h) against a token-by-token host
// computation: every rank's segments cover its tokens in order, each
// segment's queries are one sequence's tokens in one chunk, its keys that
// sequence's tokens up to the segment's end (causal) or all of them, and the
// positions are the tokens' places in their sequences; over CP 1, 2, 4 and
// packings with a sequence spanning every rank, one-token and empty
// sequences, and random ones (the seed prints on failure). Errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/context_parallel_plan.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

std::vector<std::int32_t> offsets_of(const std::vector<std::int32_t>& lengths) {
  std::vector<std::int32_t> cu{0};
  for (std::int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

struct Plan {
  std::vector<std::int32_t> q_offsets, kv_ranges, positions;
};

Plan plan_of(const ContextParallelPlanDesc& d, const std::vector<std::int32_t>& cu) {
  Plan p{std::vector<std::int32_t>(static_cast<std::size_t>(d.segments() + 1)),
         std::vector<std::int32_t>(static_cast<std::size_t>(2 * d.segments())),
         std::vector<std::int32_t>(static_cast<std::size_t>(d.local_tokens()))};
  host::context_parallel_plan(d, cu.data(), p.q_offsets.data(), p.kv_ranges.data(), p.positions.data());
  return p;
}

// The plan from its definition, one local token at a time.
void expect_plan(const ContextParallelPlanDesc& d, const std::vector<std::int32_t>& cu, const std::string& what) {
  const Plan got = plan_of(d, cu);
  const std::int64_t c = d.chunk(), S = d.sequences;
  const std::int64_t chunks[2] = {d.rank, 2 * d.ranks - 1 - d.rank};
  std::vector<std::int64_t> q_len(static_cast<std::size_t>(2 * S), 0), last(static_cast<std::size_t>(2 * S), -1);
  for (std::int64_t t = 0; t < d.local_tokens(); ++t) {
    const int half = t < c ? 0 : 1;
    const std::int64_t stream = chunks[half] * c + t % c;
    std::int64_t s = 0;
    while (!(cu[s] <= stream && stream < cu[s + 1])) ++s;
    EXPECT_EQ(got.positions[t], stream - cu[s]) << what << " position of local token " << t;
    const std::int64_t slot = half * S + s;
    // The token is the segment's (q_len)-th query.
    EXPECT_EQ(got.q_offsets[slot] + q_len[slot], t) << what << " local token " << t << " in segment " << slot;
    ++q_len[slot];
    last[slot] = stream;
  }
  for (std::int64_t slot = 0; slot < 2 * S; ++slot) {
    const std::int64_t s = slot % S;
    EXPECT_EQ(got.q_offsets[slot + 1] - got.q_offsets[slot], q_len[slot]) << what << " segment " << slot;
    const std::int32_t* range = got.kv_ranges.data() + 2 * slot;
    if (q_len[slot] == 0) {
      EXPECT_EQ(range[0], 0) << what << " empty segment " << slot;
      EXPECT_EQ(range[1], 0) << what << " empty segment " << slot;
      continue;
    }
    EXPECT_EQ(range[0], cu[s]) << what << " segment " << slot << " starts at its sequence's start";
    EXPECT_EQ(range[1], d.causal ? last[slot] + 1 : cu[s + 1]) << what << " segment " << slot << "'s key end";
  }
  EXPECT_EQ(got.q_offsets[2 * S], d.local_tokens()) << what;
}

std::string name(const ContextParallelPlanDesc& d, const std::vector<std::int32_t>& lengths) {
  std::string text = "cp" + std::to_string(d.ranks) + " rank " + std::to_string(d.rank) +
                     (d.causal ? " causal" : " full") + " lengths [";
  for (std::int32_t l : lengths) text += std::to_string(l) + ",";
  return text + "]";
}

TEST(ContextParallelPlanHostTest, SegmentsKeysAndPositionsFollowTheZigzagLayout) {
  testing::SeededRng rng;
  std::vector<std::vector<std::int32_t>> packings{
      {32},                      // one sequence spanning every rank
      {1, 15, 0, 16},            // a one-token and an empty sequence
      {3, 2, 5, 1, 7, 4, 6, 4},  // several short ones
  };
  std::vector<std::int32_t> random;
  for (int total = 0; total < 64;) {
    const std::int32_t l = std::min<std::int32_t>(64 - total, static_cast<std::int32_t>(rng() % 12));
    random.push_back(l);
    total += l;
  }
  packings.push_back(random);
  for (const std::vector<std::int32_t>& lengths : packings) {
    const std::vector<std::int32_t> cu = offsets_of(lengths);
    for (const int ranks : {1, 2, 4}) {
      for (int rank = 0; rank < ranks; ++rank) {
        for (const bool causal : {true, false}) {
          const ContextParallelPlanDesc d{.tokens = cu.back(),
                                          .sequences = static_cast<std::int64_t>(lengths.size()),
                                          .ranks = ranks,
                                          .rank = rank,
                                          .causal = causal};
          expect_plan(d, cu, name(d, lengths));
        }
      }
    }
  }
}

TEST(ContextParallelPlanHostTest, BadDescsAndPackingsAreClearErrors) {
  const std::vector<std::int32_t> cu{0, 5, 30};
  EXPECT_ERROR_CONTAINS(plan_of({.tokens = 30, .sequences = 2, .ranks = 4, .rank = 0}, cu), "30 tokens",
                        "2 x 4 = 8 equal chunks", "pad the batch to a multiple of 8");
  EXPECT_ERROR_CONTAINS(plan_of({.tokens = 32, .sequences = 2, .ranks = 2, .rank = 2}, cu),
                        "rank must be in [0, ranks)");
  EXPECT_ERROR_CONTAINS(plan_of({.tokens = 32, .sequences = 2, .ranks = 2, .rank = 0}, cu), "cu_seqlens[2]",
                        "token count 32");
}

}  // namespace
}  // namespace stepgraph::kernels
