// How the ranks of a rendezvous join: rank 0 listens and admits every other
// rank after a two-way challenge (Note [Rendezvous authentication]); each
// other rank connects, proves itself, checks rank 0's proof and waits for
// rank 0's verdict. Internal to launch/: Rendezvous::connect calls
// these, then exchanges frames over the connections they return.
//
// Where rank 0 listens (Note [Where rank 0 listens] in the .cc): MASTER_ADDR's
// address, never every interface; without a secret, loopback only.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "launch/launch_env.h"
#include "launch/rendezvous_auth.h"
#include "launch/rendezvous_wire.h"

namespace stepgraph::handshake {

inline constexpr std::size_t kMaxTagBytes = 4096;
// Connections rank 0 holds that have not passed the handshake yet; past it,
// the oldest is dropped (Note [Joining under load] in the .cc).
inline constexpr std::size_t kMaxUnauthenticated = 128;
// How long one connection may take over its handshake before rank 0 drops it.
inline constexpr std::chrono::milliseconds kHandshakeLimit{5000};

// One authenticated connection.
struct Connection {
  wire::Fd fd;
  FrameMac mac;
};

// Rank 0: admits every other rank, checks that they agree (world size, run
// tag, one process per rank) and sends each the verdict. Returns the
// connection to each rank by rank ([0] empty); `late_faults` gets, by rank,
// why a rank did not take its OK verdict. An Error on failure, sent to every
// rank that was admitted.
std::vector<Connection> accept_ranks(const LaunchInfo& info, std::string_view run_tag,
                                     std::chrono::milliseconds timeout, std::vector<std::string>* late_faults);

// Every other rank: connects to rank 0 (retrying until `timeout`), proves
// itself and checks rank 0's proof, and waits (2 x `timeout`) for the verdict.
Connection join_rank0(const LaunchInfo& info, std::string_view run_tag, std::chrono::milliseconds timeout);

}  // namespace stepgraph::handshake
