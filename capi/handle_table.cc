// The process-wide handle table: see Note [Handle encoding] and Note [Handle
// table thread safety] in handle_table.h.
#include "capi/handle_table.h"

#include <array>
#include <cstdio>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/error.h"

namespace stepgraph::capi {
namespace {

constexpr std::uint64_t kTagMagic = 0xA0;
constexpr int kTagShift = 56;
constexpr int kSlotShift = 32;
constexpr std::uint64_t kSlotMask = 0xFFFFFF;  // 24 bits
constexpr std::uint32_t kMaxGeneration = std::numeric_limits<std::uint32_t>::max();
constexpr std::uint8_t kFirstKind = static_cast<std::uint8_t>(HandleKind::kContext);
constexpr std::uint8_t kLastKind = static_cast<std::uint8_t>(HandleKind::kCheckpointMetadata);

struct Decoded {
  std::uint8_t kind = 0;  // 0: the tag is not ours
  std::uint32_t slot = 0;
  std::uint32_t generation = 0;
};

Decoded decode(std::uint64_t handle) {
  const auto tag = static_cast<std::uint8_t>(handle >> kTagShift);
  Decoded out;
  const std::uint8_t kind = tag & 0x0F;
  if ((tag & 0xF0) == kTagMagic && kind >= kFirstKind && kind <= kLastKind) out.kind = kind;
  out.slot = static_cast<std::uint32_t>((handle >> kSlotShift) & kSlotMask);
  out.generation = static_cast<std::uint32_t>(handle);
  return out;
}

std::uint64_t encode(HandleKind kind, std::uint32_t slot, std::uint32_t generation) {
  return ((kTagMagic | static_cast<std::uint64_t>(kind)) << kTagShift) |
         (static_cast<std::uint64_t>(slot) << kSlotShift) | generation;
}

std::string hex(std::uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

struct Slot {
  std::uint32_t generation = 0;  // of the current (or last) object; 0: never used
  HandleKind kind = HandleKind::kContext;
  std::shared_ptr<void> object;  // empty: free (or retired)
};

class HandleTable {
 public:
  std::uint64_t insert(HandleKind kind, std::shared_ptr<void> object) {
    SG_CHECK_CODE(object != nullptr, ErrorCode::kInternal, "a handle for no object");
    const std::lock_guard<std::mutex> lock(mutex_);
    std::uint32_t index = 0;
    if (!free_.empty()) {
      index = free_.back();
      free_.pop_back();
    } else {
      SG_CHECK_CODE(slots_.size() <= kSlotMask, ErrorCode::kOutOfMemory, "the C API has ", slots_.size(),
                    " live handles, its limit; destroy the handles you no longer use");
      index = static_cast<std::uint32_t>(slots_.size());
      slots_.emplace_back();
    }
    Slot& slot = slots_[index];
    ++slot.generation;
    slot.kind = kind;
    slot.object = std::move(object);
    ++live_;
    return encode(kind, index, slot.generation);
  }

  std::shared_ptr<void> find(std::uint64_t handle, HandleKind kind, const char* function, std::string_view what,
                             bool remove) {
    const std::string_view wanted = handle_kind_name(kind);
    SG_CHECK(handle != 0, function, ": ", what, " is NULL");
    const Decoded d = decode(handle);
    std::shared_ptr<void> taken;  // dies after the lock is released
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const bool issued =
          d.kind != 0 && d.slot < slots_.size() && d.generation != 0 && d.generation <= slots_[d.slot].generation &&
          (d.generation < slots_[d.slot].generation || static_cast<std::uint8_t>(slots_[d.slot].kind) == d.kind);
      SG_CHECK(issued, function, ": ", what, " ", hex(handle), " is not a handle this library issued (not a ", wanted,
               " handle, nor any other sg_* handle)");
      const auto its_kind = static_cast<HandleKind>(d.kind);
      Slot& slot = slots_[d.slot];
      const bool alive = d.generation == slot.generation && slot.object != nullptr;
      SG_CHECK(its_kind == kind, function, ": ", what, " ", hex(handle), " is a ", handle_kind_name(its_kind),
               " handle", alive ? "" : " (destroyed)", ", not a ", wanted, " handle");
      SG_CHECK(alive, function, ": ", wanted, " handle ", hex(handle), " (", what, ")",
               remove ? " was already destroyed (a second destroy)"
                      : " was destroyed; a handle is unusable after its destroy");
      if (!remove) return slot.object;
      taken = std::move(slot.object);
      slot.object.reset();
      --live_;
      if (slot.generation != kMaxGeneration) free_.push_back(d.slot);  // else retired: no wrapped generations
    }
    return taken;
  }

  std::size_t live() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return live_;
  }

 private:
  std::mutex mutex_;
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_;
  std::size_t live_ = 0;
};

HandleTable& table() {
  static auto* const instance = new HandleTable;  // never destroyed: see Note [Handle table thread safety]
  return *instance;
}

}  // namespace

std::string_view handle_kind_name(HandleKind kind) {
  static constexpr std::array<std::string_view, kLastKind + 1> kNames = {
      "?",         "context",    "stream scope", "tensor",      "layer", "saved",
      "optimizer", "train step", "graph",        "graph cache", "world",
      "graphed layers", "checkpoint metadata"};
  const auto index = static_cast<std::size_t>(kind);
  return index < kNames.size() ? kNames[index] : "?";
}

std::uint64_t insert_handle(HandleKind kind, std::shared_ptr<void> object) {
  return table().insert(kind, std::move(object));
}

std::shared_ptr<void> find_handle(std::uint64_t handle, HandleKind kind, const char* function, std::string_view what,
                                  bool remove) {
  return table().find(handle, kind, function, what, remove);
}

std::size_t live_handle_count() { return table().live(); }

}  // namespace stepgraph::capi
