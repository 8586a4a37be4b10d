// NcclCommunicator: a Communicator over NCCL, one rank per process and GPU
// (NCCL's recommended model: one process driving several GPUs can deadlock
// under graph capture).
//
// Created non-blocking (ncclConfig_t::blocking = 0), so that it can always be
// aborted: every call returns at once and the communicator polls
// ncclCommGetAsyncError until NCCL has taken the call, for at most the
// timeout; a peer that never comes, or an asynchronous NCCL error, becomes an
// Error naming the call, and abort() ends it with ncclCommAbort.
// NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set in the
// environment before NCCL reads it, unless the caller set it, and nothing
// here calls cuMulticastCreate.
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <string>

#include "engine/communicator.h"

namespace stepgraph {

// NCCL's ncclUniqueId as plain bytes: rank 0 makes it, a rendezvous carries
// it to the others (launch/rendezvous.h).
struct NcclUniqueId {
  std::array<char, 128> bytes{};
};
NcclUniqueId make_nccl_unique_id();

struct NcclCommunicatorOptions {
  std::string name = "world";
  int device = 0;  // the CUDA device this rank drives
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Captured send_recv by copies into the peers' mapped pools where every
  // rank can map every other's GPU (Note [The pool as symmetric memory]);
  // false keeps NCCL. Groups made by split() inherit it.
  bool peer_copies = true;
};

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int world_size,
                                                     const NcclCommunicatorOptions& options = {});

// A new NCCL communicator of the same ranks as `group` (any communicator of
// CUDA ranks), made with `options` (its name, device and peer_copies):
// collective over `group`, whose rank 0 makes the NCCL id. Benchmarks and
// tests compare transports on one set of ranks with it.
std::unique_ptr<Communicator> make_nccl_communicator_like(Communicator& group, const NcclCommunicatorOptions& options);

// NCCL's version as "2.28.3" (the library loaded at run time).
std::string nccl_version();

}  // namespace stepgraph
