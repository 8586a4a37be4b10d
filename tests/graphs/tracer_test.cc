// Tracer::finish with outputs that no op of the step made: a persistent
// tensor returned unchanged (read by an op or not), alone or beside traced
// values, and the captured step that replays them, on the host.
#include "graphs/tracer.h"

#include <gtest/gtest.h>

#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "ops/elementwise_ops.h"

namespace stepgraph {
namespace {

std::vector<float> read(Context& ctx, const Tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  ctx.copy_to_host(t, out.data(), out.size() * sizeof(float));
  return out;
}

void write(Context& ctx, const Tensor& t, const std::vector<float>& values) {
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
}

TEST(TracerTest, AnUnreadPersistentOutputIsAValueWithItsTensor) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", {Shape{4}, DType::kFloat32});
  Tracer tracer(ctx);
  const std::vector<Tensor> outputs{x};
  const TraceResult traced = tracer.finish(outputs);
  ASSERT_EQ(traced.outputs.size(), 1u);
  ASSERT_EQ(traced.impls.size(), traced.program.values().size());
  const ValueId id = traced.outputs[0];
  EXPECT_EQ(traced.program.value(id).kind, ValueKind::kPersistent);
  EXPECT_EQ(traced.impls[id], x.impl());
  EXPECT_TRUE(traced.held.empty());
}

TEST(TracerTest, AnUnreadPersistentBesideTracedOutputs) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", {Shape{4}, DType::kFloat32});
  const Tensor w = ctx.persistent("w", x.meta());  // read by no op
  Tracer tracer(ctx);
  const Tensor y = ops::add(ctx, x, x);
  const std::vector<Tensor> outputs{y, w, x};
  const TraceResult traced = tracer.finish(outputs);
  ASSERT_EQ(traced.outputs.size(), 3u);
  ASSERT_EQ(traced.impls.size(), traced.program.values().size());
  EXPECT_EQ(traced.impls[traced.outputs[1]], w.impl());
  EXPECT_EQ(traced.impls[traced.outputs[2]], x.impl());
  EXPECT_TRUE(traced.program.value(traced.outputs[0]).live_out);
}

TEST(TracerTest, AStepReturningItsInputUnchangedCapturesAndReplays) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", {Shape{3}, DType::kFloat32});
  write(ctx, x, {1, 2, 3});
  auto step = CapturedStep::capture(ctx, [&] { return std::vector<Tensor>{x}; },
                                    {.pool_report_policy = PoolReportPolicy::kError});
  step->replay();
  ASSERT_EQ(step->outputs().size(), 1u);
  EXPECT_EQ(read(ctx, step->outputs()[0]), (std::vector<float>{1, 2, 3}));
  write(ctx, x, {4, 5, 6});
  step->replay();
  EXPECT_EQ(read(ctx, step->outputs()[0]), (std::vector<float>{4, 5, 6}));
}

TEST(TracerTest, AStepReturningAnUnreadParameterBesideItsResult) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", {Shape{2}, DType::kFloat32});
  const Tensor w = ctx.persistent("w", x.meta());
  write(ctx, x, {1, 2});
  write(ctx, w, {7, 8});
  auto step = CapturedStep::capture(ctx,
                                    [&] {
                                      return std::vector<Tensor>{ops::add(ctx, x, x), w};
                                    },
                                    {.pool_report_policy = PoolReportPolicy::kError});
  step->replay();
  ASSERT_EQ(step->outputs().size(), 2u);
  EXPECT_EQ(read(ctx, step->outputs()[0]), (std::vector<float>{2, 4}));
  EXPECT_EQ(read(ctx, step->outputs()[1]), (std::vector<float>{7, 8}));
}

}  // namespace
}  // namespace stepgraph
