#include "engine/cuda_graph.h"

#include <utility>

#include "engine/cuda_check.h"
#include "engine/logging.h"

namespace stepgraph {

Graph::Graph() { SG_CUDA_CHECK(cudaGraphCreate(&graph_, 0)); }

Graph::Graph(cudaGraph_t adopted) : graph_(adopted) {
  SG_CHECK_CODE(adopted != nullptr, ErrorCode::kInternal, "Graph cannot adopt a null cudaGraph_t");
}

Graph::~Graph() { reset(); }

Graph::Graph(Graph&& other) noexcept : graph_(std::exchange(other.graph_, nullptr)) {}

Graph& Graph::operator=(Graph&& other) noexcept {
  if (this != &other) {
    reset();
    graph_ = std::exchange(other.graph_, nullptr);
  }
  return *this;
}

std::size_t Graph::node_count() const {
  std::size_t count = 0;
  SG_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &count));
  return count;
}

void Graph::reset() noexcept {
  if (graph_ == nullptr) return;
  if (const cudaError_t status = cudaGraphDestroy(graph_); status != cudaSuccess) {
    logger().error("cudaGraphDestroy failed: {}", cudaGetErrorString(status));
  }
  graph_ = nullptr;
}

GraphExec::GraphExec(const Graph& graph) {
  SG_CHECK_CODE(graph.get() != nullptr, ErrorCode::kInvalidState, "cannot instantiate a moved-from Graph");
  // Each kernel node runs at the priority of the stream it was captured from,
  // not of the stream the graph is launched into (Note [Stream priorities]).
  SG_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph.get(), cudaGraphInstantiateFlagUseNodePriority));
}

GraphExec::~GraphExec() { reset(); }

GraphExec::GraphExec(GraphExec&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}

GraphExec& GraphExec::operator=(GraphExec&& other) noexcept {
  if (this != &other) {
    reset();
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

void GraphExec::upload(cudaStream_t stream) const {
  SG_CHECK_CODE(exec_ != nullptr, ErrorCode::kInvalidState, "cannot upload a moved-from GraphExec");
  SG_CUDA_CHECK(cudaGraphUpload(exec_, stream));
}

void GraphExec::launch(cudaStream_t stream) const {
  SG_CHECK_CODE(exec_ != nullptr, ErrorCode::kInvalidState, "cannot launch a moved-from GraphExec");
  SG_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
}

void GraphExec::reset() noexcept {
  if (exec_ == nullptr) return;
  if (const cudaError_t status = cudaGraphExecDestroy(exec_); status != cudaSuccess) {
    logger().error("cudaGraphExecDestroy failed: {}", cudaGetErrorString(status));
  }
  exec_ = nullptr;
}

}  // namespace stepgraph
