#include "benchmarks/ep_exchange_plan.h"

#include <algorithm>
#include <numeric>

#include "engine/error.h"

namespace stepgraph::bench {

std::vector<std::int64_t> routing_splits(std::string_view routing, std::int64_t rows, std::int64_t experts) {
  SG_CHECK(experts >= 1 && rows >= 0, "routing_splits: experts must be >= 1 and rows >= 0, got ", experts, " and ",
           rows);
  std::vector<double> weight(static_cast<std::size_t>(experts), 1.0);
  if (routing == "skewed") {
    for (std::int64_t e = 0; e < experts; ++e) weight[static_cast<std::size_t>(e)] = 1.0 / static_cast<double>(e + 1);
  } else {
    SG_CHECK(routing == "uniform", "--routing: unknown routing '", routing, "'; known: uniform, skewed");
  }
  const double total = std::accumulate(weight.begin(), weight.end(), 0.0);
  std::vector<std::int64_t> splits(weight.size());
  std::int64_t given = 0;
  for (std::size_t e = 0; e < weight.size(); ++e) {
    splits[e] = static_cast<std::int64_t>(static_cast<double>(rows) * weight[e] / total);
    given += splits[e];
  }
  // The rows rounding left over go to the first experts, one each.
  for (std::size_t e = 0; given < rows; e = (e + 1) % splits.size(), ++given) ++splits[e];
  return splits;
}

std::vector<std::vector<std::int64_t>> rows_between_ranks(const std::vector<std::int64_t>& splits, int ranks) {
  const auto experts = static_cast<std::int64_t>(splits.size());
  SG_CHECK(ranks >= 1 && experts % ranks == 0, "the ", experts, " experts do not divide by ", ranks,
           " ranks (each rank owns experts / ranks of them)");
  const std::int64_t local = experts / ranks;
  std::vector<std::int64_t> to_rank(static_cast<std::size_t>(ranks), 0);
  for (std::int64_t e = 0; e < experts; ++e) to_rank[static_cast<std::size_t>(e / local)] += splits[e];
  return std::vector<std::vector<std::int64_t>>(static_cast<std::size_t>(ranks), to_rank);
}

ExchangeBytes exchange_bytes(const std::vector<std::vector<std::int64_t>>& between, std::int64_t rows,
                             std::int64_t hidden, std::int64_t element_bytes) {
  const std::size_t p = between.size();
  const std::int64_t row_bytes = hidden * element_bytes;
  ExchangeBytes out;
  out.routed_bytes = 2 * rows * row_bytes;
  out.padded_bytes = 2 * static_cast<std::int64_t>(p - 1) * rows * row_bytes;
  for (std::size_t r = 0; r < p; ++r) {
    std::int64_t crossing = 0;
    for (std::size_t q = 0; q < p; ++q) {
      if (q != r) crossing += between[r][q] + between[q][r];  // sent in the dispatch, and in the combine
    }
    out.cross_rank_bytes.push_back(crossing * row_bytes);
  }
  out.cross_rank_bytes_max = *std::max_element(out.cross_rank_bytes.begin(), out.cross_rank_bytes.end());
  return out;
}

}  // namespace stepgraph::bench
