// Tensor: shape, dtype and a reference to storage, shared by copies of the
// handle.
//
// Note [Tensor storage]
// Where a tensor's storage is depends on how it was made, and changes only
// along these transitions (methods of TensorImpl, nothing else writes them):
//   persistent  fixed address for the context's life (Context::persistent,
//               Context::wrap): parameters, gradients, optimizer state, step
//               inputs. Never changes.
//   eager       memory from the context's allocator, freed (stream-ordered)
//               when the last handle goes. Never changes.
//   traced      a value of the Program being traced: no memory. When its
//               capture ends, a traced tensor that is still held becomes
//                 pool        (bind_to_pool) an offset in the step's pool:
//                             an output, or a value kept by the pool report
//                             policy warn; valid while the pool lives;
//                 unavailable (make_unavailable) its memory is reused (policy
//                             free): data() is an Error that gives the reason.
// A pool tensor's data() is an Error once its pool is released.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/device_kind.h"
#include "engine/dtype.h"
#include "engine/memory.h"
#include "engine/op.h"
#include "engine/shape.h"

namespace stepgraph {

enum class StorageKind : std::uint8_t { kPersistent, kEager, kTraced, kPool, kUnavailable };
std::string_view storage_kind_name(StorageKind kind);

namespace detail {
struct ContextState;
class TensorImpl;
}  // namespace detail

class Tensor {
 public:
  Tensor() = default;  // undefined: no shape, no storage

  bool defined() const { return impl_ != nullptr; }
  const TensorMeta& meta() const;
  const Shape& shape() const { return meta().shape; }
  DType dtype() const { return meta().dtype; }
  std::int64_t numel() const { return meta().numel(); }
  std::int64_t bytes() const { return meta().bytes(); }

  // Names show in Program dumps and pool reports.
  const std::string& name() const;
  const Tensor& set_name(std::string name) const;

  StorageKind storage() const;
  bool is_persistent() const { return storage() == StorageKind::kPersistent; }
  std::uint64_t context_id() const;

  // The data's address (device memory on cuda, host memory on host). An Error
  // that says why for a traced value (no memory while tracing), a tensor whose
  // graph pool was released, or one made unavailable by the pool report policy.
  void* data() const;
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data());
  }

  // For the engine: the shared storage record.
  const std::shared_ptr<detail::TensorImpl>& impl() const { return impl_; }
  explicit Tensor(std::shared_ptr<detail::TensorImpl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<detail::TensorImpl> impl_;
};

namespace detail {

// The storage record behind Tensor handles. See Note [Tensor storage].
class TensorImpl {
 public:
  // Persistent memory: allocated by the context (`owned`), or the caller's
  // (Context::wrap), which is never freed here.
  enum class Ownership : std::uint8_t { kOwned, kCallers };
  static std::shared_ptr<TensorImpl> persistent(std::shared_ptr<ContextState> context, TensorMeta meta,
                                                std::string name, void* address, Ownership ownership);
  static std::shared_ptr<TensorImpl> eager(std::shared_ptr<ContextState> context, TensorMeta meta, std::string name,
                                           void* address);
  static std::shared_ptr<TensorImpl> traced(std::shared_ptr<ContextState> context, TensorMeta meta, std::string name,
                                            std::int32_t value, std::uint64_t trace_id);

  ~TensorImpl();  // owned persistent and eager memory goes back to the context (never throws)
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;

  // traced -> pool: the value lives at `offset` in `pool`.
  void bind_to_pool(std::shared_ptr<PoolMemory> pool, std::int64_t offset);
  // traced -> unavailable: its memory is reused; data() throws `reason`.
  void make_unavailable(std::string reason);

  StorageKind storage() const { return storage_; }
  const TensorMeta& meta() const { return meta_; }
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  const std::shared_ptr<ContextState>& context() const { return context_; }
  std::int64_t order_id() const { return order_id_; }  // identity for eager stream ordering
  std::int32_t value() const { return value_; }        // traced: value id in its program
  std::uint64_t trace_id() const { return trace_id_; }  // traced: the trace that made it
  bool callers_memory() const { return ownership_ == Ownership::kCallers; }
  // The address now (see Tensor::data for the Errors); null for 0 bytes.
  void* data() const;
  // persistent and eager: the address, or null once given back (no checks).
  void* raw_address() const { return address_; }

 private:
  TensorImpl(std::shared_ptr<ContextState> context, TensorMeta meta, std::string name, StorageKind storage);

  std::shared_ptr<ContextState> context_;
  TensorMeta meta_;
  std::string name_;
  StorageKind storage_;
  Ownership ownership_ = Ownership::kOwned;
  void* address_ = nullptr;  // persistent and eager
  std::int64_t order_id_ = -1;
  std::int32_t value_ = -1;
  std::uint64_t trace_id_ = 0;
  std::shared_ptr<PoolMemory> pool_;  // pool: the memory and our offset in it
  std::int64_t pool_offset_ = 0;
  std::string unavailable_reason_;
};

}  // namespace detail
}  // namespace stepgraph
