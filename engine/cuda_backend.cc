#include "engine/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <optional>
#include <vector>

#include "engine/cuda_allocator.h"
#include "engine/cuda_check.h"
#include "engine/cuda_graph.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/fp8.h"
#include "engine/graph_conditional.h"
#include "engine/logging.h"
#include "engine/stream.h"
#include "engine/stream_capture.h"

namespace stepgraph {
namespace {

class CudaPoolMemory final : public PoolMemory {
 public:
  explicit CudaPoolMemory(std::int64_t bytes) : bytes_(bytes) {
    if (bytes > 0) SG_CUDA_CHECK(cudaMalloc(&base_, static_cast<std::size_t>(bytes)));
  }
  ~CudaPoolMemory() override { release(); }
  void* base() const override { return base_; }
  std::int64_t bytes() const override { return bytes_; }
  void release() override {
    if (base_ == nullptr) return;
    // cudaFree waits for the device, so no replay still reads the pool.
    if (const cudaError_t status = cudaFree(base_); status != cudaSuccess) {
      logger().error("cudaFree of a graph pool failed: {}", cudaGetErrorString(status));
    }
    base_ = nullptr;
  }

 private:
  void* base_ = nullptr;
  std::int64_t bytes_;
};

void launch_op(const LaunchEntry& entry, cudaStream_t stream) {
  SG_CHECK_CODE(entry.op->launch_cuda != nullptr, ErrorCode::kUnsupported, "op ", entry.op->name,
                " has no CUDA launcher");
  entry.op->launch_cuda(*entry.params, entry.args, stream);
}

// Issues a schedule's entries on the streams under stream capture: the event
// records and waits become the graph's edges, and a conditional body the
// body of an IF node, captured on `body_stream` (Note [Conditional bodies]).
void record_schedule(std::span<const LaunchEntry> schedule, const std::vector<Stream>& streams,
                     const std::vector<Event>& events, cudaStream_t body_stream) {
  std::optional<IfZeroBody> body;
  for (const LaunchEntry& entry : schedule) {
    const cudaStream_t stream = streams[entry.stream].get();
    SG_CHECK_CODE(!body || entry.kind == LaunchEntry::Kind::kRun || entry.kind == LaunchEntry::Kind::kIfEnd,
                  ErrorCode::kInternal, "an event or a nested body inside a conditional body");
    switch (entry.kind) {
      case LaunchEntry::Kind::kRecord: SG_CUDA_CHECK(cudaEventRecord(events[entry.event].get(), stream)); break;
      case LaunchEntry::Kind::kWait: SG_CUDA_CHECK(cudaStreamWaitEvent(stream, events[entry.event].get(), 0)); break;
      case LaunchEntry::Kind::kRun: launch_op(entry, body ? body_stream : stream); break;
      case LaunchEntry::Kind::kIfZeroBegin: body.emplace(stream, entry.condition, body_stream); break;
      case LaunchEntry::Kind::kIfEnd:
        body->end();
        body.reset();
        break;
    }
  }
}

struct CudaRecording final : Recording {
  explicit CudaRecording(Graph recorded) : graph(std::move(recorded)) {}
  Graph graph;
};

class CudaExecutable final : public Executable {
 public:
  CudaExecutable(const Graph& graph, cudaStream_t stream) : exec_(graph), stream_(stream) { exec_.upload(stream_); }
  void launch() override { exec_.launch(stream_); }

 private:
  GraphExec exec_;
  cudaStream_t stream_;
};

// Note [Stream priorities]
// Stream 1 is by convention where weight gradients and the optimizer run
// (layers/weight_grad_scope.h): nothing in the step waits for that work
// before the step's end, while stream 0 carries the chain of data gradients
// every later op waits for. On equal priorities the block scheduler
// dispatches whichever kernel came first, so a weight-gradient GEMM or an
// AdamW kernel that fills every SM held a small critical-path kernel back
// for its whole length: in one H100 profile of the moe config an
// unpermute backward that runs in 66 us alone took 3.0 ms beside a group's
// AdamW, and large's norm backward 1.3 ms beside a weight-gradient GEMM.
// So stream 1 is the lowest priority, stream 0 above it, and the streams
// from 2 on (communication, whose kernels must progress for the other ranks)
// the highest. Graphs keep them: captured kernel nodes carry their stream's
// priority, and GraphExec instantiates with cudaGraphInstantiateFlagUseNodePriority.
Stream::Priority stream_priority(int index) {
  if (index == 0) return Stream::Priority::kNormal;
  return index == 1 ? Stream::Priority::kLow : Stream::Priority::kHigh;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int stream_count) : allocator_(current_device()) {
    for (int i = 0; i < stream_count; ++i) {
      streams_.emplace_back(stream_priority(i));
      signals_.emplace_back();
    }
  }

  Device device() const override { return Device::kCuda; }
  int stream_count() const override { return static_cast<int>(streams_.size()); }
  std::size_t library_scratch_bytes(const std::function<std::size_t()>& device_need) const override {
    return device_need();
  }
  void check_fp8_supported() const override {
    cudaDeviceProp properties{};
    SG_CUDA_CHECK(cudaGetDeviceProperties(&properties, current_device()));
    check_fp8_device(properties.major, properties.minor, properties.name);
  }

  void* allocate(std::int64_t bytes, MemoryKind kind, int stream) override {
    if (bytes == 0) return nullptr;
    if (kind == MemoryKind::kEager) return allocator_.allocate(bytes, this->stream(stream));
    void* address = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&address, static_cast<std::size_t>(bytes)));
    // Zero-filled on stream 0 (the caller records that write): a plain
    // cudaMemset runs on the legacy stream, which our non-blocking streams do
    // not wait for.
    SG_CUDA_CHECK(cudaMemsetAsync(address, 0, static_cast<std::size_t>(bytes), this->stream(0)));
    return address;
  }
  void free(void* address, MemoryKind kind, int stream) noexcept override {
    if (kind == MemoryKind::kEager) {
      allocator_.free(address, streams_[stream].get());
    } else if (const cudaError_t status = cudaFree(address); status != cudaSuccess) {  // waits for every use
      logger().error("cudaFree of a persistent tensor failed: {}", cudaGetErrorString(status));
    }
  }
  std::shared_ptr<PoolMemory> allocate_pool(std::int64_t bytes) override {
    return std::make_shared<CudaPoolMemory>(bytes);
  }
  void check_wrappable(std::string_view name, const void* address) const override {
    cudaPointerAttributes attributes{};
    SG_CUDA_CHECK(cudaPointerGetAttributes(&attributes, address));
    SG_CHECK(attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged, "wrap '", name,
             "': the address is not device memory; a cuda context wraps device (or managed) memory only");
  }

  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    SG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream(0)));
    SG_CUDA_CHECK(cudaStreamSynchronize(stream(0)));  // `src` may go away after we return
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    SG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream(0)));
    SG_CUDA_CHECK(cudaStreamSynchronize(stream(0)));
  }
  void copy_within(void* dst, const void* src, std::size_t bytes, int stream) override {
    SG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, this->stream(stream)));
  }

  // Records on the signal stream now (covering at least the token asked for)
  // and makes the waiter wait on it.
  void wait(std::span<const StreamWait> waits) override {
    for (const StreamWait& wait : waits) {
      signals_[wait.signal].record(stream(wait.signal));
      signals_[wait.signal].wait_on(stream(wait.waiter));
    }
  }
  void order_external_after(int stream, CUstream_st* external) override {
    signals_[stream].record(this->stream(stream));
    signals_[stream].wait_on(external);
  }
  void run(const OpDef& op, const OpParams& params, const KernelArgs& args, int stream) override {
    SG_CHECK_CODE(op.launch_cuda != nullptr, ErrorCode::kUnsupported, "op ", op.name, " has no CUDA launcher");
    op.launch_cuda(params, args, this->stream(stream));
  }

  void prepare(std::span<const LaunchEntry> schedule) override {
    for (const LaunchEntry& entry : schedule) {
      if (entry.kind == LaunchEntry::Kind::kRun && entry.op->prepare_cuda != nullptr) {
        entry.op->prepare_cuda(*entry.params, entry.args.input_metas);
      }
    }
  }
  std::unique_ptr<Recording> record(std::span<const LaunchEntry> schedule, int event_count) override {
    const std::vector<Event> events(static_cast<std::size_t>(event_count));
    StreamCapture capture(stream(0));
    record_schedule(schedule, streams_, events, body_stream_.get());
    return std::make_unique<CudaRecording>(capture.end());
  }
  // The schedule runs once on the streams, not captured: CUDA cannot time
  // events recorded inside a graph (cudaEventElapsedTime refuses them, seen
  // on the H100). The streams still run concurrently as in a replay; between
  // small ops the host's launch rate may show as gaps a replay does not have.
  std::vector<OpTiming> profile(std::span<const LaunchEntry> schedule, int event_count) override {
    const std::vector<Event> events(static_cast<std::size_t>(event_count));
    std::vector<Event> marks;  // [0]: the start; then before and after each op
    marks.emplace_back(Event::Timing::kEnabled);
    for (const LaunchEntry& entry : schedule) {
      if (entry.kind != LaunchEntry::Kind::kRun) continue;
      marks.emplace_back(Event::Timing::kEnabled);
      marks.emplace_back(Event::Timing::kEnabled);
    }
    marks[0].record(stream(0));  // every other stream forks from stream 0 after this
    std::size_t next = 1;
    bool skipping = false;  // inside a conditional body whose flag is set
    for (const LaunchEntry& entry : schedule) {
      const cudaStream_t s = stream(entry.stream);
      switch (entry.kind) {
        case LaunchEntry::Kind::kRecord: SG_CUDA_CHECK(cudaEventRecord(events[entry.event].get(), s)); break;
        case LaunchEntry::Kind::kWait: SG_CUDA_CHECK(cudaStreamWaitEvent(s, events[entry.event].get(), 0)); break;
        case LaunchEntry::Kind::kIfZeroBegin: {
          // Not a replay: read the flag here (every stream joined stream 0 before it).
          std::int32_t flag = 0;
          copy_to_host(&flag, entry.condition, sizeof(flag));
          skipping = flag != 0;
          break;
        }
        case LaunchEntry::Kind::kIfEnd: skipping = false; break;
        case LaunchEntry::Kind::kRun:
          marks[next++].record(s);
          if (!skipping) launch_op(entry, s);
          marks[next++].record(s);
          break;
      }
    }
    synchronize();
    std::vector<OpTiming> out;
    for (std::size_t i = 1; i + 1 < marks.size(); i += 2) {
      out.push_back(
          {1000.0 * Event::elapsed_ms(marks[0], marks[i]), 1000.0 * Event::elapsed_ms(marks[0], marks[i + 1])});
    }
    return out;
  }
  std::unique_ptr<Executable> instantiate(const Recording& recording) override {
    return std::make_unique<CudaExecutable>(dynamic_cast<const CudaRecording&>(recording).graph, stream(0));
  }
  void synchronize() override {
    for (const Stream& s : streams_) s.synchronize();
  }

  CUstream_st* native_stream(int index) const override { return stream(index); }

 private:
  static int current_device() {
    int device = 0;
    SG_CUDA_CHECK(cudaGetDevice(&device));
    return device;
  }
  cudaStream_t stream(int index) const { return streams_.at(static_cast<std::size_t>(index)).get(); }

  // The allocator goes last: its destructor needs idle streams (the context
  // synchronises before its backend goes).
  CudaCachingAllocator allocator_;
  std::vector<Stream> streams_;
  Stream body_stream_;  // where a conditional body is captured (never runs work itself)
  std::vector<Event> signals_;  // one per stream, re-recorded for each wait
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int stream_count) {
  const DeviceCount found = cuda_device_count();
  SG_CHECK_CODE(found.count > 0, ErrorCode::kNoDevice, found.no_device_reason,
                "; a cuda context needs a GPU: create the context on the host (Device::kHost, \"host\") instead");
  return std::make_unique<CudaBackend>(stream_count);
}

}  // namespace stepgraph
