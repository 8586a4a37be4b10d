// What the C API's opaque handles hold, and the edge every call goes through.
// Internal to capi: no C++ type leaves through stepgraph.h.
//
// Every handle a C caller holds is a checked value of the handle table
// (capi/handle_table.h), which owns these structs through shared_ptrs.
//
// Note [Handles hold references]
// A C caller may destroy handles in any order, so each handle holds shared
// references to what it needs: a layer its context, an optimizer its layers, a
// train step its model and optimizer, a graph its context (CapturedStep needs
// its Context alive), a data-parallel train step its world (its TrainStep
// uses the communicator). Destroying a handle only drops its references.
#pragma once

#include <any>
#include <cstddef>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "capi/handle_table.h"
#include "capi/stepgraph.h"
#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/error.h"
#include "engine/fp8_recipe.h"
#include "launch/launch_env.h"
#include "graphs/captured_step.h"
#include "graphs/graph_cache.h"
#include "optim/adamw.h"
#include "layers/any_layer.h"
#include "train/graphed_layers.h"
#include "layers/language_model.h"
#include "layers/parameter.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"

namespace stepgraph::capi {

// A layer behind the C API: the four dense layers and the ResidualStack
// share one interface (layers/any_layer.h); `keeps` holds what it uses.
using LayerBase = AnyLayer;

struct OptimizerState {
  std::shared_ptr<Context> ctx;
  std::vector<std::shared_ptr<LayerBase>> layers;  // owners of the parameters AdamW updates
  std::unique_ptr<AdamW> adamw;
};

// A world (sg_world_init): where this process stands among the ranks, and the
// communicator over them (null for a world of one). Shared by the world handle
// and every train step made with it. See Note [Handles hold references].
struct WorldState {
  std::shared_ptr<WorldState> parent;  // a split group's world, kept while the group lives
  LaunchInfo launch;                   // a group's: rank and size within the group
  std::unique_ptr<Communicator> comm;
  int splits = 0;  // groups split from this world so far: their names, the same on every rank
};

struct TrainStepState {
  std::shared_ptr<Context> ctx;
  std::shared_ptr<LayerBase> model;
  std::shared_ptr<OptimizerState> optimizer;
  std::shared_ptr<WorldState> world;  // before `step`: the step uses its communicator until it goes
  std::unique_ptr<TrainStep> step;
};

// Runs `body`, turning any exception into a result code and the thread's last
// error. `function` names the C call in messages logged on unexpected errors.
sg_result run_guarded(const char* function, const std::function<void()>& body) noexcept;

// Throws Error(kInvalidArgument) "<function>: <what> is NULL" for a null pointer.
void require(const void* pointer, const char* function, const char* what);

// A C int used as a bool: 0 or 1 only, so that 2 or -1 (a wrong field, an
// uninitialised struct) is an Error naming `what` rather than true.
bool to_flag(int value, const char* function, const char* what);

// A norm's epsilon: finite and >= 0 (NaN or infinity would make every output
// NaN or 0).
float checked_eps(float eps, const char* function, const char* what);

// Copies `text` into (buffer, capacity) (truncated, NUL-terminated) and sets
// *length (if given) to its full length.
void copy_string(std::string_view text, char* buffer, std::size_t capacity, std::size_t* length);

// C enums to engine values, with a clear error for values outside the enum.
Device to_device(sg_device device);
sg_device to_c_device(Device device);
DType to_dtype(sg_dtype dtype);
sg_dtype from_dtype(DType dtype);
kernels::NormKind to_norm_kind(sg_norm_kind kind);
PoolReportPolicy to_policy(sg_pool_report_policy policy);

// A config's topk and moe_every keep their defaults without experts (they would be ignored).
void check_moe_fields(std::int64_t experts, std::int64_t topk, std::int64_t moe_every, const char* function);

// An FP8 recipe from C (null: none), every field checked; and back.
std::optional<Fp8Recipe> to_fp8_recipe(const sg_fp8_recipe* recipe, const char* function);
sg_fp8_recipe from_fp8_recipe(const Fp8Recipe& recipe);

// Capture by a C step function (shared by sg_capture and the graph cache).
std::shared_ptr<CapturedStep> capture_step_function(Context& ctx, sg_step_fn fn, void* user,
                                                    sg_pool_report_policy policy);

}  // namespace stepgraph::capi

struct sg_context_s {
  std::shared_ptr<stepgraph::Context> ctx;
};

struct sg_stream_scope_s {
  explicit sg_stream_scope_s(std::shared_ptr<stepgraph::Context> context) : ctx(std::move(context)) {}
  std::shared_ptr<stepgraph::Context> ctx;
  std::optional<stepgraph::StreamScope> scope;  // destroyed first: restores the previous stream
};

struct sg_tensor_s {
  std::shared_ptr<stepgraph::Context> ctx;  // copies to and from the host go through it
  stepgraph::Tensor tensor;
};

struct sg_layer_s {
  std::shared_ptr<stepgraph::Context> ctx;
  std::shared_ptr<stepgraph::capi::LayerBase> layer;
};

struct sg_saved_s {
  std::shared_ptr<stepgraph::capi::LayerBase> layer;  // whose forward made it
  std::any saved;
};

struct sg_optimizer_s {
  std::shared_ptr<stepgraph::capi::OptimizerState> state;
};

struct sg_train_step_s {
  std::shared_ptr<stepgraph::capi::TrainStepState> state;
};

struct sg_graph_s {
  // The captured step goes before what it replays (a data-parallel step's
  // graphs hold collectives of the communicator that keep_alive may own).
  ~sg_graph_s() { step.reset(); }
  std::shared_ptr<stepgraph::Context> ctx;
  std::shared_ptr<stepgraph::CapturedStep> step;
  std::shared_ptr<const void> keep_alive;  // a train step's state, for train-step graphs
  std::string last_profile;                // sg_graph_profile's text, for sg_graph_last_profile
};

struct sg_world_s {
  std::shared_ptr<stepgraph::capi::WorldState> state;
};

struct sg_graphed_layers_s {
  // The graphs go before the layers and the context they use.
  ~sg_graphed_layers_s() { graphed.reset(); }
  std::shared_ptr<stepgraph::Context> ctx;
  std::vector<std::shared_ptr<stepgraph::capi::LayerBase>> layers;
  std::unique_ptr<stepgraph::GraphedLayers> graphed;
};

struct sg_checkpoint_metadata_s {
  std::vector<std::pair<std::string, std::string>> entries;  // in key order
};

struct sg_graph_cache_s {
  explicit sg_graph_cache_s(std::int64_t max_pool_bytes) : cache(max_pool_bytes) {}
  stepgraph::GraphCache cache;
};

namespace stepgraph::capi {

// The ResidualStack behind a layer handle; an Error for other layers.
ResidualStack& residual_stack_of(const sg_layer_s& layer);
// The LanguageModel behind a layer handle; null for other layers.
LanguageModel* language_model_of(AnyLayer& layer);

// A new caller-owned tensor handle (nullptr for an undefined tensor).
inline sg_tensor new_tensor_handle(const std::shared_ptr<Context>& ctx, Tensor tensor) {
  if (!tensor.defined()) return nullptr;
  return issue_handle(std::make_shared<sg_tensor_s>(sg_tensor_s{ctx, std::move(tensor)}));
}

// The context behind a live context handle (argument `ctx`).
inline std::shared_ptr<Context> context_of(sg_context ctx, const char* function) {
  return handle_object(ctx, function, "ctx")->ctx;
}

// sg_*_destroy: removes the handle from the table and drops its references
// (NULL is allowed; a destroyed, foreign or wrong-type handle is an error).
template <typename T>
sg_result destroy_handle(T* handle, const char* function, const char* what) noexcept {
  return run_guarded(function, [&] { take_handle(handle, function, what); });
}

}  // namespace stepgraph::capi
