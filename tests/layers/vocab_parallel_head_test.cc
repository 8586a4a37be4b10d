// VocabParallelHead and ops::vocab_parallel_cross_entropy on host thread
// worlds of 1, 2 and 4 ranks, against one rank's Linear (no bias) and
// ops::cross_entropy on the same global tokens: the same loss on every rank,
// each rank's logits and dlogits columns, its dx rows and its weight-gradient
// rows; ignored tokens; an out-of-range label sets the flag on every rank;
// eager equals graph bit for bit on every rank; errors. On the GPU, one rank
// through real NCCL, captured and replayed, equals the plain head and the
// fused cross-entropy bit for bit.
//
// Tolerance: each logit is the same dot product as one rank's (bit for bit).
// The sum of exponentials is split across the ranks (each rank's partial sum
// rounded to fp32, rescaled to the global max, summed by the all-reduce)
// where the one-rank host reference keeps one double sum: the loss and each
// softmax move by a few fp32 roundings (about 2e-7 relative; even with one
// rank, since the all-reduced sum is fp32). dx sums dlogits W over the
// vocabulary in N partial GEMMs and a reduce-scatter instead of one GEMM,
// the same terms in another fp32 order. We allow 1e-5 of the largest
// reference value of each tensor (and 1e-6 relative on the loss); a missing
// rescale, a target logit lost or counted twice, or a wrong slice is off by
// 1e-2 or more.
#include "layers/vocab_parallel_head.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/linear.h"
#include "ops/loss_ops.h"
#include "ops/parallel_loss_ops.h"
#include "tests/layers/one_rank_parity.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/layers/shard_values.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::normal_values;
using testing::rows;
using testing::columns;

constexpr std::int64_t kTokens = 16;
constexpr std::int64_t kHidden = 8;
constexpr std::int64_t kVocab = 32;
constexpr std::int64_t kIgnore = -100;
constexpr std::uint32_t kSeed = 33;
const ops::CrossEntropyParams kParams{.ignore_index = kIgnore, .loss_scale = 2.0f};

// Labels in [0, kVocab), tokens 3 and 10 ignored.
std::vector<std::int32_t> random_labels(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> label(0, kVocab - 1);
  std::vector<std::int32_t> out(kTokens);
  for (std::int32_t& l : out) l = label(rng);
  out[3] = out[10] = kIgnore;
  return out;
}

Tensor floats_of(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t rows_) {
  const Tensor t = ctx.persistent(name, {Shape{rows_, static_cast<std::int64_t>(values.size()) / rows_},
                                         DType::kFloat32});
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

Tensor labels_of(Context& ctx, const std::vector<std::int32_t>& labels) {
  const Tensor t = ctx.persistent("labels", {Shape{static_cast<std::int64_t>(labels.size())}, DType::kInt32});
  ctx.copy_from_host(t, labels.data(), labels.size() * sizeof(std::int32_t));
  return t;
}

// What one forward, loss and backward gives.
struct Result {
  float loss = NAN;
  std::vector<float> logits, dlogits, dx, weight_grad;
  std::int32_t flag = 0;
};

Result reference(const std::vector<float>& x_all, const std::vector<std::int32_t>& labels_all) {
  Context ctx(Device::kHost);
  Linear head(ctx, "head", {.in_features = kHidden, .out_features = kVocab, .bias = false, .dtype = DType::kFloat32},
              kSeed);
  const Tensor x = floats_of(ctx, "x", x_all, kTokens);
  const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
  const Linear::Forward f = head.forward(ctx, {x});
  const ops::CrossEntropyResult ce = ops::cross_entropy(ctx, f.y, labels_of(ctx, labels_all), flag, kParams);
  const Tensor dx = head.backward(ctx, f.saved, {ce.dlogits});
  return {ctx.to_vector<float>(ce.loss).at(0), ctx.to_vector<float>(f.y),       ctx.to_vector<float>(ce.dlogits),
          ctx.to_vector<float>(dx),            ctx.to_vector<float>(head.weight().grad), 0};
}

// One rank's forward, loss and backward (eager).
Result run(Context& ctx, const VocabParallelHead& head, const Tensor& x, const Tensor& labels, const Tensor& flag) {
  const VocabParallelHead::Forward f = head.forward(ctx, {x});
  const ops::CrossEntropyResult ce = head.loss(ctx, f.logits, labels, flag, kParams);
  const Tensor dx = head.backward(ctx, f.saved, {ce.dlogits});
  return {ctx.to_vector<float>(ce.loss).at(0),   ctx.to_vector<float>(f.logits),
          ctx.to_vector<float>(ce.dlogits),      ctx.to_vector<float>(dx),
          ctx.to_vector<float>(head.weight().grad), ctx.to_vector<std::int32_t>(flag).at(0)};
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  testing::expect_close(got, want, what, 1e-5f, 1e-3f);
}

void expect_matches(const Result& got, const Result& want, int rank, int n, const std::string& who) {
  const std::int64_t t = kTokens / n;
  const std::int64_t v = kVocab / n;
  EXPECT_NEAR(got.loss, want.loss, 1e-6 * std::abs(want.loss)) << who << " loss";
  EXPECT_EQ(got.logits, columns(want.logits, kTokens, kVocab, rank * v, v)) << who << " logits (the same dot products)";
  expect_close(got.dlogits, columns(want.dlogits, kTokens, kVocab, rank * v, v), who + " dlogits columns");
  expect_close(got.dx, rows(want.dx, kHidden, rank * t, t), who + " dx rows");
  expect_close(got.weight_grad, rows(want.weight_grad, kHidden, rank * v, v), who + " weight gradient rows");
}

class VocabParallelHeadTest : public ::testing::TestWithParam<int> {};

TEST_P(VocabParallelHeadTest, EveryRankMatchesOneRanksHeadAndCrossEntropyAndItsGraphEqualsEager) {
  const int n = GetParam();
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  const std::vector<std::int32_t> labels_all = random_labels(seed.value() + 1);
  const Result want = reference(x_all, labels_all);
  const std::int64_t t = kTokens / n;
  std::mutex mutex;
  std::vector<float> losses(static_cast<std::size_t>(n));
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const VocabParallelHeadConfig config{.hidden = kHidden, .vocab = kVocab, .dtype = DType::kFloat32};
    VocabParallelHead eager(ctx, "head", config, kSeed, &comm);
    VocabParallelHead graphed(ctx, "head", config, kSeed, &comm);
    EXPECT_EQ(eager.local_vocab(), kVocab / n);
    EXPECT_EQ(eager.vocab_offset(), r * kVocab / n);
    const Tensor x = floats_of(ctx, "x", rows(x_all, kHidden, r * t, t), t);
    const Tensor labels = labels_of(ctx, labels_all);
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
    const Result got = run(ctx, eager, x, labels, flag);
    expect_matches(got, want, r, n, who);
    EXPECT_EQ(got.flag, 0) << who;
    {
      const std::lock_guard<std::mutex> lock(mutex);
      losses[r] = got.loss;
    }

    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const VocabParallelHead::Forward f = graphed.forward(ctx, {x});
                                         const ops::CrossEntropyResult ce =
                                             graphed.loss(ctx, f.logits, labels, flag, kParams);
                                         const Tensor dx = graphed.backward(ctx, f.saved, {ce.dlogits});
                                         return std::vector<Tensor>{ce.loss, f.logits, ce.dlogits, dx};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    for (int replay = 0; replay < 2; ++replay) {
      graph->replay();
      const std::vector<Tensor>& out = graph->outputs();
      EXPECT_EQ(ctx.to_vector<float>(out[0]).at(0), got.loss) << who;
      EXPECT_EQ(ctx.to_vector<float>(out[1]), got.logits) << who;
      EXPECT_EQ(ctx.to_vector<float>(out[2]), got.dlogits) << who;
      EXPECT_EQ(ctx.to_vector<float>(out[3]), got.dx) << who;
      EXPECT_EQ(ctx.to_vector<float>(graphed.weight().grad), got.weight_grad) << who;
    }
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0) << who;
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(losses[r], losses[0]) << "rank " << r << "'s loss differs from rank 0's";
}

INSTANTIATE_TEST_SUITE_P(Worlds, VocabParallelHeadTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// A label outside [0, vocab) sets the flag on every rank, eager and graphed;
// its token counts nowhere (the loss and gradients are those of the batch
// with that token ignored) and its dlogits row is zero.
TEST(VocabParallelHeadLabelsTest, OutOfRangeLabelSetsTheFlagOnEveryRankAndCountsNowhere) {
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  std::vector<std::int32_t> labels_all = random_labels(seed.value() + 1);
  std::vector<std::int32_t> labels_ignored = labels_all;
  labels_all[5] = kVocab;  // one past the end
  labels_ignored[5] = kIgnore;
  const Result want = reference(x_all, labels_ignored);
  constexpr int kRanks = 2;
  constexpr std::int64_t t = kTokens / kRanks;
  HostWorld::run(kRanks, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    VocabParallelHead head(ctx, "head", {.hidden = kHidden, .vocab = kVocab, .dtype = DType::kFloat32}, kSeed, &comm);
    const Tensor x = floats_of(ctx, "x", rows(x_all, kHidden, r * t, t), t);
    const Tensor labels = labels_of(ctx, labels_all);
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
    const Result got = run(ctx, head, x, labels, flag);
    EXPECT_EQ(got.flag, 1) << who;
    expect_matches(got, want, r, kRanks, who);
    const std::int64_t v = kVocab / kRanks;
    for (std::int64_t j = 0; j < v; ++j) EXPECT_EQ(got.dlogits[5 * v + j], 0.0f) << who << " column " << j;

    const std::int32_t zero = 0;
    ctx.copy_from_host(flag, &zero, sizeof(zero));
    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const VocabParallelHead::Forward f = head.forward(ctx, {x});
                                         return std::vector<Tensor>{
                                             head.loss(ctx, f.logits, labels, flag, kParams).loss};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0) << who << ": capturing runs nothing";
    graph->replay();
    EXPECT_EQ(ctx.to_vector<float>(graph->outputs()[0]).at(0), got.loss) << who;
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 1) << who << ": the replay sets the flag";
  });
}

// Without a communicator the head is one rank's bias-free Linear and loss()
// is ops::cross_entropy: the same bits.
TEST(VocabParallelHeadPlainTest, WithoutACommunicatorItIsThePlainHeadBitForBit) {
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  const std::vector<std::int32_t> labels_all = random_labels(seed.value() + 1);
  const Result want = reference(x_all, labels_all);
  Context ctx(Device::kHost);
  VocabParallelHead head(ctx, "head", {.hidden = kHidden, .vocab = kVocab, .dtype = DType::kFloat32}, kSeed);
  EXPECT_EQ(head.vocab_offset(), 0);
  EXPECT_EQ(head.local_vocab(), kVocab);
  const Result got = run(ctx, head, floats_of(ctx, "x", x_all, kTokens), labels_of(ctx, labels_all),
                         ctx.persistent("flag", {Shape{1}, DType::kInt32}));
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.logits, want.logits);
  EXPECT_EQ(got.dlogits, want.dlogits);
  EXPECT_EQ(got.dx, want.dx);
  EXPECT_EQ(got.weight_grad, want.weight_grad);
}

TEST(VocabParallelHeadErrorsTest, BadConfigsAndArgumentsAreClearErrors) {
  Context host(Device::kHost);
  EXPECT_ERROR_CONTAINS(VocabParallelHead(host, "head", {.hidden = 8, .vocab = 36, .dtype = DType::kBFloat16}, 1),
                        "VocabParallelHead 'head'", "multiple of 8 for bf16 logits", "pad the vocabulary");
  EXPECT_ERROR_CONTAINS(VocabParallelHead(host, "head", {.hidden = 0, .vocab = 32}, 1), "hidden and vocab must be > 0");
  HostWorld::run(3, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(
        VocabParallelHead(ctx, "head", {.hidden = 8, .vocab = 32, .dtype = DType::kFloat32}, 1, &comm),
        "vocab 32 must divide by the 3 ranks", "pad the vocabulary to a multiple of 3");
  });
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(
        VocabParallelHead(ctx, "head", {.hidden = 8, .vocab = 36, .dtype = DType::kFloat32}, 1, &comm),
        "each rank's vocabulary slice (36 / 2 = 18) must be a multiple of 4", "multiple of 8");
    VocabParallelHead head(ctx, "head", {.hidden = kHidden, .vocab = kVocab, .dtype = DType::kFloat32}, kSeed, &comm);
    const Tensor x = ctx.persistent("x", {Shape{4, kHidden}, DType::kFloat32});
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
    const Tensor labels = ctx.persistent("labels", {Shape{8}, DType::kInt32});
    EXPECT_ERROR_CONTAINS(head.forward(ctx, {ctx.persistent("bad", {Shape{4, 9}, DType::kFloat32})}),
                          "VocabParallelHead 'head' forward", "this rank's token shard");
    const VocabParallelHead::Forward f = head.forward(ctx, {x});  // [8, 16]: every token, half the vocabulary
    EXPECT_EQ(f.logits.shape(), (Shape{8, kVocab / 2}));
    EXPECT_ERROR_CONTAINS(head.backward(ctx, f.saved, {ctx.persistent("d", {Shape{8, kVocab}, DType::kFloat32})}),
                          "VocabParallelHead 'head' backward", "dlogits must be [8, 16]");
    // Wrong on both ranks (0 and 16 are right), so neither reaches a collective.
    EXPECT_ERROR_CONTAINS(ops::vocab_parallel_cross_entropy(ctx, comm, f.logits, labels, flag, /*vocab_offset=*/1),
                          "vocab_offset 1 is not the first column", "pass VocabParallelHead::vocab_offset()");
  });
}

// On the GPU, one rank through real NCCL: the head's all-gather and
// reduce-scatter and the cross-entropy's two all-reduces are identities,
// captured into the graph; replayed, the bf16 head and its vocabulary-parallel
// cross-entropy equal the plain head and the fused cross-entropy bit for bit
// (the same kernels' instructions: Note [Vocabulary-parallel cross-entropy]).
TEST(VocabParallelHeadCudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainHeadAndCrossEntropy) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  constexpr std::int64_t kHiddenGpu = 256;
  constexpr std::int64_t kVocabGpu = 4096;
  constexpr std::int64_t kTokensGpu = 128;
  VocabParallelHead parallel(ctx, "head", {.hidden = kHiddenGpu, .vocab = kVocabGpu}, kSeed, comm.get());
  Linear plain(ctx, "head", {.in_features = kHiddenGpu, .out_features = kVocabGpu, .bias = false}, kSeed);
  const TensorMeta meta{Shape{kTokensGpu, kHiddenGpu}, DType::kBFloat16};
  const Tensor x = ctx.persistent("x", meta);
  std::vector<std::uint16_t> values(static_cast<std::size_t>(meta.numel()));
  const std::vector<float> normal = normal_values(7, meta.numel());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = float_to_bf16(normal[i]);
  ctx.copy_from_host(x, values.data(), values.size() * 2);
  std::vector<std::int32_t> label_values(kTokensGpu);
  std::mt19937 rng(11);
  for (std::int32_t& l : label_values) l = std::uniform_int_distribution<std::int32_t>(0, kVocabGpu - 1)(rng);
  label_values[9] = label_values[77] = kIgnore;
  const Tensor labels = ctx.persistent("labels", {Shape{kTokensGpu}, DType::kInt32});
  ctx.copy_from_host(labels, label_values.data(), label_values.size() * sizeof(std::int32_t));
  const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});

  const testing::ParityGraphs graphs(
      ctx, *comm,
      [&] {
        const VocabParallelHead::Forward f = parallel.forward(ctx, {x});
        const ops::CrossEntropyResult ce = parallel.loss(ctx, f.logits, labels, flag);
        return std::vector<Tensor>{ce.loss, ce.dlogits, parallel.backward(ctx, f.saved, {ce.dlogits})};
      },
      [&] {
        const Linear::Forward f = plain.forward(ctx, {x});
        const ops::CrossEntropyResult ce = ops::cross_entropy(ctx, f.y, labels, flag);
        return std::vector<Tensor>{ce.loss, ce.dlogits, plain.backward(ctx, f.saved, {ce.dlogits})};
      });
  graphs.replay(10);
  EXPECT_EQ(ctx.to_vector<std::uint32_t>(graphs.with->outputs()[0]),
            ctx.to_vector<std::uint32_t>(graphs.without->outputs()[0]))
      << "loss";
  for (std::size_t o : {1, 2}) {
    EXPECT_EQ(ctx.to_vector<std::uint16_t>(graphs.with->outputs()[o]),
              ctx.to_vector<std::uint16_t>(graphs.without->outputs()[o]))
        << "output " << o;
  }
  EXPECT_EQ(ctx.to_vector<float>(parallel.weight().grad), ctx.to_vector<float>(plain.weight().grad));
  EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0);
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
