// Tensor: shape, dtype and a reference to storage, shared by copies of the
// handle. Where the storage is depends on how the tensor was made:
//   persistent  fixed address for the context's life (Context::persistent):
//               parameters, gradients, optimizer state, step inputs;
//   eager       memory from the context's caching allocator, freed (stream-
//               ordered) when the last handle goes;
//   traced      a value of the Program being traced: no memory yet;
//   pool        a traced value that outlived its capture (an output, or a
//               tensor kept by the warn policy): an offset in the graph pool.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/dtype.h"
#include "engine/op.h"
#include "engine/shape.h"

namespace stepgraph {

enum class Device : std::uint8_t { kCuda, kHost };
std::string_view device_name(Device device);  // "cuda", "host"

enum class StorageKind : std::uint8_t { kPersistent, kEager, kTraced, kPool };
std::string_view storage_kind_name(StorageKind kind);

namespace detail {
struct ContextState;
struct TensorImpl;
}  // namespace detail

// Memory that graph pools hand out; released explicitly or with its last owner.
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;
  virtual void* base() const = 0;  // null once released
  virtual std::int64_t bytes() const = 0;
  virtual void release() = 0;
  bool released() const { return base() == nullptr; }
};

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
  // graph pool was released, or one freed by the pool report policy.
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

struct TensorImpl {
  TensorImpl(std::shared_ptr<ContextState> context, TensorMeta meta, std::string name, StorageKind storage);
  ~TensorImpl();  // eager storage goes back to the allocator (never throws)
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;

  std::shared_ptr<ContextState> context;
  TensorMeta meta;
  std::string name;
  StorageKind storage;
  void* address = nullptr;           // persistent and eager
  std::int64_t order_id = -1;        // identity for eager stream ordering
  std::int32_t value = -1;           // traced and pool: value id in the program
  std::uint64_t trace_id = 0;        // traced: the trace that made it
  std::shared_ptr<PoolMemory> pool;  // pool: the memory and our offset in it
  std::int64_t pool_offset = 0;
  bool freed_by_policy = false;  // pool report policy `free` dropped it
  bool external = false;         // persistent memory the caller owns (Context::wrap): never freed here
};

}  // namespace detail
}  // namespace stepgraph
