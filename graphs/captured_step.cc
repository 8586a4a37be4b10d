#include "graphs/captured_step.h"

#include <atomic>
#include <chrono>

#include "engine/error.h"
#include "engine/logging.h"
#include "graphs/collective_check.h"
#include "graphs/tracer.h"

namespace stepgraph {
namespace {

std::atomic<std::int64_t> recordings{0};

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

std::int64_t CapturedStep::total_recordings() { return recordings.load(); }

std::shared_ptr<CapturedStep> CapturedStep::capture(Context& ctx, const StepFunction& step,
                                                    const CaptureOptions& options) {
  std::shared_ptr<CapturedStep> self(new CapturedStep(ctx, options));
  TraceResult traced = self->trace(step);
  const std::vector<std::uint64_t> groups =
      check_uniform_collectives(traced.program, options.communicators);  // before anything is recorded
  self->report_ = apply_pool_report_policy(traced, options.pool_report_policy);
  self->plan_and_bind(std::move(traced));
  self->share_peer_windows(groups);
  self->record_and_instantiate();
  logger().info("captured a step: {} instructions, {} segment(s), pool {} bytes (lower bound {}), {} event(s)",
                self->program_.instructions().size(), self->segment_count(), self->plan_.pool_bytes,
                self->plan_.lower_bound_bytes, self->plan_.event_count);
  return self;
}

std::int64_t CapturedStep::planned_pool_bytes(Context& ctx, const StepFunction& step, const CaptureOptions& options) {
  CapturedStep probe(ctx, options);
  TraceResult traced = probe.trace(step);
  (void)apply_pool_report_policy(traced, options.pool_report_policy);
  return plan_step(traced.program).pool_bytes;
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

// Plans the pool, allocates it, and gives every value its address: persistent
// tensors keep theirs, pool values get base + offset, and the tensors that
// outlive the trace (outputs, kept values) now point into the pool.
void CapturedStep::plan_and_bind(TraceResult traced) {
  const auto clock = std::chrono::steady_clock::now();
  plan_ = plan_step(traced.program);
  timings_.plan_ms = ms_since(clock);
  if (options_.pool != nullptr) {  // Note [Steps sharing one pool]
    SG_CHECK(!options_.pool->released(), "capture: the shared pool given in CaptureOptions::pool was released");
    SG_CHECK(options_.pool->bytes() >= plan_.pool_bytes, "capture: the step plans a pool of ", plan_.pool_bytes,
             " bytes, but the shared pool holds ", options_.pool->bytes(),
             "; size it by the largest step (capture_sharing_one_pool does)");
    pool_ = options_.pool;
  } else {
    pool_ = ctx_.backend().allocate_pool(plan_.pool_bytes);
  }
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
      addresses_[value.id] = impl->raw_address();
      keep_alive_.push_back(impl);
      if (read[value.id]) {
        persistent_reads_.emplace_back(impl);
        read_inputs_.insert(impl.get());
      }
      if (written[value.id]) persistent_writes_.emplace_back(impl);
      continue;
    }
    const std::int64_t offset = plan_.offsets[value.id];
    addresses_[value.id] = value.bytes() == 0 ? nullptr : base + offset;
    if (impl != nullptr) {  // an output or a value kept by the warn policy
      impl->bind_to_pool(pool_, offset);
      persistent_writes_.emplace_back(impl);  // replays write it on the main stream
    }
  }
  for (ValueId id : traced.outputs) outputs_.emplace_back(traced.impls[id]);
  program_ = std::move(traced.program);
}

// Note [The pool as symmetric memory] (engine/peer_window.h): every group
// with peer copies gets this step's pool and receive table, in the order the
// uniformity check met the groups (so every rank shares alike, also a rank
// that receives nothing in a group).
void CapturedStep::share_peer_windows(const std::vector<std::uint64_t>& groups) {
  for (const std::uint64_t id : groups) {
    Communicator& comm = find_communicator(id);
    if (comm.peer_transport() != PeerTransport::kPeerCopy) continue;
    std::vector<PeerReceive> receives;
    for (const Instruction& instruction : program_.instructions()) {
      if (instruction.op->collective == nullptr) continue;
      const CollectiveCall call = instruction.op->collective(instruction.params);
      if (call.communicator != id || call.window_slot < 0) continue;
      SG_CHECK_CODE(instruction.outputs.size() == 1, ErrorCode::kInternal, "op ", instruction.op->name,
                    " receives through a peer window but makes ", instruction.outputs.size(), " outputs");
      const ValueId received = instruction.outputs[0];
      const ValueInfo& value = program_.value(received);
      if (value.kind == ValueKind::kPersistent || value.bytes() == 0) continue;  // stays on NCCL
      receives.push_back({call.window_slot, plan_.offsets[received], value.bytes()});
    }
    peer_windows_.push_back(
        comm.share_window(static_cast<std::byte*>(pool_->base()), pool_->bytes(), receives));
  }
}

// Prepares every segment, records them, then instantiates them: no work
// runs before the first replay. See Note [Capturing by stream capture].
void CapturedStep::record_and_instantiate() {
  Backend& backend = ctx_.backend();
  for (const StepPlan::Range& range : plan_.segment_ranges) segments_.emplace_back(program_, plan_, range, addresses_);
  auto clock = std::chrono::steady_clock::now();
  for (const BoundSchedule& segment : segments_) backend.prepare(segment.entries());
  timings_.prepare_ms = ms_since(clock);
  std::vector<std::unique_ptr<Recording>> recorded;
  clock = std::chrono::steady_clock::now();
  for (const BoundSchedule& segment : segments_) {
    recorded.push_back(backend.record(segment.entries(), plan_.event_count));
    ++recordings;
  }
  timings_.capture_ms = ms_since(clock);
  clock = std::chrono::steady_clock::now();
  for (const auto& recording : recorded) executables_.push_back(backend.instantiate(*recording));
  timings_.instantiate_ms = ms_since(clock);
  recorded_pool_base_ = pool_->base();
}

CapturedStep::~CapturedStep() {
  // Executables go first, then the peers' mappings; the pool memory goes
  // with its last owner, which may be an output tensor.
  executables_.clear();
  peer_windows_.clear();
}

void CapturedStep::check_state(GraphState expected, std::string_view action) const {
  SG_CHECK_CODE(state_ == expected, ErrorCode::kInvalidState, "cannot ", action, ": the captured step is ",
                graph_state_name(state_),
                state_ == GraphState::kReleased ? " (its pool was released; capture the step again)" : "");
}

void CapturedStep::bind_inputs(std::span<const InputBinding> bindings, std::span<CUstream_st* const> source_streams) {
  for (const InputBinding& binding : bindings) {
    const Tensor& target = binding.static_input;
    const Tensor& source = binding.source;
    SG_CHECK(target.defined() && source.defined(), "replay: an input binding has an undefined tensor");
    SG_CHECK(target.is_persistent(), "replay: '", target.name(),
             "' is not a persistent tensor; step inputs are persistent tensors at fixed addresses");
    SG_CHECK(target.context_id() == ctx_.id() && source.context_id() == ctx_.id(), "replay: input '", target.name(),
             "' and its source must belong to the step's context");
    SG_CHECK(read_inputs_.count(target.impl().get()) > 0, "replay: the captured step never reads '", target.name(),
             "', so binding a source to it would change nothing; bind the persistent inputs the step reads");
    SG_CHECK(target.meta() == source.meta(), "replay: input '", target.name(), "' is ", target.shape(), " ",
             dtype_name(target.dtype()), " but its source '", source.name(), "' is ", source.shape(), " ",
             dtype_name(source.dtype()));
    if (source.data() == target.data()) continue;  // already in place
    const Tensor reads[] = {source};
    const Tensor writes[] = {target};
    ctx_.order_main_stream_before(reads, writes);
    ctx_.backend().copy_within(target.data(), source.data(), static_cast<std::size_t>(target.bytes()), 0);
    ctx_.mark_main_stream_access(reads, writes);
  }
  // See Note [Sources the caller reuses].
  if (!bindings.empty()) {
    for (CUstream_st* stream : source_streams) ctx_.backend().order_external_after(0, stream);
  }
}

void CapturedStep::run_segment(std::size_t index) {
  SG_CHECK(index < segment_count(), "replay_segment: segment ", index, " does not exist (", segment_count(),
           " segment(s))");
  ctx_.order_main_stream_before(persistent_reads_, persistent_writes_);
  executables_[index]->launch();
  ctx_.mark_main_stream_access(persistent_reads_, persistent_writes_);
}

void CapturedStep::replay(std::span<const InputBinding> bindings, std::span<CUstream_st* const> source_streams) {
  check_state(GraphState::kInstantiated, "replay");
  SG_CHECK_CODE(!ctx_.tracing(), ErrorCode::kInvalidState, "cannot replay a captured step while tracing");
  bind_inputs(bindings, source_streams);
  for (std::size_t i = 0; i < segment_count(); ++i) run_segment(i);
  ++replays_;
}

void CapturedStep::replay_segment(std::size_t index, std::span<const InputBinding> bindings,
                                  std::span<CUstream_st* const> source_streams) {
  check_state(GraphState::kInstantiated, "replay a segment");
  SG_CHECK_CODE(!ctx_.tracing(), ErrorCode::kInvalidState, "cannot replay a captured step while tracing");
  bind_inputs(bindings, source_streams);
  run_segment(index);
  if (index + 1 == segment_count()) ++replays_;
}

StepProfile CapturedStep::profile() {
  check_state(GraphState::kInstantiated, "profile");
  SG_CHECK_CODE(!ctx_.tracing(), ErrorCode::kInvalidState, "cannot profile a captured step while tracing");
  std::vector<std::vector<OpTiming>> timings;
  ctx_.order_main_stream_before(persistent_reads_, persistent_writes_);
  for (const BoundSchedule& segment : segments_) {
    timings.push_back(ctx_.backend().profile(segment.entries(), plan_.event_count));
  }
  ctx_.mark_main_stream_access(persistent_reads_, persistent_writes_);
  return build_step_profile(program_, plan_, timings);
}

void CapturedStep::release_pool() {
  check_state(GraphState::kInstantiated, "release the pool");
  ctx_.synchronize();
  executables_.clear();
  segments_.clear();
  if (shares_pool()) {
    pool_.reset();  // the others still run in it; it goes with its last owner
  } else {
    pool_->release();
  }
  addresses_.clear();
  state_ = GraphState::kReleased;
}

}  // namespace stepgraph
