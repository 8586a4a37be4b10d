// CapturedStep: a step traced once, planned into one static pool, captured
// into CUDA graphs (one per segment) and replayed with one launch each.
//
//   Tensor x = ctx.persistent("x", {Shape{64, 512}, DType::kFloat32});  // a step input
//   auto step = CapturedStep::capture(ctx, [&] {
//     Tensor y = ops::add(ctx, x, w).set_name("y");
//     return std::vector<Tensor>{ops::sum(ctx, y).set_name("loss")};
//   });
//   step->replay({{x, batch}});            // copies batch into x unless it *is* x
//   float loss = ops::item(ctx, step->outputs()[0]);
//
// Stages are explicit (trace -> plan -> instantiate -> replay) and the state
// is an enum: a call in the wrong state is an Error saying what to do.
// On a host context the same plan runs with the host references over a host
// arena at the planned offsets.
//
// On every backend the stages are the same (see Note [One backend per
// context] in engine/backend.h): each segment's schedule, bound to its
// addresses, is recorded by the context's backend and instantiated; a replay
// launches each segment's executable once. This header knows no CUDA.
//
// Note [Capturing by stream capture]
// On cuda, each segment is captured by running its schedule on the context's streams
// under cudaStreamBeginCapture: our kernels' launchers and library calls
// (cuBLASLt, NCCL) alike are recorded by the very code eager execution runs,
// and the plan's event records and waits become the graph's edges. Building
// kernel nodes by hand would duplicate each launcher's configuration for no
// gain: graphs are instantiated once and replayed unchanged (inputs are bound
// by copying into static buffers, never by patching node parameters).
//
// Note [Inputs at fixed addresses]
// A graph reads its inputs where they were at capture. Step inputs are
// persistent tensors; replay() takes bindings {static input, source} and
// copies each source into its static input first, unless the source is that
// very tensor. A replay therefore never reads a stale address, whatever the
// caller passes.
//
// Note [Steps sharing one pool]
// Steps that never run at the same time (one per shape bucket, say) can
// plan into one pool (CaptureOptions::pool): each keeps its own offsets, the
// pool is sized by the largest plan (capture_sharing_one_pool in
// graphs/shared_pool_capture.h), and memory is the largest step's instead
// of the sum of all of them. A replay overwrites whatever the others left in
// the pool, their pool outputs included: read a step's outputs before
// replaying another. Replays are ordered on the context's main stream, so
// one step's replay never overlaps another's. The pool is held by every
// step and pool output planned into it and is freed when the last one goes.
//
// Note [Sources the caller reuses]
// replay() returns before the copies run (cuda). A source over memory that
// the caller's allocator hands out again as soon as the caller drops it
// (torch's caching allocator after `del batch`) would then be overwritten by
// the caller's next work before our stream read it. replay() therefore takes
// the streams on which the caller may reuse the sources' memory: each is made
// to wait for the copies (not for the step), so the caller's next batch can
// still be prepared while the step runs. The Python binding passes torch's
// current stream and the stream each source was produced on.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/context.h"
#include "graphs/bound_schedule.h"
#include "graphs/graph_cache.h"
#include "graphs/planner.h"
#include "graphs/pool_report.h"
#include "graphs/program.h"
#include "graphs/step_profile.h"
#include "graphs/tracer.h"

namespace stepgraph {

enum class GraphState : std::uint8_t {
  kInstantiated,  // captured and ready to replay
  kReleased,      // release_pool() was called: replay is an Error
};
std::string_view graph_state_name(GraphState state);

struct CaptureOptions {
  PoolReportPolicy pool_report_policy = PoolReportPolicy::kWarn;
  // The groups whose ranks capture this step together: before recording,
  // their ranks compare the collectives they would record
  // (graphs/collective_check.h). Communicators the step uses are checked
  // whether listed or not; list them so that a rank whose step makes no
  // collective on one is found too.
  std::vector<Communicator*> communicators;
  // A pool to plan into instead of one of the step's own (Note [Steps sharing
  // one pool]): it must hold the step's plan (an Error otherwise). Null: the
  // step allocates its own.
  std::shared_ptr<PoolMemory> pool;
};

struct InputBinding {
  Tensor static_input;  // a persistent tensor the step reads
  Tensor source;        // copied into static_input before the replay
};

struct CaptureTimings {
  double trace_ms = 0;
  double plan_ms = 0;
  double prepare_ms = 0;      // library setup before recording (cuda: cuBLASLt algorithm choice)
  double capture_ms = 0;      // recording every segment (cuda: stream capture)
  double instantiate_ms = 0;  // building each executable (cuda: cudaGraphInstantiate + upload)
};

class CapturedStep final : public CachedGraph {
 public:
  using StepFunction = std::function<std::vector<Tensor>()>;

  // Traces `step` on `ctx`, applies the pool report policy, plans, allocates
  // the pool, records and instantiates each segment. The context
  // must outlive the returned step.
  static std::shared_ptr<CapturedStep> capture(Context& ctx, const StepFunction& step,
                                               const CaptureOptions& options = {});
  // The pool bytes capture() would plan for `step` (traced and planned, the
  // pool report policy applied; nothing allocated or recorded).
  static std::int64_t planned_pool_bytes(Context& ctx, const StepFunction& step, const CaptureOptions& options = {});
  ~CapturedStep() override;
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  // Binds inputs (see Note [Inputs at fixed addresses]) and runs every
  // segment in order. `source_streams`: streams of the caller that may reuse
  // the sources' memory; each waits until the copies have read them (see
  // Note [Sources the caller reuses]).
  void replay(std::span<const InputBinding> bindings = {}, std::span<CUstream_st* const> source_streams = {});
  void replay(std::initializer_list<InputBinding> bindings) { replay(std::span(bindings.begin(), bindings.size())); }
  // Runs one segment (pipeline schedules); segments share the pool, so run
  // them in an order that respects their data flow.
  void replay_segment(std::size_t index, std::span<const InputBinding> bindings = {},
                      std::span<CUstream_st* const> source_streams = {});

  // Runs the step once more with a timing mark around every op and returns
  // when each ran (graphs/step_profile.h). The run is a real step: its
  // effects (an optimizer update, a counter) happen as in a replay.
  StepProfile profile();

  // Frees the pool now; later replays and reads of pool outputs are Errors.
  // A shared pool (CaptureOptions::pool) is not freed: this step lets go of
  // it, and it goes with its last owner.
  void release_pool();
  // The pool the step runs in: its own, or the one it shares.
  const std::shared_ptr<PoolMemory>& pool() const { return pool_; }
  bool shares_pool() const { return options_.pool != nullptr; }

  GraphState state() const { return state_; }
  const std::vector<Tensor>& outputs() const { return outputs_; }
  const Program& program() const { return program_; }
  const StepPlan& plan() const { return plan_; }
  const PoolReport& report() const { return report_; }
  const CaptureTimings& timings() const { return timings_; }
  std::size_t segment_count() const { return plan_.segment_ranges.size(); }
  std::int64_t replay_count() const { return replays_; }
  // The pool's bytes: the plan's, or a shared pool's (held by this step until released).
  std::int64_t pool_bytes() const override { return pool_ != nullptr ? pool_->bytes() : plan_.pool_bytes; }
  const void* pool_identity() const override {
    return pool_ != nullptr ? static_cast<const void*>(pool_.get()) : static_cast<const void*>(this);
  }
  // The pool base the segments were recorded with: replays use it
  // unchanged, nothing is re-recorded.
  const void* recorded_pool_base() const { return recorded_pool_base_; }

  // How many segment recordings (cuda: stream captures) this process has
  // made, all steps together: replays add none.
  static std::int64_t total_recordings();

 private:
  CapturedStep(Context& ctx, const CaptureOptions& options) : ctx_(ctx), options_(options) {}
  // The stages of capture(), in order.
  TraceResult trace(const StepFunction& step);
  void plan_and_bind(TraceResult traced);
  void share_peer_windows(const std::vector<std::uint64_t>& groups);
  void record_and_instantiate();
  void check_state(GraphState expected, std::string_view action) const;
  void bind_inputs(std::span<const InputBinding> bindings, std::span<CUstream_st* const> source_streams);
  void run_segment(std::size_t index);

  Context& ctx_;
  CaptureOptions options_;
  GraphState state_ = GraphState::kInstantiated;
  Program program_;
  StepPlan plan_;
  PoolReport report_;
  CaptureTimings timings_;
  std::shared_ptr<PoolMemory> pool_;
  const void* recorded_pool_base_ = nullptr;
  std::vector<void*> addresses_;                                 // per value id
  std::vector<std::shared_ptr<detail::TensorImpl>> keep_alive_;  // persistent tensors the graphs read or write
  std::vector<Tensor> persistent_reads_;
  std::unordered_set<const detail::TensorImpl*> read_inputs_;  // what a replay binding may target
  std::vector<Tensor> persistent_writes_;
  std::vector<Tensor> outputs_;
  std::vector<BoundSchedule> segments_;                   // what each segment's recording points into
  std::vector<std::unique_ptr<Executable>> executables_;  // per segment
  std::vector<std::shared_ptr<PeerWindow>> peer_windows_;  // Note [The pool as symmetric memory]
  std::int64_t replays_ = 0;
};

}  // namespace stepgraph
