// pack / unpack_: tensors end to end into one flat tensor, a zero tail, and
// back; eager on the host and inside a captured step.
#include "ops/bucket_ops.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "graphs/captured_step.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TEST(BucketOpsTest, PackThenUnpackRoundTripsWithAZeroTail) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", {Shape{2, 3}, DType::kFloat32});
  const Tensor b = ctx.persistent("b", {Shape{5}, DType::kFloat32});
  const std::vector<float> a_values = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b_values = {7, 8, 9, 10, 11};
  ctx.copy_from_host(a, a_values.data(), 24);
  ctx.copy_from_host(b, b_values.data(), 20);
  const Tensor flat = ops::pack(ctx, {a, b}, 16);
  EXPECT_EQ(flat.shape(), Shape{16});
  EXPECT_EQ(ctx.to_vector<float>(flat), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0}));
  const Tensor c = ctx.persistent("c", {Shape{6}, DType::kFloat32});
  const Tensor d = ctx.persistent("d", {Shape{5}, DType::kFloat32});
  ops::unpack_(ctx, flat, {c, d});
  EXPECT_EQ(ctx.to_vector<float>(c), a_values);
  EXPECT_EQ(ctx.to_vector<float>(d), b_values);
}

TEST(BucketOpsTest, CapturedPackAndUnpackEqualEager) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", {Shape{3}, DType::kInt32});
  const Tensor out = ctx.persistent("out", {Shape{3}, DType::kInt32});
  const std::vector<std::int32_t> values = {-1, 7, 9};
  ctx.copy_from_host(a, values.data(), 12);
  auto step = CapturedStep::capture(ctx, [&] {
    ops::unpack_(ctx, ops::pack(ctx, {a}, 4), {out});
    return std::vector<Tensor>{};
  });
  step->replay();
  EXPECT_EQ(ctx.to_vector<std::int32_t>(out), values);
}

TEST(BucketOpsTest, BadBucketsAreClearErrors) {
  Context ctx(Device::kHost);
  const Tensor a = ctx.persistent("a", {Shape{4}, DType::kFloat32});
  const Tensor h = ctx.persistent("h", {Shape{4}, DType::kBFloat16});
  EXPECT_ERROR_CONTAINS(ops::pack(ctx, {a}, 3), "padded length 3 is shorter than the 4 elements");
  EXPECT_ERROR_CONTAINS(ops::pack(ctx, {a, h}, 8), "tensor 1 is bf16 but tensor 0 is fp32");
  EXPECT_ERROR_CONTAINS(ops::pack(ctx, {}, 8), "needs at least one tensor");
  EXPECT_ERROR_CONTAINS(ops::unpack_(ctx, a, {a, a}), "holds 4 elements, its targets 8");
}

}  // namespace
}  // namespace stepgraph
