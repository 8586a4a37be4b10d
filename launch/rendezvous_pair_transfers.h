// Point to point between the two ranks of a world of two over the rendezvous
// (launch/rendezvous_communicator.h): a send, a recv, or a send and a recv
// issued together (send_recv), each completing as it would on NCCL.
//
// Note [Transfers in a world of two]
// NCCL pairs sends and receives one by one, not call by call: stage 0's
// grouped send_recv (send the activation, receive its gradient) pairs with
// stage 1's lone recv of the activation and, a pass later, its lone send of
// the gradient. Each call here is a transfer of one or two halves (a send to
// the peer, a receive from it) and blocks until all its halves are done, as
// the transfers of one NCCL group on one stream do. The two ranks meet (one
// exchange of the rendezvous, "point to point #k") while either is in a
// transfer: each gives the halves it still waits for, with the first part of
// its send's bytes; a send moves where the peer waits to receive from this
// rank, and both ranks decide that alike from the same blobs. A rank whose
// halves are all done returns; one still waiting meets again, when the peer's
// next transfer comes. A send therefore waits for its receive, as on NCCL
// (the thread world buffers sends and is more lenient). Sends of more than a
// part (16 MiB) finish in more exchanges ("part k of K") in the same meeting.
//
// Errors, the same on both ranks: a meeting where no half can move (both send
// first, both receive first: on NCCL a hang) names both calls; a send and its
// receive of different sizes name both calls; a rank in a collective while
// the other meets is the rendezvous's mismatch (differing `what`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/error.h"

namespace stepgraph {

// One call's halves. A send of `send_bytes` from `send` (none: send_bytes < 0);
// a receive of `recv_bytes` into `recv` (none: recv_bytes < 0).
struct PairTransfer {
  std::string call;  // the caller's name for errors, e.g. "send(8 fp32 to rank 1), transfer #3"
  const std::byte* send = nullptr;
  std::int64_t send_bytes = -1;
  std::byte* recv = nullptr;
  std::int64_t recv_bytes = -1;
};

// Why a transfer cannot complete; both ranks get the same one.
struct PairTransferFault {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
};

// One exchange of the rendezvous: this rank's bytes in, both ranks' out (in rank order). It raises where the
// exchange fails.
using PairMeet = std::function<std::vector<std::string>(std::string_view local, const std::string& what)>;

// Runs `transfer` on rank `rank` (0 or 1) of a world of two, meeting the peer through `meet` as many times as it
// takes (Note [Transfers in a world of two]); `meetings` counts the meetings on this communicator (both ranks keep
// the same count). Returns a fault when the transfer cannot complete; `part_bytes` is the most bytes of one send in
// one exchange.
[[nodiscard]] std::optional<PairTransferFault> run_pair_transfer(int rank, const PairTransfer& transfer,
                                                                 std::int64_t part_bytes, std::int64_t& meetings,
                                                                 const PairMeet& meet);

}  // namespace stepgraph
