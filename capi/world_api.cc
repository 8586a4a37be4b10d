// The C API's worlds: this process's place among the ranks of a run, joined
// from the launcher's environment as the trainer joins it (launch/join.h).
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "capi/handles.h"
#include "engine/device.h"
#include "launch/join.h"

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

// Joins the world the launcher's variables describe (launch/join.h).
// A world of one needs no communicator and opens no socket.
std::shared_ptr<capi::WorldState> join_world(sg_device device, std::chrono::milliseconds timeout) {
  const Device kind = capi::to_device(device);  // checks the enum before any socket opens
  // Ranks that disagree on the device meet with an error naming both tags.
  const std::string tag = std::string("stepgraph C API world on ") + std::string(device_name(kind));
  JoinedWorld joined = stepgraph::join_world(kind, tag, timeout);
  auto world = std::make_shared<capi::WorldState>();
  world->launch = joined.launch;
  world->comm = std::move(joined.comm);
  return world;
}

std::shared_ptr<capi::WorldState> world_of(sg_world world, const char* function) {
  return capi::handle_object(world, function, "world")->state;
}

// The body of a world call that writes one value: the handle checked, then
// `out` required, then `*out = read(state)`; an error names `function`.
template <typename T, typename Read>
sg_result read_world(const char* function, sg_world world, T* out, const Read& read) {
  return run_guarded(function, [&] {
    const std::shared_ptr<capi::WorldState> state = world_of(world, function);
    require(out, function, "out");
    *out = read(*state);
  });
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

extern "C" sg_result sg_world_split(sg_world world, int color, int key, sg_world* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::WorldState> parent = world_of(world, function);
    require(out, function, "out");
    *out = nullptr;
    SG_CHECK(color >= 0, function, ": color must be >= 0 (the ranks passing the same color form a group), got ",
             color);
    auto group = std::make_shared<capi::WorldState>();
    group->parent = parent;
    group->launch = parent->launch;
    if (parent->comm != nullptr) {
      // The name is part of the ranks' exchange: the same on every rank (not the color).
      group->comm = parent->comm->split(color, key, fmt::format("{}.group{}", parent->comm->name(), parent->splits++));
      group->launch.rank = group->comm->rank();
      group->launch.world_size = group->comm->world_size();
      if (group->comm->world_size() == 1) group->comm.reset();  // a group of one is this process alone
    }
    *out = capi::issue_handle(std::make_shared<sg_world_s>(sg_world_s{std::move(group)}));
  });
}

extern "C" sg_result sg_world_destroy(sg_world world) { return capi::destroy_handle(world, __func__, "world"); }

extern "C" sg_result sg_world_rank(sg_world world, int* out) {
  return read_world(__func__, world, out, [](const capi::WorldState& state) { return state.launch.rank; });
}

extern "C" sg_result sg_world_size(sg_world world, int* out) {
  return read_world(__func__, world, out, [](const capi::WorldState& state) { return state.launch.world_size; });
}

extern "C" sg_result sg_world_local_rank(sg_world world, int* out) {
  return read_world(__func__, world, out, [](const capi::WorldState& state) { return state.launch.local_rank; });
}

extern "C" sg_result sg_world_describe(sg_world world, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<capi::WorldState> state = world_of(world, function);
    std::string text = describe(state->launch);
    if (state->comm != nullptr) text += "; " + state->comm->describe();
    capi::copy_string(text, buffer, capacity, length);
  });
}
