#include "engine/host_backend.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "engine/error.h"

namespace stepgraph {
namespace {

void* aligned_host_allocation(std::int64_t bytes, std::string_view what) {
  const auto rounded = static_cast<std::size_t>(align_allocation(bytes));
  void* address = std::aligned_alloc(static_cast<std::size_t>(kAllocationAlignment), rounded);
  SG_CHECK_CODE(address != nullptr, ErrorCode::kOutOfMemory, "host allocation of ", bytes, " bytes for ", what,
                " failed");
  return address;
}

void run_host_reference(const OpDef& op, const OpParams& params, const KernelArgs& args) {
  SG_CHECK_CODE(op.run_host != nullptr, ErrorCode::kUnsupported, "op ", op.name, " has no host reference");
  op.run_host(params, args);
}

class HostPoolMemory final : public PoolMemory {
 public:
  explicit HostPoolMemory(std::int64_t bytes) : bytes_(bytes) {
    const std::int64_t rounded = std::max(align_allocation(bytes), kAllocationAlignment);
    base_ = aligned_host_allocation(rounded, "a graph pool");
    std::memset(base_, 0, static_cast<std::size_t>(rounded));
  }
  ~HostPoolMemory() override { release(); }
  void* base() const override { return base_; }
  std::int64_t bytes() const override { return bytes_; }
  void release() override {
    std::free(base_);
    base_ = nullptr;
  }

 private:
  void* base_ = nullptr;
  std::int64_t bytes_;
};

// Runs `schedule`'s ops in order (records and waits order nothing on one
// thread), skipping a conditional body whose flag is not zero (Note
// [Conditional bodies] in engine/backend.h); `on_run(entry, ran)` around
// each kRun entry, skipped ones included.
template <typename OnRun>
void run_in_order(std::span<const LaunchEntry> schedule, OnRun&& on_run) {
  bool skipping = false;
  for (const LaunchEntry& entry : schedule) {
    switch (entry.kind) {
      case LaunchEntry::Kind::kIfZeroBegin:
        skipping = *static_cast<const std::int32_t*>(entry.condition) != 0;
        break;
      case LaunchEntry::Kind::kIfEnd: skipping = false; break;
      case LaunchEntry::Kind::kRun: on_run(entry, !skipping); break;
      case LaunchEntry::Kind::kRecord:
      case LaunchEntry::Kind::kWait: break;
    }
  }
}

// A recorded schedule is the schedule itself, run in order at each launch.
class HostRecording final : public Recording, public Executable {
 public:
  explicit HostRecording(std::span<const LaunchEntry> schedule) : schedule_(schedule.begin(), schedule.end()) {}
  void launch() override {
    run_in_order(schedule_, [](const LaunchEntry& entry, bool run) {
      if (run) run_host_reference(*entry.op, *entry.params, entry.args);
    });
  }

 private:
  std::vector<LaunchEntry> schedule_;
};

class HostBackend final : public Backend {
 public:
  explicit HostBackend(int stream_count) : stream_count_(stream_count) {}

  Device device() const override { return Device::kHost; }
  int stream_count() const override { return stream_count_; }
  std::size_t library_scratch_bytes(const std::function<std::size_t()>& device_need) const override {
    (void)device_need;
    return 0;
  }
  void check_fp8_supported() const override {}

  void* allocate(std::int64_t bytes, MemoryKind kind, int /*stream*/) override {
    if (bytes == 0) return nullptr;
    void* address =
        aligned_host_allocation(bytes, kind == MemoryKind::kPersistent ? "a persistent tensor" : "a tensor");
    // Eager outputs are written by their op; persistent tensors start at zero.
    if (kind == MemoryKind::kPersistent) std::memset(address, 0, static_cast<std::size_t>(align_allocation(bytes)));
    return address;
  }
  void free(void* address, MemoryKind /*kind*/, int /*stream*/) noexcept override { std::free(address); }
  std::shared_ptr<PoolMemory> allocate_pool(std::int64_t bytes) override {
    return std::make_shared<HostPoolMemory>(bytes);
  }
  void check_wrappable(std::string_view /*name*/, const void* /*address*/) const override {}

  void copy_from_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_within(void* dst, const void* src, std::size_t bytes, int /*stream*/) override {
    std::memcpy(dst, src, bytes);
  }

  void wait(std::span<const StreamWait> /*waits*/) override {}
  void order_external_after(int /*stream*/, CUstream_st* /*external*/) override {}
  void run(const OpDef& op, const OpParams& params, const KernelArgs& args, int /*stream*/) override {
    run_host_reference(op, params, args);
  }
  void prepare(std::span<const LaunchEntry> /*schedule*/) override {}
  std::unique_ptr<Recording> record(std::span<const LaunchEntry> schedule, int /*event_count*/) override {
    return std::make_unique<HostRecording>(schedule);
  }
  std::unique_ptr<Executable> instantiate(const Recording& recording) override {
    return std::make_unique<HostRecording>(dynamic_cast<const HostRecording&>(recording));
  }
  std::vector<OpTiming> profile(std::span<const LaunchEntry> schedule, int /*event_count*/) override {
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    auto us_since_start = [&] { return std::chrono::duration<double, std::micro>(Clock::now() - start).count(); };
    std::vector<OpTiming> out;
    run_in_order(schedule, [&](const LaunchEntry& entry, bool run) {
      OpTiming timing{us_since_start(), 0};
      if (run) run_host_reference(*entry.op, *entry.params, entry.args);
      timing.end_us = us_since_start();
      out.push_back(timing);
    });
    return out;
  }
  void synchronize() override {}

  CUstream_st* native_stream(int /*index*/) const override {
    SG_THROW(ErrorCode::kInvalidState, "a host context has no CUDA streams; create the Context with Device::kCuda");
  }

 private:
  int stream_count_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(int stream_count) { return std::make_unique<HostBackend>(stream_count); }

}  // namespace stepgraph
