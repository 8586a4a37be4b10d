// Joining the world a launcher describes: the one place where a process
// finds its rank (launch_env.h), meets the other ranks (rendezvous.h) and
// builds its communicator — NCCL on cuda (rank 0's unique id reaches the
// others over the rendezvous; the rank drives GPU local_rank), the
// rendezvous's host collectives on host. Used by the trainer, the C API and
// the benchmarks.
//
//   JoinedWorld world = join_world(Device::kCuda, "my-program", std::chrono::minutes(5));
//   Context ctx(Device::kCuda, 2);   // after the join: GPU local_rank is current
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "engine/communicator.h"
#include "engine/device_kind.h"
#include "launch/launch_env.h"
#include "launch/rendezvous.h"

namespace stepgraph {

struct JoinedWorld {
  LaunchInfo launch;
  std::unique_ptr<Communicator> comm;  // null for a world of one (no socket is opened)
};

// `run_tag`: what every rank must agree on (a program, a device); ranks with
// another tag meet with an Error naming both. Every wait is bounded by
// `timeout`.
JoinedWorld join_world(Device device, std::string_view run_tag, std::chrono::milliseconds timeout,
                       const LaunchInfo& launch = launch_info_from_env());

// The NCCL communicator of ranks that met at `rendezvous`; makes GPU
// launch.local_rank current (before the caller's Context picks it). An Error
// when this host has fewer GPUs than local ranks.
std::unique_ptr<Communicator> join_nccl(const LaunchInfo& launch, Rendezvous& rendezvous,
                                        std::chrono::milliseconds timeout, std::string name = "world");

}  // namespace stepgraph
