#include "trainer/expert_ranks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "engine/error.h"

namespace stepgraph::trainer {

ExpertRanks expert_ranks(const TrainerOptions& o, int rank, int ranks) {
  SG_CHECK(ranks == o.ep, "--ep ", o.ep, " needs a world of ", o.ep,
           " ranks (expert parallelism runs alone for now: "
           "the world is --ep ranks), but this run has ",
           ranks, "; start ", o.ep, " ranks (--nproc-per-node ", o.ep, " or a launcher), or pass --ep ", ranks);
  ExpertRanks e;
  e.ep = static_cast<int>(o.ep);
  e.rank = rank;
  e.experts = o.experts;
  e.local_experts = o.experts / o.ep;
  e.rows = o.batch / o.ep;  // options.cc checked that it divides
  return e;
}

std::string expert_setup_line(const ExpertRanks& e, const Communicator& ep, std::int64_t moe_blocks,
                              std::int64_t tokens, std::int64_t topk, bool sequences) {
  std::vector<std::string> placed;
  for (int r = 0; r < e.ep; ++r) {
    placed.push_back(fmt::format("[{}, {}) on rank {}", r * e.local_experts, (r + 1) * e.local_experts, r));
  }
  // Note [Expert-parallel exchange] in ops/moe_exchange_ops.h: a captured step's exchange copies the counted rows
  // into the owning rank's pool where the communicator has peer copies; eager steps (and communicators without
  // them) send each rank's R = tokens x topk routed rows in slots of R rows whatever the routing. Either way a block
  // receives into ep x R rows, the bound no routing exceeds.
  const std::int64_t routed = tokens * topk;
  const bool peer = ep.peer_transport() == PeerTransport::kPeerCopy;
  const std::string captured =
      peer ? fmt::format("a captured step copies the counted rows straight into the owning rank's pool (peer copies: "
                         "{}), an eager step sends the padded all-to-all of the bound by send/recv",
                         ep.peer_transport_reason())
           : fmt::format("the padded all-to-all of the bound by send/recv, captured or eager (no peer copies: {})",
                         ep.peer_transport_reason());
  return fmt::format(
      "expert parallel: {} ranks ({}), experts {} in {}; each rank trains its own {} {} of "
      "the global batch; the replicated parameters' gradients are summed over the {} ranks, the experts' stay on "
      "their rank; the exchange: {} ({} routed rows a rank, received into {} rows a block whatever the routing: "
      "nothing dropped)\n",
      e.ep, ep.describe(), fmt::join(placed, ", "),
      moe_blocks == 1 ? std::string("the one MoE block") : fmt::format("each of the {} MoE blocks", moe_blocks), e.rows,
      sequences ? "sequences" : "examples", e.ep, captured, routed, e.ep * routed);
}

}  // namespace stepgraph::trainer
