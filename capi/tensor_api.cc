// The C API's devices, contexts and tensors.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capi/handles.h"
#include "engine/algorithm_choice.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/printable_text.h"

using stepgraph::Context;
using stepgraph::Device;
using stepgraph::Shape;
using stepgraph::TensorMeta;
using stepgraph::capi::copy_string;
using stepgraph::capi::require;
using stepgraph::capi::run_guarded;

namespace {

Shape make_shape(const char* function, int rank, const int64_t* dims) {
  SG_CHECK(rank >= 0 && rank <= 8, function, ": rank must be in [0, 8], got ", rank);
  if (rank > 0) require(dims, function, "dims");
  std::vector<std::int64_t> values(dims, dims + rank);
  for (int i = 0; i < rank; ++i) {
    SG_CHECK(values[i] >= 0, function, ": dimension ", i, " is ", values[i], "; dimensions must be >= 0");
  }
  return Shape(std::move(values));
}

// Row-major strides in elements; a dimension of size 1 may have any stride.
void check_contiguous(const char* name, const Shape& shape, const int64_t* strides) {
  if (strides == nullptr || shape.numel() == 0) return;
  std::int64_t expected = 1;
  for (int i = shape.rank() - 1; i >= 0; --i) {
    const std::int64_t dim = shape.dims()[i];
    SG_CHECK(
        dim == 1 || strides[i] == expected, "sg_tensor_wrap '", name, "': strides (in elements) [",
        [&] {
          std::string text;
          for (int j = 0; j < shape.rank(); ++j) text += (j ? ", " : "") + std::to_string(strides[j]);
          return text;
        }(),
        "] for shape ", shape,
        " are not contiguous row-major; StepGraph reads dense rows, so make the array contiguous first "
        "(torch: .contiguous(), numpy: np.ascontiguousarray)");
    expected *= dim;
  }
}

// The byte count of a wrapped tensor, for every address (not only null):
// dims whose product overflows int64 (or whose bytes do) are an Error naming
// the tensor, and so is a range [data, data + bytes) that passes the end of
// the address space. Whether the caller's memory really holds those bytes
// cannot be checked here; stepgraph.h says what the caller guarantees.
void check_wrapped_bytes(const char* function, const char* name, const TensorMeta& meta, const void* data) {
  std::int64_t bytes = 0;
  try {
    bytes = meta.bytes();
  } catch (const stepgraph::Error& error) {
    SG_THROW(stepgraph::ErrorCode::kInvalidArgument, function, " '", name, "': ", error.message(),
             "; a wrapped tensor's dims times its element size must fit in int64");
  }
  const auto start = reinterpret_cast<std::uintptr_t>(data);
  SG_CHECK(static_cast<std::uint64_t>(bytes) <= UINTPTR_MAX - start, function, " '", name, "': ", bytes,
           " bytes from address ", data, " pass the end of the address space; the dims ", meta.shape,
           " do not describe memory at that address");
}

// The tensor behind a live handle (the shared_ptr keeps it alive for the call).
std::shared_ptr<sg_tensor_s> tensor_of(sg_tensor tensor, const char* function) {
  return stepgraph::capi::handle_object(tensor, function, "tensor");
}

// The body of a context call that writes one value: the handle checked, then
// `out` required, then `*out = read(context)`; an error names `function`.
template <typename T, typename Read>
sg_result read_context(const char* function, sg_context ctx, T* out, const Read& read) {
  return run_guarded(function, [&] {
    const std::shared_ptr<Context> context = stepgraph::capi::context_of(ctx, function);
    require(out, function, "out");
    *out = read(*context);
  });
}

// The body of a tensor call that writes one value: the handle checked, then
// `out` required, then `*out = read(tensor)`; an error names `function`.
template <typename T, typename Read>
sg_result read_tensor(const char* function, sg_tensor tensor, T* out, const Read& read) {
  return run_guarded(function, [&] {
    const auto t = tensor_of(tensor, function);
    require(out, function, "out");
    *out = read(*t);
  });
}

}  // namespace

extern "C" sg_result sg_cuda_device_count(int* count, char* reason, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    require(count, function, "count");
    const stepgraph::DeviceCount found = stepgraph::cuda_device_count();
    *count = found.count;
    copy_string(found.no_device_reason, reason, capacity, length);
  });
}

extern "C" sg_result sg_context_create(sg_device device, int side_streams, sg_context* out) {
  return run_guarded(__func__, [&, function = __func__] {
    require(out, function, "out");
    *out = nullptr;
    auto ctx = std::make_shared<Context>(stepgraph::capi::to_device(device), side_streams);
    *out = stepgraph::capi::issue_handle(std::make_shared<sg_context_s>(sg_context_s{std::move(ctx)}));
  });
}

extern "C" sg_result sg_context_destroy(sg_context ctx) {
  return stepgraph::capi::destroy_handle(ctx, __func__, "ctx");
}

extern "C" sg_result sg_context_device(sg_context ctx, sg_device* out) {
  return read_context(__func__, ctx, out,
                      [](const Context& context) { return stepgraph::capi::to_c_device(context.device()); });
}

extern "C" sg_result sg_context_stream_count(sg_context ctx, int* out) {
  return read_context(__func__, ctx, out, [](const Context& context) { return context.stream_count(); });
}

extern "C" sg_result sg_context_cuda_stream(sg_context ctx, int index, void** out) {
  return read_context(__func__, ctx, out, [&](const Context& context) { return context.cuda_stream(index); });
}

extern "C" sg_result sg_context_synchronize(sg_context ctx) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    context->synchronize();
  });
}

extern "C" sg_result sg_stream_scope_enter(sg_context ctx, int index, sg_stream_scope* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    require(out, function, "out");
    *out = nullptr;
    auto scope = std::make_shared<sg_stream_scope_s>(context);
    scope->scope.emplace(*scope->ctx, index);
    *out = stepgraph::capi::issue_handle(std::move(scope));
  });
}

extern "C" sg_result sg_stream_scope_exit(sg_stream_scope scope) {
  return stepgraph::capi::destroy_handle(scope, __func__, "scope");
}

extern "C" sg_result sg_cuda_stream_synchronize(void* stream) {
  return run_guarded(
      __func__, [&, function = __func__] { SG_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); });
}

extern "C" sg_result sg_context_memory(sg_context ctx, int64_t* persistent_bytes, int64_t* eager_bytes,
                                       int64_t* eager_peak_bytes) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    const stepgraph::MemoryStats stats = context->memory_stats();
    if (persistent_bytes != nullptr) *persistent_bytes = stats.persistent_bytes;
    if (eager_bytes != nullptr) *eager_bytes = stats.eager_bytes;
    if (eager_peak_bytes != nullptr) *eager_peak_bytes = stats.eager_peak_bytes;
  });
}

extern "C" sg_result sg_context_set_communication_stream(sg_context ctx, int index) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    context->set_communication_stream(index);
  });
}

extern "C" sg_result sg_context_communication_stream(sg_context ctx, int* out) {
  return read_context(__func__, ctx, out, [](const Context& context) { return context.communication_stream(); });
}

extern "C" sg_result sg_context_set_gemm_algorithms(sg_context ctx, const char* choice) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    require(choice, function, "choice");
    const std::optional<stepgraph::AlgorithmChoice> parsed = stepgraph::parse_algorithm_choice(choice);
    SG_CHECK(parsed.has_value(), function, ": choice ", stepgraph::quoted(choice),
             " is not a GEMM algorithm choice; use \"heuristic\" or \"timed\"");
    context->set_algorithm_choice(*parsed);
  });
}

extern "C" sg_result sg_context_gemm_algorithms(sg_context ctx, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    stepgraph::capi::copy_string(stepgraph::algorithm_choice_name(context->algorithm_choice()), buffer, capacity,
                                 length);
  });
}

extern "C" sg_result sg_tensor_create(sg_context ctx, const char* name, sg_dtype dtype, int rank, const int64_t* dims,
                                      sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    require(name, function, "name");
    require(out, function, "out");
    *out = nullptr;
    const TensorMeta meta{make_shape(function, rank, dims), stepgraph::capi::to_dtype(dtype)};
    *out = stepgraph::capi::new_tensor_handle(context, context->persistent(name, meta));
  });
}

extern "C" sg_result sg_tensor_wrap(sg_context ctx, const char* name, sg_dtype dtype, int rank, const int64_t* dims,
                                    const int64_t* strides, void* data, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const std::shared_ptr<stepgraph::Context> context = stepgraph::capi::context_of(ctx, function);
    require(name, function, "name");
    require(out, function, "out");
    *out = nullptr;
    const TensorMeta meta{make_shape(function, rank, dims), stepgraph::capi::to_dtype(dtype)};
    check_contiguous(name, meta.shape, strides);
    check_wrapped_bytes(function, name, meta, data);
    *out = stepgraph::capi::new_tensor_handle(context, context->wrap(name, meta, data));
  });
}

extern "C" sg_result sg_tensor_retain(sg_tensor tensor, sg_tensor* out) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto t = tensor_of(tensor, function);
    require(out, function, "out");
    *out = stepgraph::capi::issue_handle(std::make_shared<sg_tensor_s>(sg_tensor_s{t->ctx, t->tensor}));
  });
}

extern "C" sg_result sg_tensor_destroy(sg_tensor tensor) {
  return stepgraph::capi::destroy_handle(tensor, __func__, "tensor");
}

extern "C" sg_result sg_tensor_rank(sg_tensor tensor, int* out) {
  return read_tensor(__func__, tensor, out, [](const sg_tensor_s& t) { return t.tensor.shape().rank(); });
}

extern "C" sg_result sg_tensor_dims(sg_tensor tensor, int64_t* dims, int capacity) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto t = tensor_of(tensor, function);
    const std::vector<std::int64_t>& values = t->tensor.shape().dims();
    SG_CHECK(capacity >= 0, function, ": capacity is negative (", capacity, ")");
    if (capacity > 0) require(dims, function, "dims");
    for (int i = 0; i < capacity && i < static_cast<int>(values.size()); ++i) dims[i] = values[i];
  });
}

extern "C" sg_result sg_tensor_dtype(sg_tensor tensor, sg_dtype* out) {
  return read_tensor(__func__, tensor, out,
                     [](const sg_tensor_s& t) { return stepgraph::capi::from_dtype(t.tensor.dtype()); });
}

extern "C" sg_result sg_tensor_device(sg_tensor tensor, sg_device* out) {
  return read_tensor(__func__, tensor, out,
                     [](const sg_tensor_s& t) { return stepgraph::capi::to_c_device(t.ctx->device()); });
}

// sg_storage mirrors StorageKind value for value.
static_assert(static_cast<int>(stepgraph::StorageKind::kPool) == SG_STORAGE_POOL &&
              static_cast<int>(stepgraph::StorageKind::kUnavailable) == SG_STORAGE_UNAVAILABLE);

extern "C" sg_result sg_tensor_storage(sg_tensor tensor, sg_storage* out) {
  return read_tensor(__func__, tensor, out,
                     [](const sg_tensor_s& t) { return static_cast<sg_storage>(t.tensor.storage()); });
}

extern "C" sg_result sg_tensor_numel(sg_tensor tensor, int64_t* out) {
  return read_tensor(__func__, tensor, out, [](const sg_tensor_s& t) { return t.tensor.numel(); });
}

extern "C" sg_result sg_tensor_bytes(sg_tensor tensor, int64_t* out) {
  return read_tensor(__func__, tensor, out, [](const sg_tensor_s& t) { return t.tensor.bytes(); });
}

extern "C" sg_result sg_tensor_data(sg_tensor tensor, void** out) {
  return read_tensor(__func__, tensor, out, [](const sg_tensor_s& t) { return t.tensor.data(); });
}

extern "C" sg_result sg_tensor_name(sg_tensor tensor, char* buffer, size_t capacity, size_t* length) {
  return run_guarded(__func__, [&, function = __func__] {
    copy_string(tensor_of(tensor, function)->tensor.name(), buffer, capacity, length);
  });
}

extern "C" sg_result sg_tensor_set_name(sg_tensor tensor, const char* name) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto t = tensor_of(tensor, function);
    require(name, function, "name");
    SG_CHECK(name[0] != '\0', function, ": name is empty; a tensor's name appears in dumps, reports and errors");
    t->tensor.set_name(name);
  });
}

extern "C" sg_result sg_tensor_copy_from_host(sg_tensor tensor, const void* src, size_t bytes) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto t = tensor_of(tensor, function);
    if (bytes > 0) require(src, function, "src");
    t->ctx->copy_from_host(t->tensor, src, bytes);
  });
}

extern "C" sg_result sg_tensor_copy_to_host(sg_tensor tensor, void* dst, size_t bytes) {
  return run_guarded(__func__, [&, function = __func__] {
    const auto t = tensor_of(tensor, function);
    if (bytes > 0) require(dst, function, "dst");
    t->ctx->copy_to_host(t->tensor, dst, bytes);
  });
}
