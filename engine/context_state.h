// ContextState: what tensors need after the Context object itself is gone.
// Tensors hold it, so memory goes back to a backend that still exists.
// Internal to the engine's context target.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "engine/backend.h"
#include "engine/context.h"
#include "engine/stream_order.h"

namespace stepgraph::detail {

struct ContextState {
  ContextState(Device device, int side_streams);
  ~ContextState();

  // Performs the waits an access on `stream` needs, then the caller issues it.
  void order_before(int stream, std::span<const std::int64_t> reads, std::span<const std::int64_t> writes);
  // Memory for a fresh tensor (counted in the memory stats).
  void* allocate(std::int64_t bytes, MemoryKind kind, int stream);
  // A persistent or eager tensor's last handle went (never throws).
  void release(const TensorImpl& impl) noexcept;
  void check_owned(const Tensor& tensor, std::string_view op) const;

  std::unique_ptr<Backend> backend;
  std::uint64_t id;
  int stream_count;
  int current_stream = 0;
  int communication_stream = -1;  // where collectives run; -1: the current stream
  StreamOrder order;
  std::int64_t next_order_id = 0;
  OpRecorder* recorder = nullptr;
  AlgorithmChoice algorithm_choice = AlgorithmChoice::kHeuristic;
  MemoryStats stats;
};

}  // namespace stepgraph::detail
