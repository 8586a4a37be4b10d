// Backend: everything that depends on where ops run, behind one interface.
//
// Note [One backend per context]
// A Context picks its backend once, from its Device (make_backend), and
// never asks again: memory, copies, waits between streams, running an op now,
// and recording a planned schedule into something replayed with one launch
// all go through this interface. The CUDA backend (cuda_backend.h) is the one
// place where CUDA runtime calls of the engine and the graph path live
// (streams, the caching allocator, stream capture, graph instantiation); the
// host backend runs the host references on host memory, so every path of the
// engine, tracing and replay included, runs on machines without a GPU. Code
// above this floor has no `if (device == ...)`: it calls the backend.
// CUDA-free header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "engine/device_kind.h"
#include "engine/memory.h"
#include "engine/op.h"
#include "engine/stream_order.h"

namespace stepgraph {

// Where an allocation's memory comes from.
enum class MemoryKind : std::uint8_t {
  kPersistent,  // fixed for the context's life, zero-filled (on stream 0)
  kEager,       // stream-ordered: usable on its stream at once, reused after free
};

// One entry of a schedule to record: run an op on bound addresses, record
// or wait on an event (the plan's edges between streams), or open or close
// a conditional body (Note [Conditional bodies]).
struct LaunchEntry {
  enum class Kind : std::uint8_t { kRun, kRecord, kWait, kIfZeroBegin, kIfEnd };
  Kind kind = Kind::kRun;
  int stream = 0;
  int event = -1;                    // kRecord / kWait
  const OpDef* op = nullptr;         // kRun
  const OpParams* params = nullptr;  // kRun
  KernelArgs args;                   // kRun; the arrays outlive the recording
  const void* condition = nullptr;   // kIfZeroBegin: an int32 the device (host) reads at each launch
};

// Note [Conditional bodies]
// The entries between a kIfZeroBegin and its kIfEnd run, at each launch of
// the recording, only where the int32 at `condition` is zero then; nothing
// is read on the host. On cuda they become the body of a CUDA conditional
// (IF) node, whose condition a one-thread kernel sets from `condition` right
// before it; on host the launch reads `condition` itself. A body sits on
// stream 0 only, holds no event records or waits (the planner joins every
// side stream before it and records what later waits need after it), no
// collectives (NCCL #1986: graphs with collectives inside conditional nodes
// failed to instantiate) and no other body. Profiling (not a replay) reads
// the condition on the host, synchronising.

// A recorded schedule, launched as a whole on stream 0: a CUDA graph on cuda,
// the host references in order on host. Launches never re-record.
class Executable {
 public:
  virtual ~Executable() = default;
  virtual void launch() = 0;
};

// When one op of a profiled schedule ran, in microseconds from the start of
// the schedule (Backend::profile).
struct OpTiming {
  double start_us = 0;
  double end_us = 0;
};

// A schedule recorded but not yet instantiated (the stages are explicit:
// record every segment, then instantiate them, before the first launch).
class Recording {
 public:
  virtual ~Recording() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  virtual int stream_count() const = 0;
  // Throws Error (kUnsupported) where this backend's device cannot run FP8
  // (a GPU before Hopper: check_fp8_device in fp8.h). The host runs FP8's
  // references everywhere.
  virtual void check_fp8_supported() const = 0;
  // Bytes of device scratch a library call needs (a GEMM's cuBLASLt
  // workspace): a GPU backend asks `device_need`; the host backend runs host
  // references, which need none, and returns 0 without asking.
  virtual std::size_t library_scratch_bytes(const std::function<std::size_t()>& device_need) const = 0;

  // Memory of `bytes` (0 gives null), 256-byte aligned (Note [256-byte alignment]).
  virtual void* allocate(std::int64_t bytes, MemoryKind kind, int stream) = 0;
  // Returns memory from allocate(). Eager memory is freed in order on `stream`
  // (the caller has made `stream` wait for every access). Never throws.
  virtual void free(void* address, MemoryKind kind, int stream) noexcept = 0;
  // One static pool for a captured step.
  virtual std::shared_ptr<PoolMemory> allocate_pool(std::int64_t bytes) = 0;
  // An Error naming `name` if the caller's memory at `address` cannot be used
  // by this backend (Context::wrap of host memory on cuda).
  virtual void check_wrappable(std::string_view name, const void* address) const = 0;

  // Copies on stream 0, after the waits the caller performed. Both return once
  // the host side may be reused (the source read, or the destination filled).
  virtual void copy_from_host(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, std::size_t bytes) = 0;
  // Stream-ordered copy between two allocations of this backend.
  virtual void copy_within(void* dst, const void* src, std::size_t bytes, int stream) = 0;

  // Makes each waiter stream wait for its signal stream's work so far.
  virtual void wait(std::span<const StreamWait> waits) = 0;
  // Makes `external`, a stream the backend does not own (a framework's, e.g.
  // torch's current stream; null is the legacy default stream), wait for the
  // work issued on `stream` so far. Nothing to do on host.
  virtual void order_external_after(int stream, CUstream_st* external) = 0;
  // Runs one op now on `stream` (an Error if the op has no implementation here).
  virtual void run(const OpDef& op, const OpParams& params, const KernelArgs& args, int stream) = 0;
  // Work a schedule needs before it can be recorded (cuda: library handles
  // and algorithm choice, which are not allowed under stream capture).
  virtual void prepare(std::span<const LaunchEntry> schedule) = 0;
  // Records a prepared schedule (nothing runs on cuda: see Note [Capturing by
  // stream capture] in graphs/captured_step.h); `event_count` events are
  // numbered from 0 and never cross recordings.
  virtual std::unique_ptr<Recording> record(std::span<const LaunchEntry> schedule, int event_count) = 0;
  // Builds the executable of a recording (no work is launched).
  virtual std::unique_ptr<Executable> instantiate(const Recording& recording) = 0;
  // Runs a prepared schedule once with a timing mark before and after each
  // op and returns each kRun entry's interval, in schedule order: on cuda
  // the schedule issued on the streams with timing events (not captured: CUDA
  // cannot time events recorded in a graph), so the streams overlap as in a
  // replay; on host the references in order, timed by the host clock. For
  // the step profile (graphs/step_profile.h); the step's executables are
  // untouched.
  virtual std::vector<OpTiming> profile(std::span<const LaunchEntry> schedule, int event_count) = 0;
  // Waits for all work on every stream.
  virtual void synchronize() = 0;

  // The CUDA stream behind stream `index` (an Error on host).
  virtual CUstream_st* native_stream(int index) const = 0;
};

// The backend of `device` with `stream_count` streams (main + side streams).
std::unique_ptr<Backend> make_backend(Device device, int stream_count);

}  // namespace stepgraph
