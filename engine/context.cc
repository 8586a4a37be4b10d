#include "engine/context.h"

#include <atomic>

#include "engine/context_state.h"
#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph {
namespace detail {
namespace {
std::atomic<std::uint64_t> next_context_id{1};

int checked_stream_count(int side_streams) {
  SG_CHECK(side_streams >= 0 && side_streams <= 8, "Context: side_streams must be in [0, 8], got ", side_streams);
  return 1 + side_streams;
}
}  // namespace

ContextState::ContextState(Device device, int side_streams)
    : id(next_context_id++), stream_count(checked_stream_count(side_streams)), order(stream_count) {
  backend = make_backend(device, stream_count);
}

ContextState::~ContextState() {
  try {
    backend->synchronize();
  } catch (const std::exception& error) {
    logger().error("synchronize at context exit failed: {}", error.what());
  }
}

void ContextState::order_before(int stream, std::span<const std::int64_t> reads, std::span<const std::int64_t> writes) {
  backend->wait(order.prepare(stream, reads, writes));
}

void* ContextState::allocate(std::int64_t bytes, MemoryKind kind, int stream) {
  void* address = backend->allocate(bytes, kind, stream);
  if (kind == MemoryKind::kPersistent) {
    stats.persistent_bytes += bytes;
  } else {
    stats.eager_bytes += bytes;
    stats.eager_peak_bytes = std::max(stats.eager_peak_bytes, stats.eager_bytes);
  }
  return address;
}

void ContextState::release(const TensorImpl& impl) noexcept {
  const std::int64_t id = impl.order_id();
  void* address = impl.raw_address();
  if (address != nullptr && !impl.callers_memory()) {
    const bool eager = impl.storage() == StorageKind::kEager;
    try {
      // Freeing is a write on the main stream: it waits for every access on
      // other streams, so no later allocation can reuse memory still in use.
      if (eager) order_before(0, {}, std::span(&id, 1));
    } catch (const std::exception& error) {
      logger().error("ordering the free of tensor '{}' failed: {}", impl.name(), error.what());
    }
    backend->free(address, eager ? MemoryKind::kEager : MemoryKind::kPersistent, 0);
    (eager ? stats.eager_bytes : stats.persistent_bytes) -= impl.meta().bytes();
  }
  order.forget(id);
}

void ContextState::check_owned(const Tensor& tensor, std::string_view op) const {
  SG_CHECK(tensor.defined(), "op ", op, ": an input tensor is undefined (default-constructed)");
  SG_CHECK(tensor.context_id() == id, "op ", op, ": tensor '", tensor.name(), "' belongs to context ",
           tensor.context_id(), ", not to this context (", id, "); create it with this context or copy it over");
}

}  // namespace detail

using detail::ContextState;
using detail::TensorImpl;

namespace {
std::vector<std::int64_t> order_ids(std::span<const Tensor> tensors) {
  std::vector<std::int64_t> ids;
  ids.reserve(tensors.size());
  for (const Tensor& tensor : tensors) ids.push_back(tensor.impl()->order_id());
  return ids;
}
}  // namespace

Context::Context(Device device, int side_streams) : state_(std::make_shared<ContextState>(device, side_streams)) {}

Context::~Context() {
  if (state_->recorder != nullptr) logger().error("a Context was destroyed while a step was being traced on it");
}

Device Context::device() const { return state_->backend->device(); }
std::uint64_t Context::id() const { return state_->id; }
int Context::stream_count() const { return state_->stream_count; }
int Context::current_stream() const { return state_->current_stream; }
bool Context::tracing() const { return state_->recorder != nullptr; }

void Context::set_algorithm_choice(AlgorithmChoice choice) {
  SG_CHECK(choice == AlgorithmChoice::kHeuristic || choice == AlgorithmChoice::kTimed,
           "set_algorithm_choice: unknown choice ", static_cast<int>(choice), "; use an AlgorithmChoice enumerator");
  SG_CHECK_CODE(!tracing(), ErrorCode::kInvalidState,
                "set_algorithm_choice: a step is being traced; set the choice before tracing it");
  state_->algorithm_choice = choice;
}

AlgorithmChoice Context::algorithm_choice() const { return state_->algorithm_choice; }
MemoryStats Context::memory_stats() const { return state_->stats; }
OpRecorder* Context::recorder() const { return state_->recorder; }
Backend& Context::backend() const { return *state_->backend; }

void Context::set_recorder(OpRecorder* recorder) {
  SG_CHECK_CODE(recorder == nullptr || state_->recorder == nullptr, ErrorCode::kInvalidState,
                "a step is already being traced on this context; traces cannot nest");
  state_->recorder = recorder;
}

void Context::set_communication_stream(int index) {
  SG_CHECK(index == -1 || (index >= 1 && index < state_->stream_count),
           "the communication stream must be a side stream in [1, ", state_->stream_count,
           ") (create the context with enough side streams), or -1 for none, got ", index);
  state_->communication_stream = index;
}

int Context::communication_stream() const { return state_->communication_stream; }

CUstream_st* Context::cuda_stream(int index) const {
  SG_CHECK(index >= 0 && index < state_->stream_count, "stream index ", index, " out of range [0, ",
           state_->stream_count, ")");
  return state_->backend->native_stream(index);
}

Tensor Context::persistent(std::string name, const TensorMeta& meta) {
  SG_CHECK(!name.empty(), "a persistent tensor needs a name (it appears in dumps, reports and errors)");
  void* address = nullptr;
  try {
    address = state_->allocate(meta.bytes(), MemoryKind::kPersistent, 0);
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kOutOfMemory) throw;
    // Name the tensor: "out of memory" alone does not say which parameter of
    // a large model did not fit.
    SG_CHECK_CODE(false, ErrorCode::kOutOfMemory, "persistent tensor '", name, "' ", meta.shape.to_string(), " ",
                  dtype_name(meta.dtype), " (", meta.bytes(), " bytes) does not fit in ",
                  device_name(state_->backend->device()), " memory after ", state_->stats.persistent_bytes,
                  " persistent bytes: ", error.message());
  }
  auto impl = TensorImpl::persistent(state_, meta, std::move(name), address, TensorImpl::Ownership::kOwned);
  const std::int64_t id = impl->order_id();
  state_->order.issue(0, {}, std::span(&id, 1));  // the zero fill on stream 0
  return Tensor(std::move(impl));
}

Tensor Context::wrap(std::string name, const TensorMeta& meta, void* address) {
  SG_CHECK(!name.empty(), "a wrapped tensor needs a name (it appears in dumps, reports and errors)");
  SG_CHECK(address != nullptr || meta.bytes() == 0, "wrap '", name, "': the address is null for ", meta.bytes(),
           " bytes");
  if (address != nullptr) state_->backend->check_wrappable(name, address);
  return Tensor(TensorImpl::persistent(state_, meta, std::move(name), address, TensorImpl::Ownership::kCallers));
}

void Context::copy_from_host(const Tensor& dst, const void* src, std::size_t bytes) {
  state_->check_owned(dst, "copy_from_host");
  SG_CHECK_CODE(!tracing(), ErrorCode::kInvalidState, "copy_from_host into '", dst.name(),
                "' while tracing would run now, not at replay; bind step inputs at replay instead");
  SG_CHECK(bytes == static_cast<std::size_t>(dst.bytes()), "copy_from_host: tensor '", dst.name(), "' ", dst.shape(),
           " ", dtype_name(dst.dtype()), " holds ", dst.bytes(), " bytes, got ", bytes);
  if (bytes == 0) return;
  void* address = dst.data();
  const std::int64_t id = dst.impl()->order_id();
  state_->order_before(0, {}, std::span(&id, 1));
  state_->backend->copy_from_host(address, src, bytes);
  state_->order.issue(0, {}, std::span(&id, 1));
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
  const std::int64_t id = src.impl()->order_id();
  state_->order_before(0, std::span(&id, 1), {});
  state_->backend->copy_to_host(dst, address, bytes);
  state_->order.issue(0, std::span(&id, 1), {});
}

void Context::synchronize() {
  if (tracing()) return;
  state_->backend->synchronize();
}

void Context::begin_segment(std::string name) {
  if (tracing()) state_->recorder->begin_segment(std::move(name));
}

void Context::run_if_zero(const Tensor& flag, const std::function<void()>& body) {
  SG_CHECK(flag.defined(), "run_if_zero: the flag is an undefined tensor");
  SG_CHECK(flag.dtype() == DType::kInt32 && flag.numel() == 1,
           "run_if_zero: the flag must be an int32 tensor of one element, got '", flag.name(), "' ", flag.shape(), " ",
           dtype_name(flag.dtype()));
  state_->check_owned(flag, "run_if_zero");
  if (tracing()) {
    state_->recorder->begin_if_zero(flag);
    body();
    state_->recorder->end_if_zero();
    return;
  }
  if (to_vector<std::int32_t>(flag).at(0) == 0) body();
}

std::vector<Tensor> Context::call(const OpDef& op, OpParams params, std::vector<Tensor> inputs) {
  std::vector<TensorMeta> input_metas;
  input_metas.reserve(inputs.size());
  for (const Tensor& input : inputs) {
    state_->check_owned(input, op.name);
    input_metas.push_back(input.meta());
  }
  std::vector<TensorMeta> output_metas = op.check(params, input_metas);
  // Collectives go to the communication stream (Note [Collectives are ops]).
  const int stream = op.collective != nullptr && state_->communication_stream >= 0 ? state_->communication_stream
                                                                                   : state_->current_stream;

  if (tracing()) {
    SG_CHECK_CODE(!op.reads_to_host, ErrorCode::kInvalidState, "op ", op.name,
                  " reads its result on the host (a device-to-host copy), which cannot be captured; return the "
                  "tensor as an output of the step and read it after replay");
    return state_->recorder->record(op, params, inputs, std::move(output_metas), stream);
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
    void* address = state_->allocate(meta.bytes(), MemoryKind::kEager, stream);
    output_addresses.push_back(address);
    outputs.emplace_back(TensorImpl::eager(state_, meta, std::string(op.name), address));
  }
  const KernelArgs args{input_addresses, input_metas, output_addresses, output_metas};

  std::vector<std::int64_t> reads = order_ids(inputs);
  std::vector<std::int64_t> writes = order_ids(outputs);
  for (int index : op.written_inputs(params, inputs.size())) writes.push_back(inputs.at(index).impl()->order_id());
  state_->order_before(stream, reads, writes);
  state_->backend->run(op, params, args, stream);
  state_->order.issue(stream, reads, writes);
  return outputs;
}

void Context::order_main_stream_before(std::span<const Tensor> reads, std::span<const Tensor> writes) {
  state_->order_before(0, order_ids(reads), order_ids(writes));
}

void Context::mark_main_stream_access(std::span<const Tensor> reads, std::span<const Tensor> writes) {
  state_->order.issue(0, order_ids(reads), order_ids(writes));
}

StreamScope::StreamScope(Context& context, int index) : context_(context), previous_(context.current_stream()) {
  SG_CHECK(index >= 0 && index < context.stream_count(), "StreamScope: stream ", index,
           " does not exist; this context has streams 0..", context.stream_count() - 1,
           " (pass side_streams to the Context)");
  context_.state_->current_stream = index;
}

StreamScope::~StreamScope() { context_.state_->current_stream = previous_; }

}  // namespace stepgraph
