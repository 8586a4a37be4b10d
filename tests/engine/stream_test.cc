#include "engine/stream.h"

#include <gtest/gtest.h>

#include <utility>

#include "engine/cuda_graph.h"
#include "engine/error.h"
#include "tests/support/gpu.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TEST(StreamTest, CreatesSynchronizesAndMoves) {
  SG_SKIP_WITHOUT_GPU();
  Stream first;
  ASSERT_NE(first.get(), nullptr);
  first.synchronize();
  const cudaStream_t raw = first.get();
  Stream second(std::move(first));
  EXPECT_EQ(second.get(), raw);
  EXPECT_EQ(first.get(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  Stream third(Stream::Priority::kHigh);
  third = std::move(second);
  EXPECT_EQ(third.get(), raw);
  unsigned flags = 0;
  ASSERT_EQ(cudaStreamGetFlags(third.get(), &flags), cudaSuccess);
  EXPECT_EQ(flags & cudaStreamNonBlocking, static_cast<unsigned>(cudaStreamNonBlocking));
}

TEST(EventTest, RecordsWaitsAndTimes) {
  SG_SKIP_WITHOUT_GPU();
  Stream a;
  Stream b;
  Event start(Event::Timing::kEnabled);
  Event stop(Event::Timing::kEnabled);
  start.record(a.get());
  stop.record(a.get());
  stop.wait_on(b.get());
  b.synchronize();
  stop.synchronize();
  EXPECT_GE(Event::elapsed_ms(start, stop), 0.0f);
  Event moved(std::move(stop));
  EXPECT_NE(moved.get(), nullptr);
  EXPECT_EQ(stop.get(), nullptr);  // NOLINT(bugprone-use-after-move)
}

TEST(EventTest, ElapsedTimeOfUntimedEventsIsAnError) {
  SG_SKIP_WITHOUT_GPU();
  Stream s;
  Event start;
  Event stop;
  start.record(s.get());
  stop.record(s.get());
  s.synchronize();
  try {
    Event::elapsed_ms(start, stop);
    FAIL() << "timing untimed events succeeded";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kCuda);
    EXPECT_NE(error.message().find("cudaEventElapsedTime"), std::string::npos) << error.message();
  }
}

TEST(GraphTest, EmptyGraphInstantiatesAndLaunches) {
  SG_SKIP_WITHOUT_GPU();
  Stream s;
  Graph graph;
  EXPECT_EQ(graph.node_count(), 0u);
  GraphExec exec(graph);
  exec.upload(s.get());
  exec.launch(s.get());
  s.synchronize();
  GraphExec moved(std::move(exec));
  EXPECT_ERROR_CONTAINS(exec.launch(s.get()), "cannot launch a moved-from GraphExec");  // NOLINT(bugprone-use-after-move)
}

}  // namespace
}  // namespace stepgraph
