// Inputs and expectations of the expert-parallel exchange tests
// (tests/ops/moe_exchange_ops_test.cc, moe_exchange_peer_test.cc): one
// rank's splits and x_perm under a routing (every rank can make every
// rank's: the expectations need them all), the step's persistent inputs,
// and what a dispatch and a round trip deliver (Note [Expert-parallel plan]
// in kernels/moe_exchange.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/dtype.h"
#include "engine/tensor.h"

namespace stepgraph::testing {

// E experts (a multiple of every world size), R rows of x_perm a rank
// (tokens x k), rows of H elements.
struct EpExchangeShape {
  std::int64_t experts = 0;
  std::int64_t rows = 0;
  std::int64_t hidden = 0;
  std::size_t row_bytes(DType dtype) const { return static_cast<std::size_t>(hidden) * dtype_size(dtype); }
};

enum class EpRouting {
  kRandom,
  kAllToRankZero,        // every row of every rank to rank 0's experts
  kRankReceivesNothing,  // no row to the last rank's experts
  kEmptyExpert,          // experts 1 and E - 1 receive nothing from anyone
  kRankKeepsItsRows,     // rank 1 (of one rank: rank 0) routes only to its own experts: it sends nothing to peers
  kRankSendsNothing,     // rank 1 (of one rank: rank 0) has no rows at all (splits all zero)
  kCountsOutOfRange,     // rank 0 has a negative split and splits summing past R
};

inline std::string ep_routing_name(EpRouting routing) {
  switch (routing) {
    case EpRouting::kRandom: return "random";
    case EpRouting::kAllToRankZero: return "all_to_rank0";
    case EpRouting::kRankReceivesNothing: return "last_rank_receives_nothing";
    case EpRouting::kEmptyExpert: return "empty_expert";
    case EpRouting::kRankKeepsItsRows: return "rank_keeps_its_rows";
    case EpRouting::kRankSendsNothing: return "rank_sends_nothing";
    case EpRouting::kCountsOutOfRange: return "counts_out_of_range";
  }
  return "?";
}

// One rank's input: splits [E] and x_perm [R, H] as raw bytes.
struct EpRankInput {
  std::vector<std::int32_t> splits;
  std::vector<std::uint8_t> x;
};

inline EpRankInput make_ep_input(const EpExchangeShape& s, std::uint32_t seed, int rank, int ranks, EpRouting routing,
                                 DType dtype) {
  std::mt19937 rng(seed * 7919u + static_cast<std::uint32_t>(rank));
  const std::int64_t L = s.experts / ranks;
  const int keeper = ranks > 1 ? 1 : 0;
  std::int64_t low = 0, high = s.experts;  // experts this rank's rows may choose
  if (routing == EpRouting::kAllToRankZero) high = L;
  if (routing == EpRouting::kRankReceivesNothing) high = s.experts - L;
  if (routing == EpRouting::kRankKeepsItsRows && rank == keeper) low = rank * L, high = (rank + 1) * L;
  EpRankInput in{std::vector<std::int32_t>(static_cast<std::size_t>(s.experts), 0), {}};
  std::uniform_int_distribution<std::int64_t> pick(low, high - 1);
  for (std::int64_t row = 0; row < s.rows; ++row) {
    std::int64_t e = pick(rng);
    while (routing == EpRouting::kEmptyExpert && (e == 1 || e == s.experts - 1)) e = pick(rng);
    ++in.splits[static_cast<std::size_t>(e)];
  }
  if (routing == EpRouting::kRankSendsNothing && rank == keeper) std::fill(in.splits.begin(), in.splits.end(), 0);
  if (routing == EpRouting::kCountsOutOfRange && rank == 0) {
    in.splits[0] = -3;
    in.splits[static_cast<std::size_t>(s.experts - 1)] += static_cast<std::int32_t>(s.rows);
  }
  in.x.resize(static_cast<std::size_t>(s.rows) * s.row_bytes(dtype));
  std::uniform_int_distribution<int> byte(0, 255);
  for (std::uint8_t& b : in.x) b = static_cast<std::uint8_t>(byte(rng));
  return in;
}

// c[g]: the rows of experts before g, counts clamped to [0, R].
inline std::vector<std::int64_t> ep_clamped_starts(const std::vector<std::int32_t>& splits, std::int64_t rows) {
  std::vector<std::int64_t> c(splits.size() + 1, 0);
  std::int64_t sum = 0;
  for (std::size_t g = 0; g <= splits.size(); ++g) {
    c[g] = std::min(sum, rows);
    if (g < splits.size()) sum += std::max(splits[g], 0);
  }
  return c;
}

struct EpDispatched {
  std::vector<std::uint8_t> rows;    // the received rows, unpadded
  std::vector<std::int32_t> splits;  // [E/P]
};

// What rank r's experts receive from every rank's input `all`: by local
// expert, then by source rank.
inline EpDispatched expected_ep_dispatch(const EpExchangeShape& s, const std::vector<EpRankInput>& all, int r,
                                         DType dtype) {
  const int P = static_cast<int>(all.size());
  const std::int64_t L = s.experts / P;
  const std::size_t B = s.row_bytes(dtype);
  EpDispatched out{{}, std::vector<std::int32_t>(static_cast<std::size_t>(L), 0)};
  for (std::int64_t e = 0; e < L; ++e) {
    const std::int64_t g = r * L + e;
    for (int p = 0; p < P; ++p) {
      const std::vector<std::int64_t> c = ep_clamped_starts(all[static_cast<std::size_t>(p)].splits, s.rows);
      const std::vector<std::uint8_t>& x = all[static_cast<std::size_t>(p)].x;
      for (std::int64_t j = c[g]; j < c[g + 1]; ++j) {
        out.rows.insert(out.rows.end(), x.begin() + static_cast<std::ptrdiff_t>(j * B),
                        x.begin() + static_cast<std::ptrdiff_t>((j + 1) * B));
        ++out.splits[static_cast<std::size_t>(e)];
      }
    }
  }
  return out;
}

// combine(dispatch(x)): x's routed rows, zero past them.
inline std::vector<std::uint8_t> expected_ep_round_trip(const EpExchangeShape& s, const EpRankInput& in, DType dtype) {
  const std::size_t routed = static_cast<std::size_t>(ep_clamped_starts(in.splits, s.rows).back()) * s.row_bytes(dtype);
  std::vector<std::uint8_t> out(in.x.begin(), in.x.begin() + static_cast<std::ptrdiff_t>(routed));
  out.resize(in.x.size(), 0);
  return out;
}

// The step's persistent inputs.
struct EpInputs {
  Tensor x;       // x_perm [R, H]
  Tensor splits;  // int32 [E]
};

inline EpInputs make_ep_inputs_on(Context& ctx, const EpExchangeShape& s, const std::string& prefix, DType dtype) {
  return {ctx.persistent(prefix + "x_perm", {Shape{s.rows, s.hidden}, dtype}),
          ctx.persistent(prefix + "splits", {Shape{s.experts}, DType::kInt32})};
}

inline void load_ep_inputs(Context& ctx, const EpInputs& in, const EpRankInput& values) {
  ctx.copy_from_host(in.x, values.x.data(), values.x.size());
  ctx.copy_from_host(in.splits, values.splits.data(), values.splits.size() * sizeof(std::int32_t));
}

inline std::vector<std::uint8_t> tensor_bytes(Context& ctx, const Tensor& t) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(t.bytes()));
  ctx.copy_to_host(t, out.data(), out.size());
  return out;
}

}  // namespace stepgraph::testing
