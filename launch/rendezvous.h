// Rendezvous: the ranks of a multi-process run meet once, through rank 0, and
// pass small blobs: NCCL's ncclUniqueId, flag hashes, capture hashes.
//
//   auto rendezvous = Rendezvous::connect(launch_info_from_env(), run_tag, std::chrono::seconds(60));
//   const std::string id = rendezvous->broadcast(rank == 0 ? unique_id_bytes : "", "nccl unique id");
//   const std::vector<std::string> hashes = rendezvous->all_gather(flag_hash, "flag hashes");
//
// A TCP star (POSIX sockets, IPv4, hostnames through getaddrinfo): rank 0
// listens on master_addr:master_port, every other rank holds one connection
// to it, and every exchange goes through rank 0. Frames are length-prefixed
// and, after each connection's challenge over the run's secret, carry a MAC
// (Note [Rendezvous authentication] in rendezvous_auth.cc).
// Every exchange is collective: each rank makes the same exchanges, with the
// same `what`, in the same order; rank 0 checks that and answers a mismatch
// with an Error on every rank.
//
// Nothing here hangs: a rank that does not answer within the timeout, or
// whose connection closes (a rank that exited or crashed), is an Error on
// every rank naming it and the exchange. After an Error the rendezvous is
// spent: later calls raise kInvalidState. Errors: kInvalidArgument for bad
// arguments and ranks that disagree on how the run was started, kInvalidState
// for exchanges out of order, kIo for the network, timeouts and dead ranks.
//
// One thread at a time per Rendezvous. See Note [Rendezvous protocol] in
// rendezvous.cc.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/error.h"
#include "launch/launch_env.h"
#include "launch/rendezvous_auth.h"

namespace stepgraph {

class Rendezvous {
 public:
  // The largest blob one rank may give to one exchange.
  static constexpr std::size_t kMaxBlobBytes = std::size_t{64} << 20;

  // Rank 0 listens on master_addr:master_port (SO_REUSEADDR; Note [Where
  // rank 0 listens]); the others connect, retrying until `timeout`. Each
  // connection starts with a two-way challenge over info.secret, and every
  // later frame carries a MAC (Note [Rendezvous authentication]): a process
  // without the secret can neither join nor pose as rank 0, and is named in
  // the error. Every rank then gives its rank, world size and `run_tag` (what
  // must agree across ranks: a hash of the configuration, up to 4096 bytes);
  // a mismatch (a rank twice, another world size or tag) is an Error on every
  // rank naming the differing rank and value. A run over several hosts
  // without a secret is an Error (kInvalidArgument) saying how to pass one. A
  // world of one needs no socket. `timeout` is also the first per-exchange
  // timeout; no wait in joining outlasts it (rank 0), or twice it (the others).
  [[nodiscard]] static std::unique_ptr<Rendezvous> connect(const LaunchInfo& info, std::string_view run_tag,
                                                           std::chrono::milliseconds timeout);

  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  ~Rendezvous();  // closes the sockets; never throws

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Each rank gives its bytes (up to kMaxBlobBytes); each gets every rank's
  // bytes in rank order. `what` names the exchange in errors.
  std::vector<std::string> all_gather(std::string_view local, std::string_view what);
  // Rank 0's bytes to every rank; the others' `from_rank0` is ignored.
  std::string broadcast(std::string_view from_rank0, std::string_view what);
  // Returns once every rank has called it.
  void barrier(std::string_view what);

  // The per-exchange timeout from now on: rank 0 waits this long for the
  // others, they wait twice as long for rank 0 (Note [Peers wait twice as long]).
  void set_timeout(std::chrono::milliseconds timeout);

 private:
  enum class Exchange : std::uint8_t { kAllGather = 1, kBroadcast = 2, kBarrier = 3 };

  Rendezvous(int rank, int world_size, std::chrono::milliseconds timeout, std::vector<int> sockets,
             std::vector<FrameMac> macs);

  // Checks a call's arguments and that no earlier exchange failed.
  void check_usable(std::string_view local, std::string_view what) const;
  // The one collective under all three (world size > 1): returns the answer's
  // payload, the same bytes on every rank. See Note [Rendezvous protocol].
  std::string exchange(Exchange kind, std::string_view local, std::string_view what);
  std::string exchange_as_root(Exchange kind, std::string_view local, std::string_view what);
  std::string exchange_as_peer(Exchange kind, std::string_view local, std::string_view what);
  // Records the failure (later calls raise kInvalidState) and raises it.
  [[noreturn]] void fail(ErrorCode code, std::string message);

  int rank_ = 0;
  int world_size_ = 1;
  std::chrono::milliseconds timeout_;
  // Rank 0: the connection to each rank, by rank ([0] unused). Others: [0] is the connection to rank 0.
  std::vector<int> sockets_;
  std::vector<FrameMac> macs_;  // the MAC of each connection in sockets_ (Note [Rendezvous authentication])
  std::uint64_t sequence_ = 0;  // exchanges made so far
  std::string failure_;         // set once an exchange failed
  // Rank 0: a rank that could not take the answer of the last exchange; raised by the next one.
  std::vector<std::string> late_faults_;
};

}  // namespace stepgraph
