#include "trainer/expert_ranks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>
#include <vector>

#include "engine/error.h"
#include "train/expert_data_parallel_groups.h"

namespace stepgraph::trainer {
namespace {

// "{0, 2, 4}" for the `count` world ranks first, first + stride, ...; long ones
// as "{0, 2, ..., 126}".
std::string rank_set(int first, int stride, int count) {
  if (count <= 4) {
    std::vector<int> ranks;
    for (int i = 0; i < count; ++i) ranks.push_back(first + i * stride);
    return fmt::format("{{{}}}", fmt::join(ranks, ", "));
  }
  return fmt::format("{{{}, {}, ..., {}}}", first, first + stride, first + (count - 1) * stride);
}

// The `count` items item(0), item(1), ..., a long list as its first three and last.
template <typename Item>
std::string listed(int count, const Item& item) {
  std::vector<std::string> out;
  for (int i = 0; i < count; ++i) {
    if (count > 4 && i == 3) {
      out.push_back("...");
      i = count - 1;
    }
    out.push_back(item(i));
  }
  return fmt::format("{}", fmt::join(out, ", "));
}

}  // namespace

ExpertRanks expert_ranks(const TrainerOptions& o, int rank, int ranks) {
  if (o.dp > 0) {
    SG_CHECK(ranks == o.ep * o.dp, "--ep ", o.ep, " x --dp ", o.dp, " needs a world of ", o.ep * o.dp,
             " ranks (each of the ", o.dp, " replicas spreads the experts over ", o.ep, " ranks), but this run has ",
             ranks, "; start ", o.ep * o.dp, " ranks (--nproc-per-node ", o.ep * o.dp,
             " or a launcher), or leave --dp out (the world / --ep replicas)");
  } else {
    SG_CHECK(ranks % o.ep == 0, "--ep ", o.ep, " needs a world of a multiple of ", o.ep, " ranks (--ep x --dp: ", o.ep,
             " expert-parallel ranks in each data-parallel replica), but this run has ", ranks, "; start ", o.ep,
             " x --dp ranks (--nproc-per-node or a launcher), or pass an --ep that divides ", ranks);
  }
  ExpertRanks e;
  e.ep = static_cast<int>(o.ep);
  e.dp = ranks / e.ep;
  e.rank = rank;
  e.experts = o.experts;
  e.local_experts = o.experts / o.ep;
  SG_CHECK(o.batch % ranks == 0, "--batch ", o.batch, " is the global batch and must split evenly over the ", ranks,
           " ranks (--ep ", e.ep, " x ", e.dp, " data-parallel replicas: each rank trains its own ",
           o.heads > 0 ? "sequences" : "examples", "); make it a multiple of ", ranks);
  e.rows = o.batch / ranks;
  return e;
}

ExpertGroups expert_groups(Communicator& world, const ExpertRanks& e) {
  ExpertGroups groups;
  if (e.dp == 1) {
    groups.expert_parallel = &world;
    return groups;
  }
  ExpertDataParallelGroups split;
  try {
    split = split_expert_data_parallel(world, e.ep);
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kUnsupported) throw;
    // A refusal of the flags on this device (exit status 2, never restarted), as options.cc's are.
    SG_THROW(ErrorCode::kInvalidArgument, "--ep ", e.ep, " with ", e.dp,
             " data-parallel replicas (--dp) splits the world into expert-parallel and expert-data-parallel "
             "groups, which ",
             world.describe(),
             " cannot (host processes do not split a world); run it on cuda, or at --dp 1 (a world of --ep ranks)");
  }
  groups.owned_expert_parallel = std::move(split.expert_parallel);
  groups.owned_expert_data_parallel = std::move(split.expert_data_parallel);
  groups.expert_parallel = groups.owned_expert_parallel.get();
  groups.expert_data_parallel = groups.owned_expert_data_parallel.get();
  return groups;
}

std::string expert_setup_line(const ExpertRanks& e, const ExpertGroups& groups, const Communicator& world,
                              std::int64_t moe_blocks, std::int64_t tokens, std::int64_t topk, bool sequences) {
  const Communicator& ep = *groups.expert_parallel;
  const auto experts_of = [&e](int r) {
    return fmt::format("[{}, {})", r * e.local_experts, (r + 1) * e.local_experts);
  };
  // Note [Expert-parallel exchange] in ops/moe_exchange_ops.h: a captured step's exchange copies the counted rows
  // into the owning rank's pool where the communicator has peer copies; eager steps (and communicators without
  // them) send each rank's R = tokens x topk routed rows in slots of R rows whatever the routing. Either way a block
  // receives into ep x R rows, the bound no routing exceeds.
  const std::int64_t routed = tokens * topk;
  const bool peer = ep.peer_transport() == PeerTransport::kPeerCopy;
  const std::string captured =
      peer ? fmt::format(
                 "a captured step copies the counted rows straight into the owning rank's pool (peer copies: "
                 "{}), an eager step sends the padded all-to-all of the bound by send/recv",
                 ep.peer_transport_reason())
           : fmt::format("the padded all-to-all of the bound by send/recv, captured or eager (no peer copies: {})",
                         ep.peer_transport_reason());
  const std::string blocks =
      moe_blocks == 1 ? std::string("the one MoE block") : fmt::format("each of the {} MoE blocks", moe_blocks);
  const std::string rows =
      fmt::format("each rank trains its own {} {} of the global batch", e.rows, sequences ? "sequences" : "examples");
  const std::string exchange = fmt::format(
      "({} routed rows a rank, received into {} rows a block whatever the "
      "routing: nothing dropped)",
      routed, e.ep * routed);
  if (e.dp == 1) {
    return fmt::format(
        "expert parallel: {} ranks ({}), experts {} in {}; {}; the replicated parameters' gradients are summed over "
        "the {} ranks, the experts' stay on their rank; the exchange: {} {}\n",
        e.ep, ep.describe(), listed(e.ep, [&](int r) { return fmt::format("{} on rank {}", experts_of(r), r); }),
        blocks, rows, e.ep, captured, exchange);
  }
  return fmt::format(
      "expert x data parallel: {} ranks ({}), {} expert-parallel x {} replicas, expert parallelism innermost; the "
      "replicas' expert-parallel groups: {}; experts {} (each set an expert-data-parallel group) in {}; this rank "
      "({}) is EP rank {} of replica {} ({}; {}); {}; the replicated parameters' gradients are summed over the {} "
      "ranks, each expert's over the {} ranks holding it; the exchange, within a replica: {} {}\n",
      e.ep * e.dp, world.describe(), e.ep, e.dp, listed(e.dp, [&](int d) { return rank_set(d * e.ep, 1, e.ep); }),
      listed(e.ep, [&](int r) { return fmt::format("{} on ranks {}", experts_of(r), rank_set(r, e.ep, e.dp)); }),
      blocks, e.rank, e.ep_rank(), e.replica(), ep.describe(), groups.expert_data_parallel->describe(), rows,
      e.ep * e.dp, e.dp, captured, exchange);
}

}  // namespace stepgraph::trainer
