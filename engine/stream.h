// RAII owners of CUDA streams and events. Move-only; destructors never throw
// (a failing cudaStreamDestroy/cudaEventDestroy is logged, not raised).
#pragma once

#include <cuda_runtime_api.h>

namespace stepgraph {

class Stream {
 public:
  // Where the device's priority range allows three levels (the H100's is
  // [0, -5]): kLow its least, kHigh its greatest, kNormal between. Blocks of
  // a higher-priority stream are dispatched first when SMs free up (Note
  // [Stream priorities] in engine/cuda_backend.cc).
  enum class Priority { kLow, kNormal, kHigh };

  // A non-blocking stream (it does not synchronise with the legacy default
  // stream), so it can be captured into a CUDA graph.
  explicit Stream(Priority priority = Priority::kNormal);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const noexcept { return stream_; }
  void synchronize() const;
  int priority() const;  // CUDA's number (lower is higher priority)

 private:
  void reset() noexcept;
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  enum class Timing { kDisabled, kEnabled };

  // Timing is off by default: such events are cheaper and are what graph
  // fork/join edges need.
  explicit Event(Timing timing = Timing::kDisabled);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const noexcept { return event_; }

  // Record on `stream`; later work that waits on this event waits for all
  // work submitted to `stream` before the record.
  void record(cudaStream_t stream);
  // Make `stream` wait (on the device) until this event has completed.
  void wait_on(cudaStream_t stream) const;
  void synchronize() const;

  // Milliseconds between two completed, timing-enabled events.
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  void reset() noexcept;
  cudaEvent_t event_ = nullptr;
};

}  // namespace stepgraph
