// The C API's worlds: this process's place among the ranks of a run, joined
// from the launcher's environment the way the trainer joins it
// (trainer/distributed.cc join_world; capi does not depend on the trainer).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "capi/handles.h"
#include "engine/device.h"
#include "engine/launch/launch_env.h"
#include "engine/launch/rendezvous.h"
#include "engine/launch/rendezvous_communicator.h"
#include "engine/nccl_communicator.h"

using namespace stepgraph;  // NOLINT(google-build-using-namespace): the C entry points below
using capi::require;
using capi::run_guarded;

namespace {

constexpr double kMaxTimeoutSeconds = 7 * 24 * 3600.0;  // a week: far from steady_clock's range

std::chrono::milliseconds to_timeout(double seconds, const char* function) {
  SG_CHECK(std::isfinite(seconds) && seconds >= 0.001 && seconds <= kMaxTimeoutSeconds, function,
           ": timeout_seconds must be in [0.001, ", kMaxTimeoutSeconds, "] (a week), got ", seconds);
  return std::chrono::milliseconds(std::llround(seconds * 1000.0));
}

// The NCCL communicator of a world of several ranks: rank 0's unique id
// reaches the others over the rendezvous. Makes GPU local_rank current.
std::unique_ptr<Communicator> join_nccl(const LaunchInfo& launch, Rendezvous& rendezvous,
                                        std::chrono::milliseconds timeout) {
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
                                {.name = "world", .device = launch.local_rank, .timeout = timeout});
}

// Joins the world the launcher's variables describe. A world of one needs no
// communicator and opens no socket.
std::shared_ptr<capi::WorldState> join_world(sg_device device, std::chrono::milliseconds timeout) {
  auto world = std::make_shared<capi::WorldState>();
  world->launch = launch_info_from_env();
  const Device kind = capi::to_device(device);  // checks the enum before any socket opens
  if (world->launch.world_size == 1) return world;
  // Ranks that disagree on the device meet with an error naming both tags.
  const std::string tag = std::string("stepgraph C API world on ") + std::string(device_name(kind));
  std::unique_ptr<Rendezvous> rendezvous = Rendezvous::connect(world->launch, tag, timeout);
  switch (device) {
    case SG_DEVICE_HOST: world->comm = make_rendezvous_communicator(std::move(rendezvous), "world"); break;
    case SG_DEVICE_CUDA: world->comm = join_nccl(world->launch, *rendezvous, timeout); break;
  }
  return world;
}

std::shared_ptr<capi::WorldState> world_of(sg_world world, const char* function) {
  return capi::handle_object(world, function, "world")->state;
}

}  // namespace

extern "C" sg_result sg_world_init(sg_device device, double timeout_seconds, sg_world* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    const std::chrono::milliseconds timeout = to_timeout(timeout_seconds, function);
    std::shared_ptr<capi::WorldState> state;
    try {
      state = join_world(device, timeout);
    } catch (const Error& error) {
      // The launcher's variables, the rendezvous and NCCL know nothing of this call: name it.
      throw Error(error.code(), std::string(function) + ": " + error.message(), error.place());
    }
    *out = capi::issue_handle(std::make_shared<sg_world_s>(sg_world_s{std::move(state)}));
  });
}

extern "C" sg_result sg_world_destroy(sg_world world) { return capi::destroy_handle(world, __func__, "world"); }

extern "C" sg_result sg_world_rank(sg_world world, int* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::WorldState> state = world_of(world, function);
    require(out, function, "out");
    *out = state->launch.rank;
  });
}

extern "C" sg_result sg_world_size(sg_world world, int* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::WorldState> state = world_of(world, function);
    require(out, function, "out");
    *out = state->launch.world_size;
  });
}

extern "C" sg_result sg_world_local_rank(sg_world world, int* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::WorldState> state = world_of(world, function);
    require(out, function, "out");
    *out = state->launch.local_rank;
  });
}

extern "C" sg_result sg_world_describe(sg_world world, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::WorldState> state = world_of(world, function);
    std::string text = describe(state->launch);
    if (state->comm != nullptr) text += "; " + state->comm->describe();
    capi::copy_string(text, buffer, capacity, length);
  });
}
