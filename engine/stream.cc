#include "engine/stream.h"

#include <utility>

#include "engine/cuda_check.h"
#include "engine/logging.h"

namespace stepgraph {

Stream::Stream(Priority priority) {
  int least = 0;
  int greatest = 0;
  SG_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  // Greater priority is a lower number: least = 0, greatest = -5 on the H100.
  const int value = priority == Priority::kHigh  ? greatest
                    : priority == Priority::kLow ? least
                                                 : (least + greatest) / 2;
  SG_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, value));
}

Stream::~Stream() { reset(); }

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void Stream::synchronize() const { SG_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

int Stream::priority() const {
  int value = 0;
  SG_CUDA_CHECK(cudaStreamGetPriority(stream_, &value));
  return value;
}

void Stream::reset() noexcept {
  if (stream_ == nullptr) return;
  if (const cudaError_t status = cudaStreamDestroy(stream_); status != cudaSuccess) {
    logger().error("cudaStreamDestroy failed: {}", cudaGetErrorString(status));
  }
  stream_ = nullptr;
}

Event::Event(Timing timing) {
  const unsigned flags = timing == Timing::kEnabled ? cudaEventDefault : cudaEventDisableTiming;
  SG_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags));
}

Event::~Event() { reset(); }

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    reset();
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void Event::record(cudaStream_t stream) { SG_CUDA_CHECK(cudaEventRecord(event_, stream)); }

void Event::wait_on(cudaStream_t stream) const { SG_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }

void Event::synchronize() const { SG_CUDA_CHECK(cudaEventSynchronize(event_)); }

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0.0f;
  SG_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

void Event::reset() noexcept {
  if (event_ == nullptr) return;
  if (const cudaError_t status = cudaEventDestroy(event_); status != cudaSuccess) {
    logger().error("cudaEventDestroy failed: {}", cudaGetErrorString(status));
  }
  event_ = nullptr;
}

}  // namespace stepgraph
