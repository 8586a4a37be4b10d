// HostWorld: a world of N ranks as threads of one process, with the same
// collectives as NCCL, so every multi-rank path (data parallelism, the
// capture uniformity check, faults) runs in CI on machines without a GPU.
//
//   HostWorld::run(4, [](Communicator& comm) {
//     Context ctx(Device::kHost, 1);           // each rank its own context
//     ... ops::all_reduce_(ctx, comm, grads, ReduceOp::kSum) ...
//   });
//
// Note [Host collectives]
// A collective is a meeting: each rank posts its call (kind, count, dtype,
// operator, root, buffer) and waits until every rank has posted; a rank whose
// call differs ends the meeting with an Error on every rank naming both calls.
// Then each rank computes its own result from the other ranks' buffers, in
// rank order (so every rank gets the same bits, whatever the thread timing),
// waits until every rank has read, and only then writes its result, since a
// receive buffer may be another rank's send buffer of the same call (in
// place). Send copies into a mailbox and returns; recv takes from it. A
// captured step's ring steps copy into the receiver's pool instead, with
// atomic flags (Note [The pool as symmetric memory]), unless the world is
// made without peer copies.
//
// Faults: a wait longer than the world's timeout, or a rank that ends with
// an exception (run() catches it), aborts the world: every rank's pending and
// later calls raise an Error naming the rank, the call and its number.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "engine/communicator.h"

namespace stepgraph {

class HostWorld {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::minutes(5)};

  // peer_copies: captured send_recv by copies into the peers' pools
  // (Note [The pool as symmetric memory]); false keeps the mailbox, as NCCL
  // stays where peers are out of reach.
  explicit HostWorld(int size, std::chrono::milliseconds timeout = kDefaultTimeout, bool peer_copies = true);
  ~HostWorld();
  HostWorld(const HostWorld&) = delete;
  HostWorld& operator=(const HostWorld&) = delete;

  int size() const;
  // Rank `rank`'s communicator (one per rank; the world must outlive it).
  std::unique_ptr<Communicator> communicator(int rank, std::string name = "world");

  // Runs body(comm) on `size` threads, one communicator each, and joins them.
  // A rank that throws aborts the world (the others' pending calls end with
  // an Error); run() then throws the first rank's error, with its rank.
  static void run(int size, const std::function<void(Communicator& comm)>& body,
                  std::chrono::milliseconds timeout = kDefaultTimeout, bool peer_copies = true);

  struct Shared;  // the meeting state (host_world.cc)

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace stepgraph
