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

#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "optim/adamw.h"
#include "layers/residual_stack.h"
#include "train/train_step.h"
#include "tests/support/gpu.h"
#include "tests/support/global_batch.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = 16;
constexpr std::int64_t kVocab = 16;
constexpr std::int64_t kLocalTokens = 8;
constexpr int kSteps = 4;

ResidualStackConfig config(DType dtype = DType::kFloat32) {
  return {.hidden = kHidden, .ffn = 32, .layers = 2, .vocab = kVocab, .dtype = dtype, .seed = 11};
}

// The global batch of step s: x [tokens, hidden] and labels [tokens].
// The global batch of step s (tests/support/global_batch.h) at this file's sizes.
using Batch = testing::GlobalBatch;
Batch global_batch(std::uint32_t seed, int step, std::int64_t tokens) {
  return testing::global_batch(seed, step, tokens, kHidden, kVocab);
}

// One model, optimizer and step in `ctx`.
struct Rig {
  Rig(Context& ctx, std::int64_t tokens, Communicator* dp, DataParallelMode mode = DataParallelMode::kAllReduce,
      DType dtype = DType::kFloat32)
      : model(ctx, config(dtype)),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f}),
        step(ctx, model, optimizer, tokens, dp, mode) {}
  void load(Context& ctx, const Batch& b, std::int64_t first, std::int64_t tokens) {
    if (step.inputs().dtype() != DType::kFloat32) {  // the model's dtype: round the batch to it
      std::vector<std::uint16_t> x;
      for (std::int64_t i = first * kHidden; i < (first + tokens) * kHidden; ++i) x.push_back(float_to_bf16(b.x[i]));
      ctx.copy_from_host(step.inputs(), x.data(), x.size() * 2);
    } else {
      ctx.copy_from_host(step.inputs(), b.x.data() + first * kHidden, static_cast<std::size_t>(tokens * kHidden) * 4);
    }
    ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(tokens) * 4);
  }
  // What the layers read: every parameter's value, as bytes.
  std::vector<std::uint8_t> values(Context& ctx) {
    std::vector<std::uint8_t> all;
    for (const Parameter* p : model.parameters()) {
      std::vector<std::uint8_t> bytes(static_cast<std::size_t>(p->value.bytes()));
      ctx.copy_to_host(p->value, bytes.data(), bytes.size());
      all.insert(all.end(), bytes.begin(), bytes.end());
    }
    return all;
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

// ZeRO-1 against plain all-reduce data parallelism: the host's reduce-scatter
// adds in the same (rank) order as its all-reduce, and the update of an
// element depends on that element alone, so the two train bit for bit alike
// (Note [Sharded AdamW]); the graph of the sharded step equals its eager run.
struct Zero1Case {
  int ranks;
  int side_streams;
  DType dtype;
};

class Zero1Test : public ::testing::TestWithParam<Zero1Case> {};

TEST_P(Zero1Test, EqualsAllReduceBitForBitEagerAndGraphed) {
  const auto [ranks, side_streams, dtype] = GetParam();
  const testing::TestSeed seed;
  HostWorld::run(ranks, [&](Communicator& comm) {
    Context ctx(Device::kHost, side_streams);
    if (side_streams > 0) ctx.set_communication_stream(side_streams);
    const std::int64_t start = ctx.memory_stats().persistent_bytes;
    Rig all_reduce(ctx, kLocalTokens, &comm, DataParallelMode::kAllReduce, dtype);
    const std::int64_t all_reduce_bytes = ctx.memory_stats().persistent_bytes - start;
    Rig zero(ctx, kLocalTokens, &comm, DataParallelMode::kZero1, dtype);
    const std::int64_t zero_bytes = ctx.memory_stats().persistent_bytes - start - all_reduce_bytes;
    Rig zero_graphed(ctx, kLocalTokens, &comm, DataParallelMode::kZero1, dtype);
    EXPECT_TRUE(zero.optimizer.sharded());
    auto graph = CapturedStep::capture(
        ctx, [&] { return zero_graphed.step(ctx); },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = zero_graphed.step.communicators()});
    const std::int64_t first = comm.rank() * kLocalTokens;
    for (int s = 0; s < kSteps; ++s) {
      const Batch b = global_batch(seed.value(), s, kLocalTokens * ranks);
      for (Rig* rig : {&all_reduce, &zero, &zero_graphed}) rig->load(ctx, b, first, kLocalTokens);
      const float want = ctx.to_vector<float>(all_reduce.step(ctx)[0]).at(0);
      const float got = ctx.to_vector<float>(zero.step(ctx)[0]).at(0);
      graph->replay();
      const float graphed = ctx.to_vector<float>(graph->outputs()[0]).at(0);
      ASSERT_EQ(std::memcmp(&want, &got, 4), 0)
          << "rank " << comm.rank() << " step " << s << ": " << want << " vs " << got;
      ASSERT_EQ(std::memcmp(&got, &graphed, 4), 0) << "rank " << comm.rank() << " step " << s;
    }
    EXPECT_EQ(zero.values(ctx), all_reduce.values(ctx)) << "rank " << comm.rank();
    EXPECT_EQ(zero_graphed.values(ctx), all_reduce.values(ctx)) << "rank " << comm.rank();
    EXPECT_EQ(zero.optimizer.steps_taken(ctx), kSteps);
    // A sharded rig holds 1/N of the moments and masters but keeps the full
    // gradients and adds a gradient shard (Note [Sharded AdamW]): per element
    // of an fp32 model 16 bytes against 8 + 16 / N, a saving from N > 2.
    if (comm.rank() == 0) {
      std::printf("%d ranks, %s: persistent bytes of a rig (model, optimizer, step): all-reduce %lld, ZeRO-1 %lld\n",
                  ranks, std::string(dtype_name(dtype)).c_str(), static_cast<long long>(all_reduce_bytes),
                  static_cast<long long>(zero_bytes));
    }
    if (ranks > 2 && dtype == DType::kFloat32) {
      EXPECT_LT(zero_bytes, all_reduce_bytes);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Zero1Test,
                         ::testing::Values(Zero1Case{2, 0, DType::kFloat32}, Zero1Case{2, 2, DType::kFloat32},
                                           Zero1Case{4, 2, DType::kFloat32}, Zero1Case{2, 2, DType::kBFloat16}),
                         [](const auto& info) {
                           return "ranks" + std::to_string(info.param.ranks) + "_side" +
                                  std::to_string(info.param.side_streams) + "_" +
                                  std::string(dtype_name(info.param.dtype));
                         });

// Note [Where summed updates run] (optim/adamw.h): each group's update after
// its all-reduce runs on the communication stream, on the weight-gradient
// stream, or (the default) on the first when captured and the second eager;
// the captured program puts every AdamW launch where asked, and every
// placement trains the same bits, eager and graphed.
TEST(DataParallelUpdateStreamTest, SummedUpdatesOnAnyStreamTrainTheSameBits) {
  const testing::TestSeed seed;
  constexpr int kRanks = 2;
  constexpr int kSideStreams = 2;  // stream 1 weight gradients, stream 2 collectives
  using Where = AdamW::SummedUpdateStream;
  const std::vector<Where> placements = {Where::kCommunication, Where::kWeightGradient,
                                         Where::kCommunicationWhenCaptured};
  std::vector<std::vector<std::vector<std::uint8_t>>> values(placements.size());
  for (std::size_t w = 0; w < placements.size(); ++w) {
    const Where where = placements[w];
    // What the captured program shows; kCommunicationWhenCaptured's eager steps update on stream 1.
    const int expected_stream = where == Where::kWeightGradient ? 1 : kSideStreams;
    auto& per_rank = values[w];
    per_rank.assign(kRanks, {});
    HostWorld::run(kRanks, [&](Communicator& comm) {
      Context ctx(Device::kHost, kSideStreams);
      ctx.set_communication_stream(kSideStreams);
      Rig eager(ctx, kLocalTokens, &comm);
      Rig graphed(ctx, kLocalTokens, &comm);
      eager.optimizer.set_summed_update_stream(where);
      graphed.optimizer.set_summed_update_stream(where);
      auto graph = CapturedStep::capture(
          ctx, [&] { return graphed.step(ctx); },
          {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.step.communicators()});
      int updates = 0;
      for (const Instruction& instruction : graph->program().instructions()) {
        if (instruction.op->name != "adamw") continue;
        ++updates;
        EXPECT_EQ(instruction.stream, expected_stream)
            << "rank " << comm.rank() << ": an AdamW update on stream " << instruction.stream << ", asked for "
            << summed_update_stream_name(where);
      }
      EXPECT_GT(updates, 1) << "rank " << comm.rank() << ": the step should update group by group";
      const std::int64_t first = comm.rank() * kLocalTokens;
      for (int s = 0; s < kSteps; ++s) {
        const Batch b = global_batch(seed.value(), s, kLocalTokens * kRanks);
        eager.load(ctx, b, first, kLocalTokens);
        graphed.load(ctx, b, first, kLocalTokens);
        eager.step(ctx);
        graph->replay();
      }
      const std::vector<std::uint8_t> graph_values = graphed.values(ctx);
      ASSERT_EQ(graph_values, eager.values(ctx)) << "rank " << comm.rank() << ": graph and eager differ";
      per_rank[static_cast<std::size_t>(comm.rank())] = graph_values;
    });
  }
  for (std::size_t w = 1; w < placements.size(); ++w) {
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(values[w][r], values[0][r]) << "rank " << r << ": " << summed_update_stream_name(placements[w])
                                            << " trained other values than comm";
    }
  }
}

// FP8 with delayed scaling over data-parallel ranks: each rank quantizes its
// own rows, but TrainStep has the step's amaxes of x and dy max-all-reduced
// over the ranks before they enter the histories (Linear::set_amax_group), so
// after some steps every rank holds the same histories and scales, bit for
// bit, graphed like eager, though their data differ.
TEST(DataParallelFp8Test, DelayedScalingKeepsTheSameScalesOnEveryRank) {
  const testing::TestSeed seed;
  constexpr int kRanks = 2;
  constexpr std::int64_t kFp8Hidden = 32, kFp8Tokens = 16;
  const ResidualStackConfig fp8_config{.hidden = kFp8Hidden, .ffn = 64, .layers = 1, .vocab = kVocab,
                                       .dtype = DType::kBFloat16, .seed = 11, .fp8 = Fp8Recipe::delayed(4)};
  std::vector<std::vector<std::uint8_t>> rank_states(kRanks);
  HostWorld::run(kRanks, [&](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    ResidualStack eager_model(ctx, fp8_config), graphed_model(ctx, fp8_config);
    AdamW eager_optimizer(ctx, eager_model.parameters(), {.lr = 1e-3f});
    AdamW graphed_optimizer(ctx, graphed_model.parameters(), {.lr = 1e-3f});
    TrainStep eager(ctx, eager_model, eager_optimizer, kFp8Tokens, &comm);
    TrainStep graphed(ctx, graphed_model, graphed_optimizer, kFp8Tokens, &comm);
    auto graph = CapturedStep::capture(
        ctx, [&] { return graphed(ctx); },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.communicators()});
    for (int s = 0; s < kSteps; ++s) {
      const testing::GlobalBatch b = testing::global_batch(seed.value(), s, kFp8Tokens * kRanks, kFp8Hidden, kVocab);
      std::vector<std::uint16_t> x;
      for (std::int64_t i = comm.rank() * kFp8Tokens * kFp8Hidden; i < (comm.rank() + 1) * kFp8Tokens * kFp8Hidden;
           ++i) {
        x.push_back(float_to_bf16(b.x[i] * (1.0f + comm.rank())));  // the ranks' amaxes differ
      }
      for (TrainStep* step : {&eager, &graphed}) {
        ctx.copy_from_host(step->inputs(), x.data(), x.size() * 2);
        ctx.copy_from_host(step->labels(), b.labels.data() + comm.rank() * kFp8Tokens, kFp8Tokens * 4);
      }
      eager(ctx);
      graph->replay();
    }
    auto state_bytes = [&](const ResidualStack& model) {
      std::vector<std::uint8_t> all;
      for (const StateTensor& t : model.state()) {
        std::vector<std::uint8_t> bytes(static_cast<std::size_t>(t.tensor.bytes()));
        ctx.copy_to_host(t.tensor, bytes.data(), bytes.size());
        all.insert(all.end(), bytes.begin(), bytes.end());
      }
      return all;
    };
    EXPECT_EQ(eager_model.state().size(), 18u) << "fc1's and fc2's x, W and dy: history, scale, scale_inv";
    EXPECT_EQ(state_bytes(eager_model), state_bytes(graphed_model)) << "rank " << comm.rank();
    rank_states[static_cast<std::size_t>(comm.rank())] = state_bytes(graphed_model);
  });
  EXPECT_EQ(rank_states[1], rank_states[0]) << "the ranks' FP8 scaling state differs";
}

// On the GPU, a world of one rank through real NCCL: the step's collectives
// (the loss all-reduce and one per parameter group, or ZeRO-1's
// reduce-scatters and all-gathers) are identities at one rank, but they are
// captured into the step's graph like at any size. Replayed 1,000 times, the
// step must equal the same step without a communicator, bit for bit.
class DataParallelCudaTest : public ::testing::TestWithParam<DataParallelMode> {};

TEST_P(DataParallelCudaTest, OneNcclRankCapturedAndReplayedAThousandTimesEqualsNoCommunicator) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  Rig with(ctx, kLocalTokens, comm.get(), GetParam(), DType::kBFloat16);
  Rig without(ctx, kLocalTokens, nullptr, DataParallelMode::kAllReduce, DType::kBFloat16);
  auto graph_with = CapturedStep::capture(
      ctx, [&] { return with.step(ctx); },
      {.pool_report_policy = PoolReportPolicy::kError, .communicators = with.step.communicators()});
  auto graph_without =
      CapturedStep::capture(ctx, [&] { return without.step(ctx); }, {.pool_report_policy = PoolReportPolicy::kError});
  int collectives = 0;
  for (const Instruction& instruction : graph_with->program().instructions()) {
    if (instruction.op->collective == nullptr) continue;
    ++collectives;
    EXPECT_EQ(instruction.stream, 2) << instruction.op->name;
  }
  EXPECT_GT(collectives, 2);
  const testing::TestSeed seed;
  const Batch b = global_batch(seed.value(), 0, kLocalTokens);
  with.load(ctx, b, 0, kLocalTokens);
  without.load(ctx, b, 0, kLocalTokens);
  for (int i = 0; i < 1000; ++i) {
    graph_with->replay();
    graph_without->replay();
    if (i % 100 == 99) {
      const float a = ctx.to_vector<float>(graph_with->outputs()[0]).at(0);
      const float c = ctx.to_vector<float>(graph_without->outputs()[0]).at(0);
      ASSERT_EQ(std::memcmp(&a, &c, 4), 0) << "replay " << i + 1 << ": " << a << " vs " << c;
    }
  }
  comm->check_health();
  EXPECT_EQ(with.values(ctx), without.values(ctx));
  EXPECT_EQ(with.optimizer.steps_taken(ctx), 1000);
  std::printf("%s over NCCL %s: %d collectives in the step, 1000 replays equal to the step without them\n",
              GetParam() == DataParallelMode::kZero1 ? "ZeRO-1" : "all-reduce", nccl_version().c_str(), collectives);
}

INSTANTIATE_TEST_SUITE_P(Modes, DataParallelCudaTest,
                         ::testing::Values(DataParallelMode::kAllReduce, DataParallelMode::kZero1),
                         [](const auto& info) {
                           return info.param == DataParallelMode::kZero1 ? std::string("zero1")
                                                                         : std::string("allreduce");
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
