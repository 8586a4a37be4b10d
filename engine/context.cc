#include "engine/context.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/logging.h"
#include "engine/stream.h"
#include "engine/stream_order.h"

namespace stepgraph {
namespace detail {

// Everything tensors need after the Context object itself is gone: tensors
// hold it, so memory is returned to an allocator that still exists.
struct ContextState {
  ContextState(Device device, int side_streams);
  ~ContextState();

  cudaStream_t stream(int index) const { return streams.at(index).get(); }
  // Performs waits from StreamOrder: record on the signal stream now (covering
  // at least the token asked for) and make the waiter wait on it.
  void perform(const std::vector<StreamWait>& waits);
  void* allocate(std::int64_t bytes, StorageKind kind, int stream_index);
  void release(TensorImpl& impl) noexcept;
  void check_owned(const Tensor& tensor, std::string_view op) const;

  Device device;
  std::uint64_t id;
  int stream_count;
  int current_stream = 0;
  std::vector<Stream> streams;  // cuda only
  std::vector<Event> signals;   // one per stream, re-recorded for each wait
  cudaMemPool_t memory_pool = nullptr;
  StreamOrder order;
  std::int64_t next_order_id = 0;
  OpRecorder* recorder = nullptr;
  MemoryStats stats;
};

namespace {
std::atomic<std::uint64_t> next_context_id{1};
constexpr std::size_t kHostAlignment = 256;
}  // namespace

ContextState::ContextState(Device device_in, int side_streams)
    : device(device_in), id(next_context_id++), stream_count(1 + side_streams), order(1 + side_streams) {
  SG_CHECK(side_streams >= 0 && side_streams <= 8, "Context: side_streams must be in [0, 8], got ", side_streams);
  if (device != Device::kCuda) return;
  int cuda_device = 0;
  SG_CUDA_CHECK(cudaGetDevice(&cuda_device));
  for (int i = 0; i < stream_count; ++i) {
    streams.emplace_back(i == 0 ? Stream::Priority::kDefault : Stream::Priority::kHigh);
    signals.emplace_back();
  }
  // A stream-ordered caching allocator: a pool that keeps freed memory
  // (release threshold: never) so steady-state eager steps do not call the
  // driver for memory.
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = cuda_device;
  SG_CUDA_CHECK(cudaMemPoolCreate(&memory_pool, &props));
  std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
  SG_CUDA_CHECK(cudaMemPoolSetAttribute(memory_pool, cudaMemPoolAttrReleaseThreshold, &threshold));
}

ContextState::~ContextState() {
  if (memory_pool == nullptr) return;
  for (const Stream& s : streams) {
    if (cudaStreamSynchronize(s.get()) != cudaSuccess) logger().error("stream synchronize failed at context exit");
  }
  if (cudaMemPoolDestroy(memory_pool) != cudaSuccess) logger().error("cudaMemPoolDestroy failed at context exit");
}

void ContextState::perform(const std::vector<StreamWait>& waits) {
  for (const StreamWait& wait : waits) {
    signals[wait.signal].record(stream(wait.signal));
    signals[wait.signal].wait_on(stream(wait.waiter));
  }
}

void* ContextState::allocate(std::int64_t bytes, StorageKind kind, int stream_index) {
  if (bytes == 0) return nullptr;
  void* address = nullptr;
  if (device == Device::kHost) {
    const auto rounded = static_cast<std::size_t>((bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
    address = std::aligned_alloc(kHostAlignment, rounded);
    SG_CHECK_CODE(address != nullptr, ErrorCode::kOutOfMemory, "host allocation of ", bytes, " bytes failed");
    if (kind == StorageKind::kPersistent) std::memset(address, 0, rounded);  // eager outputs are written by their op
  } else if (kind == StorageKind::kPersistent) {
    // Zero-filled on stream 0 (the caller records that write in StreamOrder):
    // a plain cudaMemset runs on the legacy stream, which our non-blocking
    // streams do not wait for.
    SG_CUDA_CHECK(cudaMalloc(&address, static_cast<std::size_t>(bytes)));
    SG_CUDA_CHECK(cudaMemsetAsync(address, 0, static_cast<std::size_t>(bytes), stream(0)));
  } else {
    SG_CUDA_CHECK(
        cudaMallocFromPoolAsync(&address, static_cast<std::size_t>(bytes), memory_pool, stream(stream_index)));
  }
  if (kind == StorageKind::kPersistent) {
    stats.persistent_bytes += bytes;
  } else {
    stats.eager_bytes += bytes;
    stats.eager_peak_bytes = std::max(stats.eager_peak_bytes, stats.eager_bytes);
  }
  return address;
}

void ContextState::release(TensorImpl& impl) noexcept {
  if (impl.address == nullptr) return;
  if (impl.external) {  // the caller's memory (Context::wrap): only forget it
    order.forget(impl.order_id);
    impl.address = nullptr;
    return;
  }
  const std::int64_t bytes = impl.meta.bytes();
  try {
    if (device == Device::kHost) {
      std::free(impl.address);
    } else if (impl.storage == StorageKind::kPersistent) {
      SG_CUDA_CHECK(cudaFree(impl.address));  // synchronous: every use has finished
    } else {
      // Freeing is a write on the main stream: it waits for every access on
      // other streams, so no later allocation can reuse memory still in use.
      const std::int64_t id = impl.order_id;
      perform(order.prepare(0, {}, std::span(&id, 1)));
      SG_CUDA_CHECK(cudaFreeAsync(impl.address, stream(0)));
    }
  } catch (const std::exception& error) {
    logger().error("freeing tensor '{}' failed: {}", impl.name, error.what());
  }
  order.forget(impl.order_id);
  (impl.storage == StorageKind::kPersistent ? stats.persistent_bytes : stats.eager_bytes) -= bytes;
  impl.address = nullptr;
}

void ContextState::check_owned(const Tensor& tensor, std::string_view op) const {
  SG_CHECK(tensor.defined(), "op ", op, ": an input tensor is undefined (default-constructed)");
  SG_CHECK(tensor.context_id() == id, "op ", op, ": tensor '", tensor.name(), "' belongs to context ",
           tensor.context_id(), ", not to this context (", id, "); create it with this context or copy it over");
}

TensorImpl::TensorImpl(std::shared_ptr<ContextState> context_in, TensorMeta meta_in, std::string name_in,
                       StorageKind storage_in)
    : context(std::move(context_in)), meta(std::move(meta_in)), name(std::move(name_in)), storage(storage_in) {
  order_id = context->next_order_id++;
}

TensorImpl::~TensorImpl() {
  if (storage == StorageKind::kPersistent || storage == StorageKind::kEager) context->release(*this);
}

}  // namespace detail

using detail::ContextState;
using detail::TensorImpl;

std::string_view device_name(Device device) { return device == Device::kCuda ? "cuda" : "host"; }

std::string_view storage_kind_name(StorageKind kind) {
  switch (kind) {
    case StorageKind::kPersistent: return "persistent";
    case StorageKind::kEager: return "eager";
    case StorageKind::kTraced: return "traced";
    case StorageKind::kPool: return "pool";
  }
  return "unknown";
}

Context::Context(Device device, int side_streams) : state_(std::make_shared<ContextState>(device, side_streams)) {}

Context::~Context() {
  if (state_->recorder != nullptr) logger().error("a Context was destroyed while a step was being traced on it");
}

Device Context::device() const { return state_->device; }
std::uint64_t Context::id() const { return state_->id; }
int Context::stream_count() const { return state_->stream_count; }
int Context::current_stream() const { return state_->current_stream; }
bool Context::tracing() const { return state_->recorder != nullptr; }
MemoryStats Context::memory_stats() const { return state_->stats; }
OpRecorder* Context::recorder() const { return state_->recorder; }

void Context::set_recorder(OpRecorder* recorder) {
  SG_CHECK_CODE(recorder == nullptr || state_->recorder == nullptr, ErrorCode::kInvalidState,
                "a step is already being traced on this context; traces cannot nest");
  state_->recorder = recorder;
}

CUstream_st* Context::cuda_stream(int index) const {
  SG_CHECK_CODE(state_->device == Device::kCuda, ErrorCode::kInvalidState, "a host context has no CUDA streams");
  SG_CHECK(index >= 0 && index < state_->stream_count, "stream index ", index, " out of range [0, ",
           state_->stream_count, ")");
  return state_->stream(index);
}

Tensor Context::persistent(std::string name, const TensorMeta& meta) {
  SG_CHECK(!name.empty(), "a persistent tensor needs a name (it appears in dumps, reports and errors)");
  auto impl = std::make_shared<TensorImpl>(state_, meta, std::move(name), StorageKind::kPersistent);
  impl->address = state_->allocate(meta.bytes(), StorageKind::kPersistent, 0);
  if (device() == Device::kCuda && impl->address != nullptr) {
    const std::int64_t id = impl->order_id;
    state_->order.issue(0, {}, std::span(&id, 1));  // the zero fill
  }
  return Tensor(std::move(impl));
}

Tensor Context::wrap(std::string name, const TensorMeta& meta, void* address) {
  SG_CHECK(!name.empty(), "a wrapped tensor needs a name (it appears in dumps, reports and errors)");
  SG_CHECK(address != nullptr || meta.bytes() == 0, "wrap '", name, "': the address is null for ", meta.bytes(),
           " bytes");
  if (device() == Device::kCuda && address != nullptr) {
    cudaPointerAttributes attributes{};
    SG_CUDA_CHECK(cudaPointerGetAttributes(&attributes, address));
    SG_CHECK(attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged, "wrap '", name,
             "': the address is not device memory; a cuda context wraps device (or managed) memory only");
  }
  auto impl = std::make_shared<TensorImpl>(state_, meta, std::move(name), StorageKind::kPersistent);
  impl->address = address;
  impl->external = true;
  return Tensor(std::move(impl));
}

void Context::copy_from_host(const Tensor& dst, const void* src, std::size_t bytes) {
  state_->check_owned(dst, "copy_from_host");
  SG_CHECK_CODE(!tracing(), ErrorCode::kInvalidState, "copy_from_host into '", dst.name(),
                "' while tracing would run now, not at replay; bind step inputs at replay instead");
  SG_CHECK(bytes == static_cast<std::size_t>(dst.bytes()), "copy_from_host: tensor '", dst.name(), "' ", dst.shape(),
           " ", dtype_name(dst.dtype()), " holds ", dst.bytes(), " bytes, got ", bytes);
  if (bytes == 0) return;
  void* address = dst.data();
  if (device() == Device::kHost) {
    std::memcpy(address, src, bytes);
    return;
  }
  const std::int64_t id = dst.impl()->order_id;
  state_->perform(state_->order.prepare(0, {}, std::span(&id, 1)));
  SG_CUDA_CHECK(cudaMemcpyAsync(address, src, bytes, cudaMemcpyHostToDevice, state_->stream(0)));
  state_->order.issue(0, {}, std::span(&id, 1));
  SG_CUDA_CHECK(cudaStreamSynchronize(state_->stream(0)));  // `src` may go away after we return
}

void Context::copy_to_host(const Tensor& src, void* dst, std::size_t bytes) {
  state_->check_owned(src, "copy_to_host");
  SG_CHECK_CODE(!tracing(), ErrorCode::kInvalidState, "reading tensor '", src.name(),
                "' on the host needs a device-to-host copy, which cannot happen while tracing; return it as an "
                "output of the step and read it after replay");
  SG_CHECK(bytes == static_cast<std::size_t>(src.bytes()), "copy_to_host: tensor '", src.name(), "' holds ",
           src.bytes(), " bytes, got a buffer of ", bytes);
  if (bytes == 0) return;
  const void* address = src.data();
  if (device() == Device::kHost) {
    std::memcpy(dst, address, bytes);
    return;
  }
  const std::int64_t id = src.impl()->order_id;
  state_->perform(state_->order.prepare(0, std::span(&id, 1), {}));
  SG_CUDA_CHECK(cudaMemcpyAsync(dst, address, bytes, cudaMemcpyDeviceToHost, state_->stream(0)));
  state_->order.issue(0, std::span(&id, 1), {});
  SG_CUDA_CHECK(cudaStreamSynchronize(state_->stream(0)));
}

void Context::synchronize() {
  if (device() != Device::kCuda || tracing()) return;
  for (const Stream& s : state_->streams) s.synchronize();
}

void Context::begin_segment(std::string name) {
  if (tracing()) state_->recorder->begin_segment(std::move(name));
}

std::vector<Tensor> Context::call(const OpDef& op, OpParams params, std::vector<Tensor> inputs) {
  std::vector<TensorMeta> input_metas;
  input_metas.reserve(inputs.size());
  for (const Tensor& input : inputs) {
    state_->check_owned(input, op.name);
    input_metas.push_back(input.meta());
  }
  std::vector<TensorMeta> output_metas = op.check(params, input_metas);
  const int stream_index = state_->current_stream;

  if (tracing()) {
    SG_CHECK_CODE(!op.reads_to_host, ErrorCode::kInvalidState, "op ", op.name,
                  " reads its result on the host (a device-to-host copy), which cannot be captured; return the "
                  "tensor as an output of the step and read it after replay");
    return state_->recorder->record(op, params, inputs, std::move(output_metas), stream_index);
  }

  std::vector<void*> input_addresses;
  input_addresses.reserve(inputs.size());
  for (const Tensor& input : inputs) {
    SG_CHECK_CODE(input.storage() != StorageKind::kTraced, ErrorCode::kInvalidState, "op ", op.name, ": tensor '",
                  input.name(),
                  "' is a traced value without memory; it exists only inside its "
                  "capture (return it as a step output to read it after replay)");
    input_addresses.push_back(input.data());
  }
  std::vector<Tensor> outputs;
  std::vector<void*> output_addresses;
  for (const TensorMeta& meta : output_metas) {
    auto impl = std::make_shared<TensorImpl>(state_, meta, std::string(op.name), StorageKind::kEager);
    impl->address = state_->allocate(meta.bytes(), StorageKind::kEager, stream_index);
    output_addresses.push_back(impl->address);
    outputs.emplace_back(std::move(impl));
  }
  const KernelArgs args{input_addresses, input_metas, output_addresses, output_metas};

  if (device() == Device::kHost) {
    SG_CHECK_CODE(op.run_host != nullptr, ErrorCode::kUnsupported, "op ", op.name, " has no host reference");
    op.run_host(params, args);
    return outputs;
  }
  SG_CHECK_CODE(op.launch_cuda != nullptr, ErrorCode::kUnsupported, "op ", op.name, " has no CUDA launcher");
  std::vector<std::int64_t> reads;
  std::vector<std::int64_t> writes;
  for (const Tensor& input : inputs) reads.push_back(input.impl()->order_id);
  for (const Tensor& output : outputs) writes.push_back(output.impl()->order_id);
  for (int index : op.written_inputs(params, inputs.size())) writes.push_back(inputs.at(index).impl()->order_id);
  state_->perform(state_->order.prepare(stream_index, reads, writes));
  op.launch_cuda(params, args, state_->stream(stream_index));
  state_->order.issue(stream_index, reads, writes);
  return outputs;
}

namespace {
std::vector<std::int64_t> order_ids(std::span<const Tensor> tensors) {
  std::vector<std::int64_t> ids;
  for (const Tensor& tensor : tensors) ids.push_back(tensor.impl()->order_id);
  return ids;
}
}  // namespace

void Context::order_main_stream_before(std::span<const Tensor> reads, std::span<const Tensor> writes) {
  if (device() != Device::kCuda) return;
  state_->perform(state_->order.prepare(0, order_ids(reads), order_ids(writes)));
}

void Context::mark_main_stream_access(std::span<const Tensor> reads, std::span<const Tensor> writes) {
  if (device() != Device::kCuda) return;
  state_->order.issue(0, order_ids(reads), order_ids(writes));
}

StreamScope::StreamScope(Context& context, int index) : context_(context), previous_(context.current_stream()) {
  SG_CHECK(index >= 0 && index < context.stream_count(), "StreamScope: stream ", index,
           " does not exist; this context has streams 0..", context.stream_count() - 1,
           " (pass side_streams to the Context)");
  context_.state_->current_stream = index;
}

StreamScope::~StreamScope() { context_.state_->current_stream = previous_; }

// --- Tensor accessors --------------------------------------------------------

const TensorMeta& Tensor::meta() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->meta;
}

const std::string& Tensor::name() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->name;
}

const Tensor& Tensor::set_name(std::string name) const {
  SG_CHECK(defined(), "use of an undefined tensor");
  impl_->name = std::move(name);
  return *this;
}

StorageKind Tensor::storage() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->storage;
}

std::uint64_t Tensor::context_id() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  return impl_->context->id;
}

void* Tensor::data() const {
  SG_CHECK(defined(), "use of an undefined tensor");
  switch (impl_->storage) {
    case StorageKind::kPersistent:
    case StorageKind::kEager: return impl_->address;
    case StorageKind::kTraced:
      SG_THROW(ErrorCode::kInvalidState, "tensor '", impl_->name,
               "' is a traced value: it has no memory while tracing, and none after its capture unless it is "
               "an output of the step");
    case StorageKind::kPool:
      SG_CHECK_CODE(!impl_->freed_by_policy, ErrorCode::kInvalidState, "tensor '", impl_->name,
                    "' was left in the graph pool without being returned as an output, and the pool report policy "
                    "'free' released it; return it as an output to keep it");
      SG_CHECK_CODE(impl_->pool != nullptr && !impl_->pool->released(), ErrorCode::kInvalidState, "tensor '",
                    impl_->name, "' lives in a graph pool that was released; it can no longer be read");
      return static_cast<std::byte*>(impl_->pool->base()) + impl_->pool_offset;
  }
  SG_THROW(ErrorCode::kInternal, "unknown storage kind");
}

}  // namespace stepgraph
