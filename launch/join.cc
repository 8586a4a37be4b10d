#include "launch/join.h"

#include <cstring>

#include "engine/device.h"
#include "engine/error.h"
#include "launch/rendezvous_communicator.h"
#include "engine/nccl_communicator.h"

namespace stepgraph {

std::unique_ptr<Communicator> join_nccl(const LaunchInfo& launch, Rendezvous& rendezvous,
                                        std::chrono::milliseconds timeout, std::string name) {
  const int gpus = cuda_device_count().count;
  SG_CHECK(launch.local_rank < gpus, "rank ", launch.rank, " is local rank ", launch.local_rank, " but this host has ",
           gpus, " GPU(s): start at most one rank per GPU (", launch.local_world_size, " were started here)");
  NcclUniqueId id;
  const std::string mine = launch.rank == 0 ? std::string(make_nccl_unique_id().bytes.data(), id.bytes.size()) : "";
  const std::string rank0 = rendezvous.broadcast(mine, "NCCL unique id");
  SG_CHECK_CODE(rank0.size() == id.bytes.size(), ErrorCode::kInternal, "the NCCL unique id from rank 0 has ",
                rank0.size(), " bytes, not ", id.bytes.size());
  std::memcpy(id.bytes.data(), rank0.data(), id.bytes.size());
  return make_nccl_communicator(id, launch.rank, launch.world_size,
                                {.name = std::move(name), .device = launch.local_rank, .timeout = timeout});
}

JoinedWorld join_world(Device device, std::string_view run_tag, std::chrono::milliseconds timeout,
                       const LaunchInfo& launch) {
  JoinedWorld world{launch, nullptr};
  if (launch.world_size == 1) return world;
  std::unique_ptr<Rendezvous> rendezvous = Rendezvous::connect(launch, run_tag, timeout);
  switch (device) {
    case Device::kHost: world.comm = make_rendezvous_communicator(std::move(rendezvous), "world"); break;
    case Device::kCuda: world.comm = join_nccl(launch, *rendezvous, timeout); break;
  }
  return world;
}

}  // namespace stepgraph
