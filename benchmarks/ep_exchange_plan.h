// What ep_exchange_bench routes and counts: each rank's splits under a named
// routing, the rows every rank sends every other, and the bytes a dispatch
// and combine move, both as routed and as the padded exchange moves them.
//
// Note [Exchange bandwidth]
// P ranks, E experts (rank q owns experts [q E/P, (q + 1) E/P)), R = tokens
// x topk rows a rank, rows of H elements of `element_bytes`. Every rank
// routes with the same splits (uniform: R / E rows an expert; skewed: expert
// e's share proportional to 1 / (e + 1), Zipf's law, so rank 0's experts
// receive most: 77% at E = 8, P = 2). S[p][q] = the rows rank p sends rank
// q's experts. One exchange is a dispatch (rank p sends S[p][q] rows to q)
// and a combine (the same rows back), so per rank:
//   routed_bytes       = 2 R H element_bytes (every row goes out and comes
//                        back, the rows a rank keeps included: all_to_all_single's
//                        count, nccl-tests' alltoall "size" for equal splits)
//   cross_rank_bytes   = H element_bytes (sum over q != p of S[p][q] + S[q][p]),
//                        sent in dispatch and combine: the bytes that cross links;
//                        the row reports the busiest rank's
//   padded_bytes       = 2 (P - 1) R H element_bytes: what the padded NCCL
//                        exchange sends a rank whatever the routing (the bound)
// With t the time of one exchange (the slowest rank's):
//   algbw_gbps = routed_bytes / t, cross_rank_gbps = busiest cross_rank_bytes / t,
//   ratio_vs_nccl = t(NCCL's all-to-all) / t(ours): the same rows moved, so
//   the ratio of bandwidths (goal >= 0.8).
// The captured exchange by peer copies moves its rows with a kernel of
// EpPeerOptions::blocks thread blocks (8 by default, so that it runs beside
// the experts' GEMMs; 1 to 132), and its bandwidth grows with them until the
// links are full: each warp copies one row at a time, looking its route up
// first (dependent loads) and keeping a few 16-byte loads a lane in flight,
// so the bytes in flight grow with the warps. --copy-blocks times the same
// captured exchange once per count (rows stepgraph_graph_blocksN, the same
// bytes, each with its ratio_vs_nccl), and best_copy_blocks names the
// fastest per routing: the count to weigh against what the GEMMs beside it
// lose. The padded exchange has no copy kernel; its rows differ only by
// noise.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace stepgraph::bench {

// "uniform" or "skewed" -> the rows a rank routes to each of `experts`
// (summing to `rows`); Error(kInvalidArgument) naming --routing otherwise.
std::vector<std::int64_t> routing_splits(std::string_view routing, std::int64_t rows, std::int64_t experts);

// S[p][q]: the rows rank p sends rank q when every rank routes by `splits`
// over `ranks` ranks (the experts must divide by the ranks).
std::vector<std::vector<std::int64_t>> rows_between_ranks(const std::vector<std::int64_t>& splits, int ranks);

struct ExchangeBytes {
  std::int64_t routed_bytes = 0;          // per rank, dispatch + combine
  std::int64_t cross_rank_bytes_max = 0;  // the busiest rank's, dispatch + combine
  std::vector<std::int64_t> cross_rank_bytes;  // every rank's
  std::int64_t padded_bytes = 0;          // per rank, the padded exchange's
};

// Note [Exchange bandwidth]'s bytes of one exchange.
ExchangeBytes exchange_bytes(const std::vector<std::vector<std::int64_t>>& between, std::int64_t rows,
                             std::int64_t hidden, std::int64_t element_bytes);

}  // namespace stepgraph::bench
