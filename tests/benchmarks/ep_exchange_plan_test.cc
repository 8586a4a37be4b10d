// ep_exchange_bench's routing and byte counts (Note [Exchange bandwidth] in
// benchmarks/ep_exchange_plan.h): uniform and skewed splits of the moe
// config's rows, the rows between ranks, the routed, crossing and padded
// bytes, and the errors.
#include "benchmarks/ep_exchange_plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph::bench {
namespace {

std::int64_t sum(const std::vector<std::int64_t>& v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); }

// The moe config: 8192 tokens x top-2 = 16384 rows over 8 experts.
TEST(EpExchangePlanTest, UniformGivesEveryExpertItsShare) {
  EXPECT_EQ(routing_splits("uniform", 16384, 8), std::vector<std::int64_t>(8, 2048));
  const std::vector<std::int64_t> odd = routing_splits("uniform", 10, 4);
  EXPECT_EQ(odd, (std::vector<std::int64_t>{3, 3, 2, 2}));  // the rounding's rows to the first experts
  EXPECT_EQ(routing_splits("uniform", 0, 4), std::vector<std::int64_t>(4, 0));
}

TEST(EpExchangePlanTest, SkewedFollowsZipfAndSendsMostRowsToRankZero) {
  const std::vector<std::int64_t> splits = routing_splits("skewed", 16384, 8);
  EXPECT_EQ(sum(splits), 16384);
  for (std::size_t e = 1; e < splits.size(); ++e) EXPECT_GE(splits[e - 1], splits[e]) << "expert " << e;
  EXPECT_NEAR(static_cast<double>(splits[0]) / static_cast<double>(splits[1]), 2.0, 1e-3);
  const std::vector<std::vector<std::int64_t>> between = rows_between_ranks(splits, 2);
  const double to_rank_zero = static_cast<double>(between[0][0]) / 16384.0;
  EXPECT_NEAR(to_rank_zero, (1 + 1 / 2.0 + 1 / 3.0 + 1 / 4.0) / 2.717857, 1e-3);  // 77%
  EXPECT_EQ(between[1], between[0]) << "every rank routes alike";
}

TEST(EpExchangePlanTest, RowsBetweenRanksSumTheirExperts) {
  const std::vector<std::vector<std::int64_t>> between = rows_between_ranks({1, 2, 3, 4, 5, 6, 7, 8}, 4);
  ASSERT_EQ(between.size(), 4u);
  EXPECT_EQ(between[2], (std::vector<std::int64_t>{3, 7, 11, 15}));
  EXPECT_ERROR_CONTAINS(rows_between_ranks({1, 2, 3}, 2), "the 3 experts do not divide by 2 ranks");
}

TEST(EpExchangePlanTest, BytesOfOneDispatchAndCombine) {
  // Two ranks, uniform over 8 experts: half of each rank's 16384 rows cross, out and back.
  const std::int64_t row = 2048 * 2;  // hidden 2048, bf16
  const ExchangeBytes uniform = exchange_bytes(rows_between_ranks(routing_splits("uniform", 16384, 8), 2), 16384,
                                               2048, 2);
  EXPECT_EQ(uniform.routed_bytes, 2 * 16384 * row);
  EXPECT_EQ(uniform.padded_bytes, 2 * 16384 * row);  // (P - 1) R rows each way
  EXPECT_EQ(uniform.cross_rank_bytes, (std::vector<std::int64_t>{16384 * row, 16384 * row}));
  EXPECT_EQ(uniform.cross_rank_bytes_max, 16384 * row);
  // Four ranks: the padded exchange sends 3 R rows each way, the routing 3/4 of R.
  const ExchangeBytes four = exchange_bytes(rows_between_ranks(routing_splits("uniform", 16384, 8), 4), 16384,
                                            2048, 2);
  EXPECT_EQ(four.padded_bytes, 2 * 3 * 16384 * row);
  EXPECT_EQ(four.cross_rank_bytes_max, 2 * 12288 * row);
  // Every row kept at home: nothing crosses, the padded exchange still moves the bound.
  const ExchangeBytes home = exchange_bytes({{10, 0}, {0, 10}}, 10, 4, 2);
  EXPECT_EQ(home.cross_rank_bytes_max, 0);
  EXPECT_EQ(home.padded_bytes, 2 * 10 * 8);
}

TEST(EpExchangePlanTest, UnknownRoutingNamesTheFlag) {
  EXPECT_ERROR_CONTAINS(routing_splits("zipf", 10, 4), "--routing: unknown routing 'zipf'", "uniform, skewed");
  EXPECT_ERROR_CONTAINS(routing_splits("uniform", 10, 0), "experts must be >= 1");
}

}  // namespace
}  // namespace stepgraph::bench
