// A host Communicator whose ranks are separate processes that meet through a
// Rendezvous (launch/rendezvous.h): `trainer --device host
// --nproc-per-node 2`, and torchrun / srun / mpirun launches of host runs.
//
//   auto rendezvous = Rendezvous::connect(launch_info_from_env(), run_tag, std::chrono::seconds(60));
//   std::unique_ptr<Communicator> comm = make_rendezvous_communicator(std::move(rendezvous));
//
// Note [Collectives over the rendezvous]
// Every collective is one or more exchanges of the rendezvous: each rank
// gives its bytes to Rendezvous::all_gather (broadcast from rank 0: to
// Rendezvous::broadcast), gets every rank's, and reduces them itself with
// reduce_on_host in rank order, so every rank gets the same bits, and so
// does a HostWorld of the same size on the same inputs. Buffers larger than
// 16 MiB travel in parts of at most 16 MiB (one exchange each), so that no
// exchange comes near Rendezvous::kMaxBlobBytes. Each rank receives every
// rank's bytes (the reduce_scatter's whole send buffers, too): this is for CI
// and small host runs, not for speed.
//
// The `what` of each exchange names the call and its number on this
// communicator, e.g. "all_reduce(1024 fp32, sum) #12" (", part 2 of 3" for
// the parts of a large one). Rank 0 of the rendezvous compares the `what` of
// every rank, so two ranks making different calls (kind, count, dtype,
// operator, root) or calls out of order is an Error (kInvalidState) on every
// rank naming both calls; the communicator is then spent.
//
// Point to point. Every exchange of the rendezvous involves every rank, so a
// send or recv is carried honestly only where it does involve every rank:
//   - In a world of two, send, recv and send_recv are transfers paired half
//     by half, as NCCL pairs them: a grouped send_recv on one rank pairs with
//     a lone recv and a later lone send on the other (a pipeline's 1F1B with
//     one microbatch). Each blocks until its halves are done, so a send
//     waits for its receive; transfers that can never move (both ranks send
//     first) are an Error naming both calls, not a hang. See Note
//     [Transfers in a world of two] (launch/rendezvous_pair_transfers.h).
//     They are named "send(8 fp32 to rank 1), transfer #3", numbered apart
//     from the collectives (the ranks may make different numbers of them).
//   - In a larger world send_recv is a collective: every rank must call it
//     (a ring, a shift), with the same count and dtype; each rank gives its
//     bytes and its pair (to, from), and takes the bytes of `from`. A rank
//     whose `to` does not receive from it is an Error on every rank naming
//     both. A lone send or recv is ErrorCode::kUnsupported there: use
//     send_recv with every rank taking part, or the thread world (HostWorld)
//     or NCCL, where point to point is real.
//
// Faults. A dead rank (its connection closes) or one slower than the
// rendezvous's timeout (Rendezvous::set_timeout) is the rendezvous's Error
// (kIo) on every rank, naming that rank and the call. Any failure of an
// exchange spends the communicator: the rendezvous is closed at once, so the
// ranks still waiting on this one fail fast, every later call raises
// kInvalidState naming the first failure, and check_health() raises it (with
// its own code). There is no thread watching the sockets between calls, so a
// peer that dies between calls is seen by the next call, not by check_health.
// abort(reason) does the same from any thread: closes the rendezvous and
// ends later calls with an Error. The rendezvous serves one thread at a time
// and its sockets cannot be closed under a call in flight on another thread,
// so an abort during such a call closes the rendezvous when the call returns
// (with an Error), at the latest after the rendezvous's timeout (twice it on
// ranks other than 0: Note [Peers wait twice as long]); a process
// that exits after abort(), as the trainer's watchdog does, closes it then.
// Argument errors (negative counts, fp8 reductions) are raised before any
// exchange and spend nothing.
#pragma once

#include <memory>
#include <string>

#include "engine/communicator.h"
#include "launch/rendezvous.h"

namespace stepgraph {

// A host Communicator over a Rendezvous (ranks in separate processes); its
// rank and world size are the rendezvous's. See Note [Collectives over the
// rendezvous].
[[nodiscard]] std::unique_ptr<Communicator> make_rendezvous_communicator(std::unique_ptr<Rendezvous> rendezvous,
                                                                         std::string name = "world");

}  // namespace stepgraph
