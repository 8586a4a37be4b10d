// Data parallelism on host thread worlds of 2 and 4 ranks: each rank trains
// on its slice of a global batch, and the result is compared with one
// process training on the whole batch.
//
// Tolerance: the gradients differ only in the order of fp32 additions (one
// rank sums its rows, then the all-reduce sums the ranks, where one process
// sums all rows in one GEMM), about 1e-7 relative per step; AdamW divides by
// the root of the second moment, so the parameters drift apart by at most a
// few lr-sized steps only where a gradient is near zero. We allow 1e-5
// absolute on the parameters after 4 steps of lr 1e-3 and 1e-5 relative on
// the losses, which a mis-scaled or missing reduction exceeds by orders of
// magnitude (checked by the last test). Every DP rank holds the same
// parameters bit for bit, and its graph equals its eager step bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/adamw.h"
#include "layers/residual_stack.h"
#include "layers/train_step.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kVocab = 16;
constexpr std::int64_t kLocalTokens = 8;
constexpr int kSteps = 4;

ResidualStackConfig config() {
  return {.hidden = kHidden, .ffn = 32, .layers = 2, .vocab = kVocab, .dtype = DType::kFloat32, .seed = 11};
}

// The global batch of step s: x [tokens, hidden] and labels [tokens].
struct Batch {
  std::vector<float> x;
  std::vector<std::int32_t> labels;
};

Batch global_batch(std::uint32_t seed, int step, std::int64_t tokens) {
  std::mt19937 rng(seed + 1000u * static_cast<std::uint32_t>(step));
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<std::int32_t> label(0, kVocab - 1);
  Batch b;
  for (std::int64_t i = 0; i < tokens * kHidden; ++i) b.x.push_back(normal(rng));
  for (std::int64_t i = 0; i < tokens; ++i) b.labels.push_back(label(rng));
  return b;
}

// One model, optimizer and step in `ctx`.
struct Rig {
  Rig(Context& ctx, std::int64_t tokens, Communicator* dp)
      : model(ctx, config()),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f}),
        step(ctx, model, optimizer, tokens, dp) {}
  void load(Context& ctx, const Batch& b, std::int64_t first, std::int64_t tokens) {
    ctx.copy_from_host(step.inputs(), b.x.data() + first * kHidden, static_cast<std::size_t>(tokens * kHidden) * 4);
    ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(tokens) * 4);
  }
  std::vector<float> parameters(Context& ctx) {
    std::vector<float> all;
    for (const Parameter* p : model.parameters()) {
      const std::vector<float> v = ctx.to_vector<float>(p->master);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  ResidualStack model;
  AdamW optimizer;
  TrainStep step;
};

struct SingleRun {
  std::vector<float> losses;
  std::vector<float> parameters;
};

SingleRun train_on_whole_batch(std::uint32_t seed, int ranks) {
  Context ctx(Device::kHost, 2);
  Rig rig(ctx, kLocalTokens * ranks, nullptr);
  SingleRun run;
  for (int s = 0; s < kSteps; ++s) {
    rig.load(ctx, global_batch(seed, s, kLocalTokens * ranks), 0, kLocalTokens * ranks);
    run.losses.push_back(ctx.to_vector<float>(rig.step(ctx)[0]).at(0));
  }
  run.parameters = rig.parameters(ctx);
  return run;
}

struct DataParallelCase {
  int ranks;
  int side_streams;  // 0: one update after the backward; 2: grouped updates overlapping it
};

class DataParallelTest : public ::testing::TestWithParam<DataParallelCase> {};

TEST_P(DataParallelTest, EqualsOneProcessOnTheWholeBatchAndGraphEqualsEager) {
  const auto [ranks, side_streams] = GetParam();
  const testing::TestSeed seed;
  const SingleRun single = train_on_whole_batch(seed.value(), ranks);
  std::vector<std::vector<float>> rank_parameters(static_cast<std::size_t>(ranks));
  HostWorld::run(ranks, [&](Communicator& comm) {
    Context ctx(Device::kHost, side_streams);
    if (side_streams > 0) ctx.set_communication_stream(side_streams);
    Rig eager(ctx, kLocalTokens, &comm);
    Rig graphed(ctx, kLocalTokens, &comm);
    auto graph = CapturedStep::capture(
        ctx, [&] { return graphed.step(ctx); },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.step.communicators()});
    const std::int64_t first = comm.rank() * kLocalTokens;
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = global_batch(seed.value(), s, kLocalTokens * ranks);
      eager.load(ctx, b, first, kLocalTokens);
      graphed.load(ctx, b, first, kLocalTokens);
      const float eager_loss = ctx.to_vector<float>(eager.step(ctx)[0]).at(0);
      graph->replay();
      const float graph_loss = ctx.to_vector<float>(graph->outputs()[0]).at(0);
      ASSERT_EQ(std::memcmp(&eager_loss, &graph_loss, 4), 0) << "rank " << comm.rank() << " step " << s;
      EXPECT_NEAR(graph_loss, single.losses[s], 1e-5 * std::abs(single.losses[s]))
          << "rank " << comm.rank() << " step " << s << ": the global mean loss";
    }
    const std::vector<float> p = graphed.parameters(ctx);
    ASSERT_EQ(p, eager.parameters(ctx)) << "rank " << comm.rank() << ": graph and eager parameters differ";
    rank_parameters[static_cast<std::size_t>(comm.rank())] = p;
  });
  double worst = 0;
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(rank_parameters[r], rank_parameters[0]) << "rank " << r << " holds other parameters than rank 0";
  }
  ASSERT_EQ(rank_parameters[0].size(), single.parameters.size());
  for (std::size_t i = 0; i < single.parameters.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(rank_parameters[0][i] - single.parameters[i])));
  }
  EXPECT_LE(worst, 1e-5) << "parameters of " << ranks << " ranks against one process";
  std::printf("%d ranks, %d side streams: largest parameter difference to one process %.3g after %d steps\n", ranks,
              side_streams, worst, kSteps);
}

INSTANTIATE_TEST_SUITE_P(Worlds, DataParallelTest,
                         ::testing::Values(DataParallelCase{2, 0}, DataParallelCase{2, 2}, DataParallelCase{4, 2}),
                         [](const auto& info) {
                           return "ranks" + std::to_string(info.param.ranks) + "_side" +
                                  std::to_string(info.param.side_streams);
                         });

// The tolerance above is tight enough to matter: training on one rank's
// slice alone (no reduction) misses it by far.
TEST(DataParallelToleranceTest, ASingleSliceIsFarFromTheWholeBatch) {
  const testing::TestSeed seed;
  const SingleRun whole = train_on_whole_batch(seed.value(), 2);
  const SingleRun half = train_on_whole_batch(seed.value(), 1);  // the first slice of step s is not the same batch
  double worst = 0;
  for (std::size_t i = 0; i < whole.parameters.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(whole.parameters[i] - half.parameters[i])));
  }
  EXPECT_GT(worst, 1e-3);
}

}  // namespace
}  // namespace stepgraph
