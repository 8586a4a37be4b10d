// Eager execution on a CUDA context: two streams ordered by the data each op
// reads and writes, the caching allocator, and agreement with the host.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "ops/elementwise_ops.h"
#include "tests/support/gpu.h"
#include "tests/support/two_stream_step.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using testing::f32;
using testing::make_two_stream_state;
using testing::two_stream_step;

float relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0;
  double norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return static_cast<float>(std::sqrt(diff / std::max(norm, 1e-30)));
}

// The same 24-op two-stream step, 20 times eager on cuda and on the host:
// equal up to fp32 rounding (the device fuses multiply-adds). A missing wait
// between the streams would read unwritten or stale data and diverge.
TEST(ContextCudaTest, TwoStreamEagerStepMatchesTheHost) {
  SG_SKIP_WITHOUT_GPU();
  Context gpu(Device::kCuda, 1);
  Context cpu(Device::kHost, 1);
  const TensorMeta meta = f32(513, 257);
  const auto gpu_state = make_two_stream_state(gpu, meta, 11, "");
  const auto cpu_state = make_two_stream_state(cpu, meta, 11, "");
  for (int step = 0; step < 20; ++step) {
    const std::vector<Tensor> on_gpu = two_stream_step(gpu, gpu_state);
    const std::vector<Tensor> on_cpu = two_stream_step(cpu, cpu_state);
    EXPECT_LT(relative_difference(gpu.to_vector<float>(on_gpu[1]), cpu.to_vector<float>(on_cpu[1])), 1e-5) << step;
    EXPECT_LT(relative_difference(gpu.to_vector<float>(on_gpu[0]), cpu.to_vector<float>(on_cpu[0])), 1e-5) << step;
  }
  EXPECT_LT(relative_difference(gpu.to_vector<float>(gpu_state.acc), cpu.to_vector<float>(cpu_state.acc)), 1e-5);
}

TEST(ContextCudaTest, EagerMemoryReturnsToTheCachingAllocator) {
  SG_SKIP_WITHOUT_GPU();
  Context ctx(Device::kCuda, 1);
  const Tensor x = ctx.persistent("x", f32(1024, 1024));
  for (int i = 0; i < 10; ++i) {
    const Tensor y = ops::mul(ctx, x, x);
    StreamScope side(ctx, 1);
    const Tensor z = ops::add(ctx, y, x);  // allocated on the side stream, freed stream-ordered
  }
  ctx.synchronize();
  const MemoryStats stats = ctx.memory_stats();
  EXPECT_EQ(stats.eager_bytes, 0);
  EXPECT_EQ(stats.eager_peak_bytes, 2 * 4 * 1024 * 1024);
  EXPECT_EQ(stats.persistent_bytes, 4 * 1024 * 1024);
}

TEST(ContextCudaTest, CopiesRoundTripAndCheckSizes) {
  SG_SKIP_WITHOUT_GPU();
  Context ctx(Device::kCuda);
  const Tensor t = ctx.persistent("t", f32(3, 5));
  std::vector<float> values(15);
  for (int i = 0; i < 15; ++i) values[i] = 0.5f * static_cast<float>(i) - 3.0f;
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  EXPECT_EQ(ctx.to_vector<float>(t), values);
  EXPECT_EQ(ops::item(ctx, ops::sum(ctx, t)), 7.5f);  // 0.5 * (0 + ... + 14) - 15 * 3
  EXPECT_ERROR_CONTAINS(ctx.copy_from_host(t, values.data(), 4), "copy_from_host: tensor 't'", "holds 60 bytes, got 4");
}

}  // namespace
}  // namespace stepgraph
