// Context: where ops run. One backend (cuda or host, chosen once: see Note
// [One backend per context] in backend.h) with a main stream and side
// streams and an allocator for eager work, and, while a step is being traced,
// the recorder that turns op calls into Program instructions.
//
// An op is called the same way in every mode (see Context::call):
//   eager on cuda  launch now on the current stream; outputs from a stream-
//                  ordered caching allocator (cudaMallocAsync on a pool that
//                  keeps its memory);
//   eager on host  run the host reference now;
//   tracing        record an instruction; nothing runs, no memory is touched.
// Streams: StreamScope selects the stream ops go to. Waits between streams
// are inserted from the data each op reads and writes (StreamOrder), in eager
// execution as in planned programs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/algorithm_choice.h"
#include "engine/backend.h"
#include "engine/op.h"
#include "engine/tensor.h"

namespace stepgraph {

// Receives op calls while a step is traced (implemented by graphs/tracer).
class OpRecorder {
 public:
  virtual ~OpRecorder() = default;
  virtual std::vector<Tensor> record(const OpDef& op, const OpParams& params, std::span<const Tensor> inputs,
                                     std::vector<TensorMeta> output_metas, int stream) = 0;
  virtual void begin_segment(std::string name) = 0;
  virtual std::uint64_t trace_id() const = 0;
  // Context::run_if_zero while tracing: the ops between the two calls form
  // a conditional body that runs only where `flag` is zero at replay.
  virtual void begin_if_zero(const Tensor& flag) = 0;
  virtual void end_if_zero() = 0;
};

struct MemoryStats {
  std::int64_t eager_bytes = 0;       // eager tensors alive now
  std::int64_t eager_peak_bytes = 0;  // the most alive at once
  std::int64_t persistent_bytes = 0;
};

class Context {
 public:
  // side_streams: how many streams besides the main one ops may use.
  explicit Context(Device device, int side_streams = 1);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  Device device() const;
  std::uint64_t id() const;
  int stream_count() const;    // 1 + side streams
  int current_stream() const;  // where ops go now (StreamScope changes it)

  // A zero-filled tensor at a fixed address for the context's life.
  Tensor persistent(std::string name, const TensorMeta& meta);
  // A persistent tensor over memory the caller owns: device memory on cuda,
  // host memory on host, contiguous and row-major. StepGraph never frees it;
  // the caller keeps it alive for as long as any handle or captured step uses it.
  Tensor wrap(std::string name, const TensorMeta& meta, void* address);

  // Copies between host memory and a tensor, ordered after the work that
  // writes or reads the tensor. copy_to_host is an Error while tracing (a
  // device-to-host read cannot be captured: return the tensor as an output
  // of the step and read it after replay).
  void copy_from_host(const Tensor& dst, const void* src, std::size_t bytes);
  void copy_to_host(const Tensor& src, void* dst, std::size_t bytes);
  template <typename T>
  std::vector<T> to_vector(const Tensor& src) {
    std::vector<T> out(static_cast<std::size_t>(src.numel()));
    copy_to_host(src, out.data(), out.size() * sizeof(T));
    return out;
  }

  // Waits for all work on every stream (no-op on host and while tracing).
  void synchronize();

  // Runs or records one op call (the ops' entry point; see the file comment).
  std::vector<Tensor> call(const OpDef& op, OpParams params, std::vector<Tensor> inputs);

  // Starts a named segment of the traced step (its own graph sharing the
  // step's pool). Nothing happens in eager execution.
  void begin_segment(std::string name);

  // Runs the ops `body` calls only where `flag` (int32 [1]) is zero. Eager:
  // reads the flag on the host (a synchronisation) and calls body or not.
  // Traced: body is recorded as a conditional body (Note [Conditional
  // bodies] in engine/backend.h) that each replay runs or skips on the
  // device, reading nothing on the host. Its ops run on the main stream; it
  // may not call collectives or another run_if_zero, and values it makes
  // may not be read after it (where it was skipped they hold nothing):
  // those are Errors at trace time.
  void run_if_zero(const Tensor& flag, const std::function<void()>& body);

  // Where collective ops run (eager and traced), whatever the current
  // stream: a side stream, so communication overlaps compute and the
  // planner's events order it; -1 (the default): the current stream.
  void set_communication_stream(int index);
  int communication_stream() const;

  bool tracing() const;
  MemoryStats memory_stats() const;

  // How the GEMMs this context calls from now on pick their cuBLASLt
  // algorithm (Note [Deterministic algorithm choice]); kHeuristic by default.
  // Each GEMM op records the choice, so it is part of a traced step; set it
  // before tracing (an Error while tracing).
  void set_algorithm_choice(AlgorithmChoice choice);
  AlgorithmChoice algorithm_choice() const;

  // The CUDA stream behind stream `index` (an Error on a host context): for
  // callers that launch their own work, ordered by synchronize().
  CUstream_st* cuda_stream(int index) const;

  // For the engine's graph code.
  Backend& backend() const;
  OpRecorder* recorder() const;
  void set_recorder(OpRecorder* recorder);  // null ends tracing
  // Orders stream 0 after all work touching `persistent` values (before a graph
  // launch), or records that stream 0 just accessed them (after it).
  void order_main_stream_before(std::span<const Tensor> reads, std::span<const Tensor> writes);
  void mark_main_stream_access(std::span<const Tensor> reads, std::span<const Tensor> writes);
  const std::shared_ptr<detail::ContextState>& state() const { return state_; }

 private:
  friend class StreamScope;
  std::shared_ptr<detail::ContextState> state_;
};

// Sends the ops called in its scope to stream `index` of the context.
class StreamScope {
 public:
  StreamScope(Context& context, int index);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Context& context_;
  int previous_;
};

}  // namespace stepgraph
