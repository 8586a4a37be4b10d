// Shape buckets, at the layer level: a batch of T tokens
// trains in the smallest bucket that holds it, padded with zero
// activations in a sequence of their own and labels of ignore_index. The
// padding then contributes exact zeros to every gradient (its loss
// gradient is zero, and so is everything the backward derives from it), so
// the losses and parameters equal those of a step of exactly T tokens: bit
// for bit on the host, where every sum runs in order; to rounding on the
// GPU, whose GEMMs split their sums by shape. Every bucket's step is
// captured into one shared pool (Note [Steps sharing one pool]), no larger
// than the largest bucket's plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "graphs/shared_pool_capture.h"
#include "optim/adamw.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "tests/layers/train_rig.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr std::int32_t kIgnore = -100;  // CrossEntropyParams::ignore_index, the step's default

void expect_padded_buckets_train_as_unpadded(Device device) {
  testing::SeededRng rng;
  Context ctx(device);
  const ResidualStackConfig config{.hidden = 64, .ffn = 128, .layers = 2, .vocab = 64, .dtype = DType::kFloat32,
                                   .seed = 17, .heads = 2};
  const std::vector<std::int64_t> buckets = {36, 72};  // each splits into 3 sequences at first
  const std::vector<std::int64_t> sizes = {40, 24, 72, 30, 56, 36, 48, 18};  // two equal sequences each

  // The model trained on exactly T tokens each step: one step per size, eager.
  ResidualStack exact_model(ctx, config);
  AdamW exact_optimizer(ctx, exact_model.parameters(), {.lr = 1e-2f});
  std::map<std::int64_t, std::unique_ptr<TrainStep>> exact;
  for (std::int64_t t : sizes) {
    if (!exact.count(t)) exact[t] = std::make_unique<TrainStep>(ctx, exact_model, exact_optimizer, t, nullptr,
                                                                DataParallelMode::kAllReduce, 2);
  }
  // The same model (same seed) on buckets: two real sequences and the padding's.
  ResidualStack bucket_model(ctx, config);
  AdamW bucket_optimizer(ctx, bucket_model.parameters(), {.lr = 1e-2f});
  std::vector<std::unique_ptr<TrainStep>> bucket_steps;
  std::vector<CapturedStep::StepFunction> functions;
  for (std::int64_t b : buckets) {
    bucket_steps.push_back(std::make_unique<TrainStep>(ctx, bucket_model, bucket_optimizer, b, nullptr,
                                                       DataParallelMode::kAllReduce, 3));
    functions.push_back([&ctx, step = bucket_steps.back().get()] { return (*step)(ctx); });
  }
  std::vector<std::int64_t> own_bytes;
  for (const auto& f : functions) own_bytes.push_back(CapturedStep::planned_pool_bytes(ctx, f));
  SharedPoolCapture captured =
      capture_sharing_one_pool(ctx, functions, {.pool_report_policy = PoolReportPolicy::kError});
  EXPECT_LE(captured.pool->bytes(), *std::max_element(own_bytes.begin(), own_bytes.end()));
  EXPECT_LT(captured.pool->bytes(), captured.separate_pool_bytes);

  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (std::size_t s = 0; s < sizes.size(); ++s) {
    const std::int64_t t = sizes[s];
    const std::size_t b = static_cast<std::size_t>(
        std::find_if(buckets.begin(), buckets.end(), [&](std::int64_t size) { return size >= t; }) - buckets.begin());
    const std::int64_t bucket = buckets[b];
    std::vector<float> x(static_cast<std::size_t>(bucket * config.hidden), 0.0f);  // the padding rows stay 0
    std::vector<std::int32_t> labels(static_cast<std::size_t>(bucket), kIgnore);
    for (std::int64_t i = 0; i < t * config.hidden; ++i) x[i] = uniform(rng);
    for (std::int64_t i = 0; i < t; ++i) labels[i] = static_cast<std::int32_t>(rng() % config.vocab);

    const TrainStep& unpadded = *exact.at(t);
    ctx.copy_from_host(unpadded.inputs(), x.data(), static_cast<std::size_t>(t * config.hidden) * sizeof(float));
    ctx.copy_from_host(unpadded.labels(), labels.data(), static_cast<std::size_t>(t) * sizeof(std::int32_t));
    const float expected = ctx.to_vector<float>(unpadded(ctx).at(0)).at(0);

    const TrainStep& padded = *bucket_steps[b];
    const std::vector<std::int32_t> packing = {0, static_cast<std::int32_t>(t / 2), static_cast<std::int32_t>(t),
                                               static_cast<std::int32_t>(bucket)};
    ctx.copy_from_host(padded.inputs(), x.data(), x.size() * sizeof(float));
    ctx.copy_from_host(padded.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
    ctx.copy_from_host(padded.packing(), packing.data(), packing.size() * sizeof(std::int32_t));
    captured.steps[b]->replay();
    const float loss = ctx.to_vector<float>(captured.steps[b]->outputs().at(0)).at(0);
    padded.check_errors(ctx);
    if (device == Device::kHost) {
      ASSERT_EQ(testing::bits(loss), testing::bits(expected)) << "step " << s << ": " << t << " tokens in the " << bucket
                                            << "-token bucket: " << loss << " against " << expected;
    } else {
      ASSERT_NEAR(loss, expected, 2e-4 * std::fabs(expected)) << "step " << s << ": " << t << " tokens";
    }
  }
  const std::vector<Parameter*> a = exact_model.parameters(), c = bucket_model.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::vector<float> want = ctx.to_vector<float>(a[i]->master), got = ctx.to_vector<float>(c[i]->master);
    if (device == Device::kHost) {
      ASSERT_EQ(got, want) << a[i]->name;
      continue;
    }
    // Per tensor, not per element: AdamW divides each update by the root of
    // its squared-gradient average, so an element whose gradient is near 0
    // moves by up to lr whichever way rounding tips it. On an H100
    // the elementwise check failed at seeds 765465878 and others, before
    // and after the fused residual; per tensor the largest difference seen
    // was 3.3e-4 of the tensor's norm (a 192-element bias). Padding that
    // leaked into the gradients would move every master by up to lr a step,
    // of the order of the tensor itself.
    double diff = 0.0, norm = 0.0;
    for (std::size_t k = 0; k < want.size(); ++k) {
      diff += (static_cast<double>(got[k]) - want[k]) * (static_cast<double>(got[k]) - want[k]);
      norm += static_cast<double>(want[k]) * want[k];
    }
    ASSERT_LE(std::sqrt(diff), 1e-3 * std::sqrt(norm) + 1e-6) << a[i]->name;
  }
}

TEST(BucketedStepTest, PaddedBucketsTrainAsUnpaddedStepsBitForBitOnTheHost) {
  expect_padded_buckets_train_as_unpadded(Device::kHost);
}

TEST(BucketedStepTest, PaddedBucketsTrainAsUnpaddedStepsOnTheGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_padded_buckets_train_as_unpadded(Device::kCuda);
}

}  // namespace
}  // namespace stepgraph
