#include "graphs/captured_step.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/logging.h"
#include "graphs/pool_memory.h"
#include "graphs/schedule_runner.h"
#include "graphs/stream_capture.h"
#include "graphs/tracer.h"

namespace stepgraph {
namespace {

std::atomic<std::int64_t> stream_captures{0};

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

std::string_view graph_state_name(GraphState state) {
  switch (state) {
    case GraphState::kInstantiated: return "instantiated";
    case GraphState::kReleased: return "released";
  }
  return "unknown";
}

std::int64_t CapturedStep::total_stream_captures() { return stream_captures.load(); }

std::shared_ptr<CapturedStep> CapturedStep::capture(Context& ctx, const StepFunction& step,
                                                    const CaptureOptions& options) {
  std::shared_ptr<CapturedStep> self(new CapturedStep(ctx, options));
  TraceResult traced = self->trace(step);
  self->apply_pool_report_policy(traced);
  self->plan_and_bind(std::move(traced));
  if (ctx.device() == Device::kCuda) self->instantiate();
  logger().info("captured a step: {} instructions, {} segment(s), pool {} bytes (lower bound {}), {} event(s)",
                self->program_.instructions().size(), self->segment_count(), self->plan_.pool_bytes,
                self->plan_.lower_bound_bytes, self->plan_.event_count);
  return self;
}

// The step's locals die when it returns; what is still alive then is held by the caller.
TraceResult CapturedStep::trace(const StepFunction& step) {
  const auto clock = std::chrono::steady_clock::now();
  Tracer tracer(ctx_);
  std::vector<Tensor> outputs = step();
  TraceResult traced = tracer.finish(outputs);
  timings_.trace_ms = ms_since(clock);
  return traced;
}

void CapturedStep::apply_pool_report_policy(TraceResult& traced) {
  report_ = make_pool_report(traced.program, traced.held);
  if (report_.empty()) return;
  switch (options_.pool_report_policy) {
    case PoolReportPolicy::kError:
      SG_THROW(ErrorCode::kInvalidState, report_.to_string(),
               "\nreturn them as outputs of the step, drop the handles before the step returns, or capture "
               "with pool report policy warn (keep them) or free (reuse their memory)");
    case PoolReportPolicy::kWarn:
      logger().warn("{}\n(policy warn: they stay valid until the end of each replay, at the cost of pool memory)",
                    report_.to_string());
      for (ValueId id : traced.held) traced.program.value(id).live_out = true;
      return;
    case PoolReportPolicy::kFree:
      logger().info("{}\n(policy free: their memory is reused; using them is an error)", report_.to_string());
      for (ValueId id : traced.held) {
        traced.impls[id]->storage = StorageKind::kPool;
        traced.impls[id]->freed_by_policy = true;
        traced.impls[id] = nullptr;
      }
      return;
  }
}

// Plans the pool, allocates it, and gives every value its address: persistent
// tensors keep theirs, pool values get base + offset, and the tensors that
// outlive the trace (outputs, kept values) now point into the pool.
void CapturedStep::plan_and_bind(TraceResult traced) {
  const auto clock = std::chrono::steady_clock::now();
  plan_ = plan_step(traced.program);
  timings_.plan_ms = ms_since(clock);
  pool_ = allocate_pool_memory(ctx_.device(), plan_.pool_bytes);
  std::byte* base = static_cast<std::byte*>(pool_->base());

  const auto& values = traced.program.values();
  addresses_.resize(values.size(), nullptr);
  std::vector<bool> read(values.size(), false);
  std::vector<bool> written(values.size(), false);
  for (const Instruction& instruction : traced.program.instructions()) {
    for (ValueId id : instruction.reads()) read[id] = true;
    for (ValueId id : instruction.writes()) written[id] = true;
  }
  for (const ValueInfo& value : values) {
    const auto& impl = traced.impls[value.id];
    if (value.kind == ValueKind::kPersistent) {
      addresses_[value.id] = impl->address;
      keep_alive_.push_back(impl);
      if (read[value.id]) persistent_reads_.emplace_back(impl);
      if (written[value.id]) persistent_writes_.emplace_back(impl);
      continue;
    }
    const std::int64_t offset = plan_.offsets[value.id];
    addresses_[value.id] = value.bytes() == 0 ? nullptr : base + offset;
    if (impl != nullptr) {  // an output or a value kept by the warn policy
      impl->storage = StorageKind::kPool;
      impl->pool = pool_;
      impl->pool_offset = offset;
      persistent_writes_.emplace_back(impl);  // replays write it on the main stream
    }
  }
  for (ValueId id : traced.outputs) outputs_.emplace_back(traced.impls[id]);
  program_ = std::move(traced.program);
}

// Captures and instantiates each segment. See Note [Capturing by stream capture].
void CapturedStep::instantiate() {
  std::vector<cudaStream_t> streams;
  for (int i = 0; i < ctx_.stream_count(); ++i) streams.push_back(ctx_.cuda_stream(i));
  std::vector<cudaEvent_t> events;
  for (std::int32_t i = 0; i < plan_.event_count; ++i) events.push_back(events_.emplace_back().get());
  // Library setup (handles, algorithm choice) cannot happen under capture.
  for (const Instruction& instruction : program_.instructions()) {
    if (instruction.op->prepare_cuda == nullptr) continue;
    std::vector<TensorMeta> metas;
    for (ValueId id : instruction.inputs) metas.push_back(program_.value(id).meta);
    instruction.op->prepare_cuda(instruction.params, metas);
  }
  std::vector<Graph> graphs;
  auto clock = std::chrono::steady_clock::now();
  for (const StepPlan::Range& range : plan_.segment_ranges) {
    StreamCapture capture(streams[0]);
    ++stream_captures;
    run_schedule_cuda(program_, plan_, range, addresses_, streams, events);
    graphs.push_back(capture.end());
  }
  timings_.capture_ms = ms_since(clock);
  clock = std::chrono::steady_clock::now();
  for (const Graph& graph : graphs) {
    execs_.emplace_back(graph);
    execs_.back().upload(streams[0]);
  }
  timings_.instantiate_ms = ms_since(clock);
  recorded_pool_base_ = pool_->base();
}

CapturedStep::~CapturedStep() {
  // Graph execs go first (member order would destroy them first anyway); the
  // pool memory goes with its last owner, which may be an output tensor.
  execs_.clear();
}

void CapturedStep::check_state(GraphState expected, std::string_view action) const {
  SG_CHECK_CODE(state_ == expected, ErrorCode::kInvalidState, "cannot ", action, ": the captured step is ",
                graph_state_name(state_),
                state_ == GraphState::kReleased ? " (its pool was released; capture the step again)" : "");
}

void CapturedStep::bind_inputs(std::span<const InputBinding> bindings) {
  for (const InputBinding& binding : bindings) {
    const Tensor& target = binding.static_input;
    const Tensor& source = binding.source;
    SG_CHECK(target.defined() && source.defined(), "replay: an input binding has an undefined tensor");
    SG_CHECK(target.is_persistent(), "replay: '", target.name(),
             "' is not a persistent tensor; step inputs are persistent tensors at fixed addresses");
    SG_CHECK(target.context_id() == ctx_.id() && source.context_id() == ctx_.id(), "replay: input '", target.name(),
             "' and its source must belong to the step's context");
    SG_CHECK(target.meta() == source.meta(), "replay: input '", target.name(), "' is ", target.shape(), " ",
             dtype_name(target.dtype()), " but its source '", source.name(), "' is ", source.shape(), " ",
             dtype_name(source.dtype()));
    if (source.data() == target.data()) continue;  // already in place
    if (ctx_.device() == Device::kHost) {
      std::memcpy(target.data(), source.data(), static_cast<std::size_t>(target.bytes()));
      continue;
    }
    const Tensor reads[] = {source};
    const Tensor writes[] = {target};
    ctx_.order_main_stream_before(reads, writes);
    SG_CUDA_CHECK(cudaMemcpyAsync(target.data(), source.data(), static_cast<std::size_t>(target.bytes()),
                                  cudaMemcpyDeviceToDevice, ctx_.cuda_stream(0)));
    ctx_.mark_main_stream_access(reads, writes);
  }
}

void CapturedStep::run_segment(std::size_t index) {
  SG_CHECK(index < segment_count(), "replay_segment: segment ", index, " does not exist (", segment_count(),
           " segment(s))");
  if (ctx_.device() == Device::kHost) {
    run_schedule_host(program_, plan_, plan_.segment_ranges[index], addresses_);
    return;
  }
  ctx_.order_main_stream_before(persistent_reads_, persistent_writes_);
  execs_[index].launch(ctx_.cuda_stream(0));
  ctx_.mark_main_stream_access(persistent_reads_, persistent_writes_);
}

void CapturedStep::replay(std::span<const InputBinding> bindings) {
  check_state(GraphState::kInstantiated, "replay");
  SG_CHECK_CODE(!ctx_.tracing(), ErrorCode::kInvalidState, "cannot replay a captured step while tracing");
  bind_inputs(bindings);
  for (std::size_t i = 0; i < segment_count(); ++i) run_segment(i);
  ++replays_;
}

void CapturedStep::replay_segment(std::size_t index, std::span<const InputBinding> bindings) {
  check_state(GraphState::kInstantiated, "replay a segment");
  SG_CHECK_CODE(!ctx_.tracing(), ErrorCode::kInvalidState, "cannot replay a captured step while tracing");
  bind_inputs(bindings);
  run_segment(index);
  if (index + 1 == segment_count()) ++replays_;
}

void CapturedStep::release_pool() {
  check_state(GraphState::kInstantiated, "release the pool");
  ctx_.synchronize();
  execs_.clear();
  pool_->release();
  addresses_.clear();
  state_ = GraphState::kReleased;
}

}  // namespace stepgraph
