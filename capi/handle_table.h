// The C API's handle table: every sg_* handle is a checked 64-bit value, not an
// address, so a destroyed, foreign or wrong-type handle is an error, never a
// crash. Internal to capi.
//
// Note [Handle encoding]
// A handle is {tag, slot, generation} in 64 bits:
//   bits 63..56  tag: 0xA0 | kind (HandleKind below), so 0 or a small integer,
//                an address (top byte 0x00 or 0xff) or most random values are
//                not handles at all
//   bits 55..32  slot: the index into one process-wide table
//   bits 31..0   generation: the slot's count of objects so far (>= 1)
// The C typedefs stay pointer types (sg_tensor is struct sg_tensor_s*), so the
// ABI is unchanged; the value is never dereferenced, only decoded here.
// Destroying a handle empties its slot; the next object in that slot gets the
// next generation, so the old value reads as "destroyed" and never reaches the
// new object. A slot whose generation would wrap is retired, not reused.
//
// Note [Handle table thread safety]
// One mutex guards the table. A lookup copies the slot's shared_ptr under the
// lock and the call then works on that reference: a destroy on another thread
// only empties the slot, and the object dies when the last call using it
// returns. Objects die outside the lock (their destructors may be slow and
// may not call back into the table under it). The table itself is never
// destroyed (handles alive at exit stay as they are, as before the table).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "capi/stepgraph.h"

namespace stepgraph::capi {

enum class HandleKind : std::uint8_t {
  kContext = 1,
  kStreamScope = 2,
  kTensor = 3,
  kLayer = 4,
  kSaved = 5,
  kOptimizer = 6,
  kTrainStep = 7,
  kGraph = 8,
  kGraphCache = 9,
  kWorld = 10,
  kGraphedLayers = 11,
  kCheckpointMetadata = 12,
};

// "context", "tensor", "graph", ... (for messages).
std::string_view handle_kind_name(HandleKind kind);

// The table's untyped operations (handle_table.cc). `function` and `what` (the
// argument's name) start every message: "sg_graph_replay: graph handle
// 0x... (graph) was destroyed; ...", "sg_graph_replay: graph 0x... is a tensor
// handle, not a graph handle", "sg_tensor_rank: tensor 0x... is not a handle
// this library issued (...)".
std::uint64_t insert_handle(HandleKind kind, std::shared_ptr<void> object);
// The object behind `handle`, removed from the table when `remove`. Throws
// Error(kInvalidArgument) for NULL, a destroyed, foreign or wrong-kind handle.
std::shared_ptr<void> find_handle(std::uint64_t handle, HandleKind kind, const char* function, std::string_view what,
                                  bool remove);
// Live handles (for tests of the table itself and leak checks).
std::size_t live_handle_count();

// Which kind each C handle type is: sg_tensor is sg_tensor_s*, and so on.
template <typename T>
struct HandleKindOf;
#define SG_HANDLE_KIND(type, value)                       \
  template <>                                             \
  struct HandleKindOf<type> {                             \
    static constexpr HandleKind kind = HandleKind::value; \
  }
SG_HANDLE_KIND(sg_context_s, kContext);
SG_HANDLE_KIND(sg_stream_scope_s, kStreamScope);
SG_HANDLE_KIND(sg_tensor_s, kTensor);
SG_HANDLE_KIND(sg_layer_s, kLayer);
SG_HANDLE_KIND(sg_saved_s, kSaved);
SG_HANDLE_KIND(sg_optimizer_s, kOptimizer);
SG_HANDLE_KIND(sg_train_step_s, kTrainStep);
SG_HANDLE_KIND(sg_graph_s, kGraph);
SG_HANDLE_KIND(sg_graph_cache_s, kGraphCache);
SG_HANDLE_KIND(sg_world_s, kWorld);
SG_HANDLE_KIND(sg_graphed_layers_s, kGraphedLayers);
SG_HANDLE_KIND(sg_checkpoint_metadata_s, kCheckpointMetadata);
#undef SG_HANDLE_KIND

static_assert(sizeof(void*) == sizeof(std::uint64_t), "handles are 64-bit values in pointer-typed C handles");

// A new handle owning `object` (typed as the C handle: its value is the
// encoded handle, not the object's address).
template <typename T>
T* issue_handle(std::shared_ptr<T> object) {
  return reinterpret_cast<T*>(insert_handle(HandleKindOf<T>::kind, std::move(object)));
}

// The object behind a live handle of type T; an Error for NULL or a bad handle.
template <typename T>
std::shared_ptr<T> handle_object(T* handle, const char* function, std::string_view what) {
  return std::static_pointer_cast<T>(
      find_handle(reinterpret_cast<std::uintptr_t>(handle), HandleKindOf<T>::kind, function, what, false));
}

// Removes a live handle and gives its object back (the caller drops it: the
// destroy). NULL gives nullptr (destroying NULL is allowed, like free); a
// destroyed, foreign or wrong-type handle is an Error.
template <typename T>
std::shared_ptr<T> take_handle(T* handle, const char* function, std::string_view what) {
  if (handle == nullptr) return nullptr;
  return std::static_pointer_cast<T>(
      find_handle(reinterpret_cast<std::uintptr_t>(handle), HandleKindOf<T>::kind, function, what, true));
}

}  // namespace stepgraph::capi
