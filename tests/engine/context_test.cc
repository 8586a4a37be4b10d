// Eager execution on the host context, and the Context's errors. Ops here are
// the simple elementwise ones; their kernels are tested in tests/kernels.
#include "engine/context.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/error.h"
#include "ops/elementwise_ops.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TensorMeta f32(std::int64_t n) { return {Shape{n}, DType::kFloat32}; }

Tensor from(Context& ctx, const std::string& name, const std::vector<float>& values) {
  Tensor t = ctx.persistent(name, f32(static_cast<std::int64_t>(values.size())));
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

TEST(ContextHostTest, EagerOpsComputeNow) {
  Context ctx(Device::kHost);
  const Tensor a = from(ctx, "a", {1, 2, 3});
  const Tensor b = from(ctx, "b", {10, 20, 30});
  EXPECT_EQ(ctx.to_vector<float>(ops::add(ctx, a, b)), (std::vector<float>{11, 22, 33}));
  EXPECT_EQ(ctx.to_vector<float>(ops::mul(ctx, a, b)), (std::vector<float>{10, 40, 90}));
  EXPECT_EQ(ctx.to_vector<float>(ops::axpy(ctx, a, b, 0.5f)), (std::vector<float>{6, 12, 18}));
  EXPECT_EQ(ctx.to_vector<float>(ops::copy(ctx, b)), (std::vector<float>{10, 20, 30}));
  EXPECT_EQ(ctx.to_vector<float>(ops::fill(ctx, f32(2), 1.5f)), (std::vector<float>{1.5f, 1.5f}));
  EXPECT_EQ(ops::item(ctx, ops::sum(ctx, b)), 60.0f);
  ops::axpy_(ctx, a, b, 1.0f);
  EXPECT_EQ(ctx.to_vector<float>(a), (std::vector<float>{11, 22, 33}));
  ops::copy_(ctx, a, b);
  EXPECT_EQ(ctx.to_vector<float>(a), (std::vector<float>{10, 20, 30}));
}

TEST(ContextHostTest, PersistentTensorsAreZeroFilledAndNamed) {
  Context ctx(Device::kHost);
  const Tensor t = ctx.persistent("weights", f32(5));
  EXPECT_EQ(ctx.to_vector<float>(t), std::vector<float>(5, 0.0f));
  EXPECT_EQ(t.name(), "weights");
  EXPECT_TRUE(t.is_persistent());
  EXPECT_ERROR_CONTAINS(ctx.persistent("", f32(1)), "a persistent tensor needs a name");
}

TEST(ContextHostTest, EagerMemoryIsCountedAndReturned) {
  Context ctx(Device::kHost);
  const Tensor a = from(ctx, "a", std::vector<float>(256, 1.0f));
  {
    const Tensor b = ops::add(ctx, a, a);
    const Tensor c = ops::add(ctx, b, a);
    EXPECT_EQ(ctx.memory_stats().eager_bytes, 2 * 1024);
  }
  EXPECT_EQ(ctx.memory_stats().eager_bytes, 0);
  EXPECT_EQ(ctx.memory_stats().eager_peak_bytes, 2 * 1024);
  EXPECT_EQ(ctx.memory_stats().persistent_bytes, 1024);
}

TEST(ContextHostTest, ShapeMismatchNamesTheOpAndBothShapes) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", f32(3));
  const Tensor b = ctx.persistent("b", {Shape{3, 1}, DType::kFloat32});
  try {
    ops::add(ctx, a, b);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(error.message(),
              "op add: b has shape [3, 1] but a has shape [3]; elementwise inputs must "
              "have equal shapes");
  }
}

TEST(ContextHostTest, UnsupportedDtypeIsAnError) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", {Shape{3}, DType::kBFloat16});
  try {
    ops::mul(ctx, a, a);
    FAIL();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
    EXPECT_NE(error.message().find("op mul: a is bf16"), std::string::npos) << error.message();
  }
}

TEST(ContextHostTest, TensorFromAnotherContextIsAnError) {
  Context first(Device::kHost);
  Context second(Device::kHost);
  const Tensor mine = first.persistent("mine", f32(2));
  const Tensor theirs = second.persistent("theirs", f32(2));
  try {
    ops::add(first, mine, theirs);
    FAIL();
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("op add: tensor 'theirs' belongs to context"), std::string::npos) << error.message();
  }
}

TEST(ContextHostTest, UndefinedTensorsAndBadStreamsAreErrors) {
  Context ctx(Device::kHost, /*side_streams=*/1);
  const Tensor a = ctx.persistent("a", f32(2));
  EXPECT_ERROR_CONTAINS(ops::add(ctx, a, Tensor()), "op add", "undefined");
  EXPECT_ERROR_CONTAINS(StreamScope(ctx, 2), "StreamScope: stream 2 does not exist", "streams 0..1");
  {
    StreamScope side(ctx, 1);
    EXPECT_EQ(ctx.current_stream(), 1);
  }
  EXPECT_EQ(ctx.current_stream(), 0);
  EXPECT_ERROR_CONTAINS(Context(Device::kHost, 9), "side_streams must be in [0, 8], got 9");
  EXPECT_ERROR_CONTAINS(Context(Device::kHost, -1), "side_streams must be in [0, 8], got -1");
}

TEST(ContextHostTest, HostCopiesCheckSizes) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", f32(4));
  float buffer[3] = {};
  EXPECT_ERROR_CONTAINS(ctx.copy_from_host(a, buffer, sizeof(buffer)), "copy_from_host: tensor 'a'", "holds 16 bytes, got 12");
  EXPECT_ERROR_CONTAINS(ctx.copy_to_host(a, buffer, sizeof(buffer)), "copy_to_host: tensor 'a' holds 16 bytes, got a buffer of 12");
}

}  // namespace
}  // namespace stepgraph
