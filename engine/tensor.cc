#include "engine/tensor.h"

#include "engine/context_state.h"
#include "engine/error.h"

namespace stepgraph {
namespace detail {

TensorImpl::TensorImpl(std::shared_ptr<ContextState> context, TensorMeta meta, std::string name, StorageKind storage)
    : context_(std::move(context)), meta_(std::move(meta)), name_(std::move(name)), storage_(storage) {
  order_id_ = context_->next_order_id++;
}

std::shared_ptr<TensorImpl> TensorImpl::persistent(std::shared_ptr<ContextState> context, TensorMeta meta,
                                                   std::string name, void* address, Ownership ownership) {
  std::shared_ptr<TensorImpl> impl(
      new TensorImpl(std::move(context), std::move(meta), std::move(name), StorageKind::kPersistent));
  impl->address_ = address;
  impl->ownership_ = ownership;
  return impl;
}

std::shared_ptr<TensorImpl> TensorImpl::eager(std::shared_ptr<ContextState> context, TensorMeta meta, std::string name,
                                              void* address) {
  std::shared_ptr<TensorImpl> impl(
      new TensorImpl(std::move(context), std::move(meta), std::move(name), StorageKind::kEager));
  impl->address_ = address;
  return impl;
}

std::shared_ptr<TensorImpl> TensorImpl::traced(std::shared_ptr<ContextState> context, TensorMeta meta,
                                               std::string name, std::int32_t value, std::uint64_t trace_id) {
  std::shared_ptr<TensorImpl> impl(
      new TensorImpl(std::move(context), std::move(meta), std::move(name), StorageKind::kTraced));
  impl->value_ = value;
  impl->trace_id_ = trace_id;
  return impl;
}

TensorImpl::~TensorImpl() {
  if (storage_ == StorageKind::kPersistent || storage_ == StorageKind::kEager) context_->release(*this);
}

void TensorImpl::bind_to_pool(std::shared_ptr<PoolMemory> pool, std::int64_t offset) {
  SG_CHECK_CODE(storage_ == StorageKind::kTraced, ErrorCode::kInternal, "tensor '", name_, "' is ",
                storage_kind_name(storage_), ", not traced; only a traced value moves into a graph pool");
  storage_ = StorageKind::kPool;
  pool_ = std::move(pool);
  pool_offset_ = offset;
}

void TensorImpl::make_unavailable(std::string reason) {
  SG_CHECK_CODE(storage_ == StorageKind::kTraced, ErrorCode::kInternal, "tensor '", name_, "' is ",
                storage_kind_name(storage_), ", not traced; only a traced value's memory can be reused");
  storage_ = StorageKind::kUnavailable;
  unavailable_reason_ = std::move(reason);
}

void* TensorImpl::data() const {
  switch (storage_) {
    case StorageKind::kPersistent:
    case StorageKind::kEager: return address_;
    case StorageKind::kTraced:
      SG_THROW(ErrorCode::kInvalidState, "tensor '", name_,
               "' is a traced value: it has no memory while tracing, and none after its capture unless it is "
               "an output of the step");
    case StorageKind::kPool:
      SG_CHECK_CODE(pool_ != nullptr && !pool_->released(), ErrorCode::kInvalidState, "tensor '", name_,
                    "' lives in a graph pool that was released; it can no longer be read");
      return static_cast<std::byte*>(pool_->base()) + pool_offset_;
    case StorageKind::kUnavailable: SG_THROW(ErrorCode::kInvalidState, "tensor '", name_, "' ", unavailable_reason_);
  }
  SG_THROW(ErrorCode::kInternal, "unknown storage kind");
}

}  // namespace detail

std::string_view storage_kind_name(StorageKind kind) {
  switch (kind) {
    case StorageKind::kPersistent: return "persistent";
    case StorageKind::kEager: return "eager";
    case StorageKind::kTraced: return "traced";
    case StorageKind::kPool: return "pool";
    case StorageKind::kUnavailable: return "unavailable";
  }
  return "unknown";
}

const TensorMeta& Tensor::meta() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->meta();
}

const std::string& Tensor::name() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->name();
}

const Tensor& Tensor::set_name(std::string name) const {
  SG_CHECK(defined(), "use of an undefined tensor");
  impl_->set_name(std::move(name));
  return *this;
}

StorageKind Tensor::storage() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->storage();
}

std::uint64_t Tensor::context_id() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->context()->id;
}

void* Tensor::data() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->data();
}

}  // namespace stepgraph
