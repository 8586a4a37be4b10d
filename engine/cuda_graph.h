// RAII owners of a CUDA graph (the recorded work) and of its executable
// instance (what is launched). Move-only; destructors never throw.
//
// Capturing work into a Graph lives in engine/stream_capture.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace stepgraph {

class Graph {
 public:
  Graph();                              // an empty graph (for explicit node building)
  explicit Graph(cudaGraph_t adopted);  // takes ownership
  ~Graph();
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&& other) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  cudaGraph_t get() const noexcept { return graph_; }
  std::size_t node_count() const;

 private:
  void reset() noexcept;
  cudaGraph_t graph_ = nullptr;
};

class GraphExec {
 public:
  // Instantiation builds the executable graph; no work is launched.
  explicit GraphExec(const Graph& graph);
  ~GraphExec();
  GraphExec(GraphExec&& other) noexcept;
  GraphExec& operator=(GraphExec&& other) noexcept;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;

  cudaGraphExec_t get() const noexcept { return exec_; }

  // Upload the graph's resources ahead of the first launch (optional).
  void upload(cudaStream_t stream) const;
  // One launch runs the whole graph on `stream`.
  void launch(cudaStream_t stream) const;

 private:
  void reset() noexcept;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace stepgraph
