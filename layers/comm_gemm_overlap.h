// How a tensor-parallel GEMM meets its collective ("userbuffers" overlap),
// chosen per GEMM as a plain value (it enters the graph key).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "engine/communicator.h"
#include "engine/context.h"
#include "graphs/graph_key.h"

namespace stepgraph {

// Note [Communication-GEMM overlap]
// A sequence-parallel layer all-gathers its token shards before a
// column-parallel GEMM and reduce-scatters the partial sums after a
// row-parallel one (Note [Sequence-parallel LayerNormMLP], Note [Column- and
// row-parallel Linear]). Each such pair is chosen on its own (LayerNormMLP's
// four in MLPOverlap, Linear's two in LinearConfig) and runs one of four ways:
//   none           the collective on the compute stream, then the GEMM:
//                  nothing hides the communication (the baseline).
//   bulk           the whole collective on the communication stream; the
//                  planner's events let independent work (weight gradients
//                  on their own stream) run beside it.
//   ring_exchange  all-gather + GEMM in N steps: at step i the GEMM
//                  multiplies the shard at hand (rank r - i's) while that
//                  shard travels on to rank r + 1 (send_recv on the
//                  communication stream), so N - 1 of the N transfers hide
//                  behind GEMMs. The arriving shards are also copied into
//                  the gathered tensor the backward saves (a copy-engine
//                  copy on the weight-gradient stream).
//   pipelined      GEMM + reduce-scatter in N steps along a ring: at step i
//                  rank r computes its partial product of the token block
//                  bound for rank r - i - 1, adds the partial sum that
//                  arrived from rank r - 1 for that block, and sends the sum
//                  on to rank r + 1; after N - 1 hops each block has
//                  collected every rank's part and rests at its owner. The
//                  GEMM of one step runs while the previous step's sum
//                  travels.
// Chunks are whole token shards (rank-major rows, as all_gather lays them
// out), so every mode gives each token the same rows of the same GEMMs:
// ring_exchange equals none bit for bit (the chunks are row windows of one
// GEMM: Note [Row windows of a GEMM]). pipelined adds the ranks' parts of a
// block in ring order (r+1, r+2, ..., r) instead of rank order: bit for bit
// with two ranks (a + b == b + a), a rounding apart with more.
//
// The buffers the ranks exchange (the shards in flight, the partial sums,
// the gathered tensors) are values of the step's one static pool, at
// addresses fixed when the step is planned and recorded into the graph once:
// no buffer is allocated per step and there is no second pool. Each ring
// step is ops::ring_shift. In a captured step whose ranks map each other's
// GPUs it is a peer copy straight into the neighbour's pool value, on a copy
// engine, with flags in mapped memory (Note [The pool as symmetric memory]
// in engine/peer_window.h): no NCCL kernel takes SMs from the chunk GEMMs.
// Elsewhere (eager, another host, NCCL_P2P_DISABLE=1) NCCL's send/recv moves
// the same bytes; docs/communication_performance.md has the numbers of both.
enum class CommOverlap : std::uint8_t { kNone, kBulk, kRingExchange, kPipelined };
std::string_view comm_overlap_name(CommOverlap mode);  // "none", "bulk", "ring_exchange", "pipelined"
// The mode of a name; an Error listing the names otherwise.
CommOverlap parse_comm_overlap(std::string_view name);

// The overlap of each communicating GEMM of a sequence-parallel MLP
// (LayerNormMLP): two all-gather + GEMM pairs (ring_exchange allowed) and two
// GEMM + reduce-scatter pairs (pipelined allowed). none and bulk fit all.
struct MLPOverlap {
  CommOverlap fc1_fprop = CommOverlap::kBulk;  // all_gather(normed) -> fc1
  CommOverlap fc2_fprop = CommOverlap::kBulk;  // fc2 -> reduce_scatter(y)
  CommOverlap fc2_dgrad = CommOverlap::kBulk;  // all_gather(dy) -> fc2's data gradient
  CommOverlap fc1_dgrad = CommOverlap::kBulk;  // fc1's data gradient -> reduce_scatter(d_normed)

  // The usual choices: every pair none, every pair bulk, or overlapped
  // (ring_exchange for the all-gathers, pipelined for the reduce-scatters).
  static MLPOverlap uniform(CommOverlap mode);
  static MLPOverlap overlapped();
  // "none", "bulk", "overlap" (overlapped()), or four names joined by commas
  // in the fields' order ("ring_exchange,pipelined,bulk,none").
  static MLPOverlap parse(std::string_view text);

  // An Error naming the field whose mode does not fit its collective.
  void check(std::string_view who) const;
  GraphKey key() const;
  std::string to_string() const;  // "fc1_fprop=ring_exchange fc2_fprop=pipelined ..."
  bool operator==(const MLPOverlap&) const = default;
};

// Sends the collectives called in its scope to the current stream instead of
// the communication stream (overlap none).
class InlineCollectives {
 public:
  explicit InlineCollectives(Context& ctx);
  ~InlineCollectives();
  InlineCollectives(const InlineCollectives&) = delete;
  InlineCollectives& operator=(const InlineCollectives&) = delete;

 private:
  Context& ctx_;
  int previous_;
};

// All-gathers x [t, ...] of every rank into [N t, ...] (rank r's rows at
// [r t, (r + 1) t)) and runs gemm(rows, first_row) over the gathered rows:
// once on the whole at row 0 (none, bulk) or shard by shard as the shards
// arrive (ring_exchange). Returns the gathered tensor.
using RowsGemm = std::function<void(const Tensor& rows, std::int64_t first_row)>;
Tensor all_gather_gemm(Context& ctx, Communicator& comm, const Tensor& x, CommOverlap mode, const RowsGemm& gemm);

// This rank's rows [r t, (r + 1) t) of the sum over the ranks of a partial
// product P [N t, n], where partial(first_row, rows) returns the fresh rows
// [first_row, first_row + rows) of this rank's P: computed whole and
// reduce-scattered (none, bulk), or block by block along the ring
// (pipelined). `all_rows` is N t.
using PartialRows = std::function<Tensor(std::int64_t first_row, std::int64_t rows)>;
Tensor gemm_reduce_scatter(Context& ctx, Communicator& comm, std::int64_t all_rows, CommOverlap mode,
                           const PartialRows& partial);

}  // namespace stepgraph
