#include "engine/stream_capture.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "kernels/elementwise.h"
#include "tests/support/gpu.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

// Owns a device buffer of floats for the test.
class DeviceFloats {
 public:
  explicit DeviceFloats(std::int64_t n) : n_(n) { SG_CUDA_CHECK(cudaMalloc(&data_, n * sizeof(float))); }
  ~DeviceFloats() { cudaFree(data_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  float* get() const { return data_; }
  // cudaMemcpy from pageable memory may return before its DMA lands, and the
  // test's non-blocking streams do not wait for the legacy stream.
  void upload(const std::vector<float>& host) {
    SG_CUDA_CHECK(cudaMemcpy(data_, host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice));
    SG_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<float> download() const {
    std::vector<float> host(n_);
    SG_CUDA_CHECK(cudaMemcpy(host.data(), data_, n_ * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  std::int64_t n_;
  float* data_ = nullptr;
};

// `to` waits (on the device) for the work enqueued on `from` so far:
// `event` recorded on `from`, waited for by `to` (a fork or a join).
void hand_over(Event& event, cudaStream_t from, cudaStream_t to) {
  event.record(from);
  event.wait_on(to);
}

TEST(StreamCaptureTest, LegacyDefaultStreamIsRefusedWithTheFix) {
  // Checked before any CUDA call, so it runs without a GPU too.
  try {
    StreamCapture capture(nullptr);
    FAIL() << "captured the legacy default stream";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find("graph capture needs a non-default stream"), std::string::npos) << error.message();
  }
  EXPECT_ERROR_CONTAINS(StreamCapture capture(cudaStreamLegacy), "graph capture needs a non-default stream");
}

// The smoke test of the foundation: two kernels on two streams, an event
// fork/join, captured into one graph, replayed 100 times, checked exactly.
//
// Each replay:  main: fork ─┬─ main: y0 += 3x ────────────┬─ join ─ main: z += y1
//                           └─ side: y1 += 2x ── record ──┘
// After k replays y0 = 3kx, y1 = 2kx and z = (2 + 4 + ... + 2k)x = k(k+1)x.
// With x = i mod 13 every value is an integer below 2^24, so fp32 is exact,
// and z is right only if the join made main wait for the side stream.
TEST(StreamCaptureTest, ForkJoinOnTwoStreamsReplayedHundredTimesIsExact) {
  SG_SKIP_WITHOUT_GPU();
  constexpr std::int64_t kN = 100003;  // not a multiple of any block size
  constexpr int kReplays = 100;
  DeviceFloats x(kN), y0(kN), y1(kN), z(kN);
  std::vector<float> host_x(kN);
  for (std::int64_t i = 0; i < kN; ++i) host_x[i] = static_cast<float>(i % 13);
  x.upload(host_x);

  Stream main_stream;
  Stream side_stream;
  for (DeviceFloats* buffer : {&y0, &y1, &z}) kernels::launch_fill_f32(buffer->get(), 0.0f, kN, main_stream.get());
  main_stream.synchronize();

  Event fork;
  Event join;
  StreamCapture capture(main_stream.get());
  hand_over(fork, main_stream.get(), side_stream.get());
  kernels::launch_axpy_f32(y0.get(), x.get(), 3.0f, kN, main_stream.get());
  kernels::launch_axpy_f32(y1.get(), x.get(), 2.0f, kN, side_stream.get());
  hand_over(join, side_stream.get(), main_stream.get());
  kernels::launch_axpy_f32(z.get(), y1.get(), 1.0f, kN, main_stream.get());
  Graph graph = capture.end();
  EXPECT_EQ(graph.node_count(), 3u);  // three kernels; fork/join became edges

  GraphExec exec(graph);
  for (int replay = 0; replay < kReplays; ++replay) exec.launch(main_stream.get());
  main_stream.synchronize();

  const std::vector<float> got_y0 = y0.download();
  const std::vector<float> got_y1 = y1.download();
  const std::vector<float> got_z = z.download();
  std::int64_t mismatches = 0;
  for (std::int64_t i = 0; i < kN; ++i) {
    const float xi = host_x[i];
    mismatches += got_y0[i] != 3.0f * kReplays * xi;
    mismatches += got_y1[i] != 2.0f * kReplays * xi;
    mismatches += got_z[i] != static_cast<float>(kReplays) * (kReplays + 1) * xi;
  }
  EXPECT_EQ(mismatches, 0) << "e.g. z[12] = " << got_z[12] << ", expected " << kReplays * (kReplays + 1) * 12;
}

TEST(StreamCaptureTest, UnjoinedSideStreamIsAClearError) {
  SG_SKIP_WITHOUT_GPU();
  constexpr std::int64_t kN = 1024;
  DeviceFloats y(kN);
  Stream main_stream;
  Stream side_stream;
  Event fork;
  StreamCapture capture(main_stream.get());
  hand_over(fork, main_stream.get(), side_stream.get());
  kernels::launch_fill_f32(y.get(), 1.0f, kN, side_stream.get());
  try {
    capture.end();
    FAIL() << "an unjoined capture ended cleanly";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidState);
    EXPECT_NE(error.message().find("not joined back"), std::string::npos) << error.message();
  }
  EXPECT_ERROR_CONTAINS(capture.end(), "StreamCapture::end() called twice");  // once only
  // The failed capture's error is not left behind for the next launch to report as its own.
  kernels::launch_fill_f32(y.get(), 2.0f, kN, main_stream.get());
  main_stream.synchronize();
  EXPECT_EQ(y.download()[0], 2.0f);
}

// Note [Stream priorities]: a kernel captured from a stream keeps that
// stream's priority in its graph node, which GraphExec runs by
// (cudaGraphInstantiateFlagUseNodePriority); without it every node would run
// at the priority of the stream the graph is launched into.
TEST(StreamCaptureTest, CapturedKernelsKeepTheirStreamsPriorities) {
  SG_SKIP_WITHOUT_GPU();
  constexpr std::int64_t kN = 1024;
  DeviceFloats a(kN), b(kN);
  Stream main_stream(Stream::Priority::kNormal);
  Stream low_stream(Stream::Priority::kLow);
  ASSERT_NE(main_stream.priority(), low_stream.priority()) << "the device offers one stream priority only";
  Event fork;
  Event join;
  StreamCapture capture(main_stream.get());
  hand_over(fork, main_stream.get(), low_stream.get());
  kernels::launch_fill_f32(a.get(), 1.0f, kN, main_stream.get());
  kernels::launch_fill_f32(b.get(), 2.0f, kN, low_stream.get());
  hand_over(join, low_stream.get(), main_stream.get());
  Graph graph = capture.end();

  std::size_t count = graph.node_count();
  std::vector<cudaGraphNode_t> nodes(count);
  SG_CUDA_CHECK(cudaGraphGetNodes(graph.get(), nodes.data(), &count));
  std::vector<int> priorities;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    SG_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    cudaLaunchAttributeValue value{};
    SG_CUDA_CHECK(cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributePriority, &value));
    priorities.push_back(value.priority);
  }
  std::sort(priorities.begin(), priorities.end());
  const std::vector<int> expected = {std::min(main_stream.priority(), low_stream.priority()),
                                     std::max(main_stream.priority(), low_stream.priority())};
  EXPECT_EQ(priorities, expected);

  GraphExec exec(graph);  // instantiated with the nodes' priorities; runs as before
  exec.launch(main_stream.get());
  main_stream.synchronize();
  EXPECT_EQ(a.download()[kN - 1], 1.0f);
  EXPECT_EQ(b.download()[kN - 1], 2.0f);
}

}  // namespace
}  // namespace stepgraph
