// Steps planned into one shared pool (Note [Steps sharing one pool] in
// graphs/captured_step.h; what shape buckets need): the pool is the
// largest step's plan, not the sum; every step replayed in any order equals
// eager; releasing one step leaves the others running; the memory goes with
// the last owner; a pool too small for a step is an Error.
#include "graphs/shared_pool_capture.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "graphs/graph_cache.h"
#include "graphs/graph_key.h"
#include "ops/elementwise_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kCols = 96;

// One bucket: its static input of `rows` rows and the step over it
// (a few pool values whose bytes grow with the rows, and a scalar output).
struct Bucket {
  Bucket(Context& ctx, std::int64_t rows_, std::uint32_t seed) : rows(rows_) {
    x = ctx.persistent("x" + std::to_string(rows), {Shape{rows, kCols}, DType::kFloat32});
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> values(static_cast<std::size_t>(rows * kCols));
    for (float& v : values) v = uniform(rng);
    ctx.copy_from_host(x, values.data(), values.size() * sizeof(float));
  }
  std::vector<Tensor> step(Context& ctx) const {
    const Tensor squared = ops::mul(ctx, x, x);
    const Tensor shifted = ops::add(ctx, squared, x);
    const Tensor product = ops::mul(ctx, shifted, squared);
    return {ops::sum(ctx, product).set_name("loss")};
  }
  std::int64_t rows;
  Tensor x;
};

std::uint32_t bits(float value) {
  std::uint32_t out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

void expect_buckets_share_one_pool(Device device) {
  testing::SeededRng rng;
  Context ctx(device);
  std::vector<Bucket> buckets;
  for (std::int64_t rows : {64, 256, 128}) buckets.emplace_back(ctx, rows, rng() % 100000);
  std::vector<CapturedStep::StepFunction> steps;
  std::vector<std::int64_t> own_bytes;
  for (const Bucket& b : buckets) {
    steps.push_back([&ctx, &b] { return b.step(ctx); });
    own_bytes.push_back(CapturedStep::planned_pool_bytes(ctx, steps.back()));
  }
  SharedPoolCapture captured =
      capture_sharing_one_pool(ctx, steps, {.pool_report_policy = PoolReportPolicy::kError});

  // The pool is the largest plan, every step fits it, and one pool each would take the sum.
  const std::int64_t largest = *std::max_element(own_bytes.begin(), own_bytes.end());
  EXPECT_EQ(captured.pool->bytes(), largest);
  EXPECT_EQ(captured.separate_pool_bytes, own_bytes[0] + own_bytes[1] + own_bytes[2]);
  EXPECT_LT(captured.pool->bytes(), captured.separate_pool_bytes);
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    EXPECT_EQ(captured.steps[i]->pool(), captured.pool);
    EXPECT_TRUE(captured.steps[i]->shares_pool());
    EXPECT_EQ(captured.steps[i]->plan().pool_bytes, own_bytes[i]);
    EXPECT_LE(captured.steps[i]->plan().pool_bytes, captured.pool->bytes());
  }

  // Replays in a random order, each against the same step run eagerly; an
  // input changes between replays.
  for (int r = 0; r < 30; ++r) {
    const std::size_t i = rng() % buckets.size();
    if (r % 7 == 3) {
      const Tensor changed = ops::axpy(ctx, buckets[i].x, buckets[i].x, -0.25f);
      ops::copy_(ctx, buckets[i].x, changed);
    }
    const float eager = ctx.to_vector<float>(buckets[i].step(ctx).at(0)).at(0);
    captured.steps[i]->replay();
    const float graphed = ctx.to_vector<float>(captured.steps[i]->outputs().at(0)).at(0);
    ASSERT_EQ(bits(graphed), bits(eager)) << "replay " << r << " of bucket " << buckets[i].rows << " rows: "
                                          << graphed << " against eager " << eager;
  }

  // One step let go: the others still run in the pool, which is not freed.
  std::weak_ptr<PoolMemory> pool = captured.pool;
  captured.steps[1]->release_pool();
  EXPECT_FALSE(captured.pool->released());
  EXPECT_ERROR_CONTAINS(captured.steps[1]->replay(), "released");
  const float eager = ctx.to_vector<float>(buckets[0].step(ctx).at(0)).at(0);
  captured.steps[0]->replay();
  EXPECT_EQ(bits(ctx.to_vector<float>(captured.steps[0]->outputs().at(0)).at(0)), bits(eager));
  // The memory goes with its last owner: the steps, their pool outputs and the handle.
  ctx.synchronize();
  captured = {};
  EXPECT_TRUE(pool.expired());
}

TEST(SharedPoolCaptureTest, BucketsShareTheLargestPoolAndEachReplaysAsEagerOnTheHost) {
  expect_buckets_share_one_pool(Device::kHost);
}

TEST(SharedPoolCaptureTest, BucketsShareTheLargestPoolAndEachReplaysAsEagerOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_buckets_share_one_pool(Device::kCuda);
}

// A GraphCache holding the buckets' steps under keys that carry the bucket
// counts their shared pool once (CachedGraph::pool_identity).
TEST(SharedPoolCaptureTest, AGraphCacheKeyedByBucketCountsTheSharedPoolOnce) {
  Context ctx(Device::kHost);
  std::vector<Bucket> buckets;
  for (std::int64_t rows : {32, 128}) buckets.emplace_back(ctx, rows, static_cast<std::uint32_t>(rows));
  std::vector<CapturedStep::StepFunction> steps;
  for (const Bucket& b : buckets) steps.push_back([&ctx, &b] { return b.step(ctx); });
  SharedPoolCapture captured = capture_sharing_one_pool(ctx, steps);
  auto key = [](const Bucket& b) { return GraphKey().add("step", "bucketed").add("bucket", b.rows); };
  GraphCache cache(std::int64_t{1} << 30);
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const auto step = captured.steps[i];
    EXPECT_EQ(cache.get_or_capture<CapturedStep>(key(buckets[i]), [&] { return step; }), step);
  }
  EXPECT_EQ(cache.stats().entries, 2);
  EXPECT_EQ(cache.stats().pool_bytes, captured.pool->bytes());  // once, not twice
  EXPECT_EQ(cache.find(key(buckets[0])), captured.steps[0]);
  cache.erase(key(buckets[1]));
  EXPECT_EQ(cache.stats().pool_bytes, captured.pool->bytes());  // the other entry still holds it
  cache.erase(key(buckets[0]));
  EXPECT_EQ(cache.stats().pool_bytes, 0);
}

TEST(SharedPoolCaptureTest, APoolTooSmallForTheStepIsAClearError) {
  Context ctx(Device::kHost);
  Bucket small(ctx, 16, 1), large(ctx, 512, 2);
  auto small_step = CapturedStep::capture(ctx, [&] { return small.step(ctx); });
  CaptureOptions options;
  options.pool = small_step->pool();
  EXPECT_ERROR_CONTAINS(CapturedStep::capture(ctx, [&] { return large.step(ctx); }, options), "shared pool holds",
                        "size it by the largest step");
  EXPECT_ERROR_CONTAINS(capture_sharing_one_pool(ctx, {}), "no steps");
}

}  // namespace
}  // namespace stepgraph
