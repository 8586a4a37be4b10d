// Collective ops on host thread worlds of 1, 2 and 4 ranks: eager results
// against their reference, a captured step with every collective equal to
// eager bit for bit on every rank, collectives on the communication stream,
// and the capture uniformity check ending mismatched captures on every rank.
#include "ops/collective_ops.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "ops/elementwise_ops.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using namespace std::chrono_literals;

constexpr std::int64_t kRows = 8;  // divisible by every world size tested
constexpr std::int64_t kCols = 6;

TensorMeta f32(std::int64_t rows, std::int64_t cols) { return {Shape{rows, cols}, DType::kFloat32}; }

float value(int rank, std::int64_t i) { return static_cast<float>(rank + 1) * 0.25f + static_cast<float>(i % 11); }

std::vector<float> rank_values(int rank, std::int64_t count) {
  std::vector<float> v(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) v[static_cast<std::size_t>(i)] = value(rank, i);
  return v;
}

// One rank's state for the step below.
struct RankState {
  Tensor x;     // this rank's data
  Tensor grad;  // reduced in place each step
  Tensor seed;  // broadcast from rank 0 each step
  Tensor acc;   // accumulates the gathered result, so every replay matters
};

RankState make_state(Context& ctx, int rank, const std::string& prefix) {
  RankState s{ctx.persistent(prefix + "x", f32(kRows, kCols)), ctx.persistent(prefix + "grad", f32(kRows, kCols)),
              ctx.persistent(prefix + "seed", f32(kRows, kCols)), ctx.persistent(prefix + "acc", f32(kRows, kCols))};
  const std::vector<float> data = rank_values(rank, kRows * kCols);
  for (const Tensor& t : {s.x, s.grad, s.seed}) ctx.copy_from_host(t, data.data(), data.size() * sizeof(float));
  return s;
}

// Every collective once: all-reduce (in place and not, sum and max),
// reduce-scatter, all-gather, broadcast and a ring of send/recv.
std::vector<Tensor> every_collective(Context& ctx, Communicator& comm, const RankState& s) {
  const int n = comm.world_size();
  const Tensor y = ops::mul(ctx, s.x, s.x);
  ops::all_reduce_(ctx, comm, s.grad, ReduceOp::kSum);
  const Tensor peak = ops::all_reduce(ctx, comm, y, ReduceOp::kMax);
  const Tensor shard = ops::reduce_scatter(ctx, comm, y, ReduceOp::kSum);
  const Tensor full = ops::all_gather(ctx, comm, shard);
  ops::broadcast_(ctx, comm, s.seed, 0);
  ops::axpy_(ctx, s.acc, full, 1.0f);
  Tensor neighbour = s.x;
  if (n > 1) {
    neighbour = ops::send_recv(ctx, comm, s.x, (comm.rank() + 1) % n, (comm.rank() + n - 1) % n);
    // A plain send and recv between ranks 0 and 1 (no cycle, so no deadlock on NCCL).
    if (comm.rank() == 0) ops::send(ctx, comm, peak, 1);
    if (comm.rank() == 1) neighbour = ops::add(ctx, neighbour, ops::recv(ctx, comm, peak.meta(), 0));
  }
  return {ops::sum(ctx, peak).set_name("peak"), ops::sum(ctx, s.acc).set_name("acc"),
          ops::sum(ctx, neighbour).set_name("neighbour"), ops::sum(ctx, s.seed).set_name("seed")};
}

std::vector<float> read(Context& ctx, const std::vector<Tensor>& scalars) {
  std::vector<float> out;
  for (const Tensor& t : scalars) out.push_back(ops::item(ctx, t));
  return out;
}

class CollectiveOpsTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectiveOpsTest, EagerMatchesTheReference) {
  const int n = GetParam();
  HostWorld::run(n, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    const RankState s = make_state(ctx, comm.rank(), "");
    ops::all_reduce_(ctx, comm, s.grad, ReduceOp::kSum);
    const Tensor shard = ops::reduce_scatter(ctx, comm, s.x, ReduceOp::kSum);
    const Tensor full = ops::all_gather(ctx, comm, s.x);
    const std::vector<float> grad = ctx.to_vector<float>(s.grad);
    const std::vector<float> shard_values = ctx.to_vector<float>(shard);
    const std::vector<float> full_values = ctx.to_vector<float>(full);
    ASSERT_EQ(shard.shape(), (Shape{kRows / n, kCols}));
    ASSERT_EQ(full.shape(), (Shape{kRows * n, kCols}));
    for (std::int64_t i = 0; i < kRows * kCols; ++i) {
      float sum = value(0, i);
      for (int r = 1; r < n; ++r) sum += value(r, i);
      ASSERT_EQ(grad[i], sum);
      for (int r = 0; r < n; ++r) ASSERT_EQ(full_values[r * kRows * kCols + i], value(r, i));
    }
    const std::int64_t first = comm.rank() * (kRows / n) * kCols;
    for (std::int64_t i = 0; i < (kRows / n) * kCols; ++i) {
      float sum = value(0, first + i);
      for (int r = 1; r < n; ++r) sum += value(r, first + i);
      ASSERT_EQ(shard_values[i], sum);
    }
  });
}

TEST_P(CollectiveOpsTest, CapturedStepEqualsEagerBitForBitOnEveryRank) {
  const int n = GetParam();
  HostWorld::run(n, [&](Communicator& comm) {
    Context ctx(Device::kHost, /*side_streams=*/2);
    ctx.set_communication_stream(2);
    const RankState eager = make_state(ctx, comm.rank(), "eager.");
    const RankState graphed = make_state(ctx, comm.rank(), "graph.");
    auto step = CapturedStep::capture(ctx, [&] { return every_collective(ctx, comm, graphed); },
                                      {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    int collectives = 0;
    for (const Instruction& instruction : step->program().instructions()) {
      if (instruction.op->collective == nullptr) continue;
      ++collectives;
      EXPECT_EQ(instruction.stream, 2) << instruction.op->name << " must run on the communication stream";
    }
    EXPECT_EQ(collectives, n == 1 ? 5 : (comm.rank() <= 1 ? 7 : 6));
    for (int i = 0; i < 5; ++i) {
      const std::vector<float> want = read(ctx, every_collective(ctx, comm, eager));
      step->replay();
      const std::vector<float> got = read(ctx, step->outputs());
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0)
          << "rank " << comm.rank() << " step " << i;
    }
    for (const auto& [a, b] : {std::pair{eager.grad, graphed.grad}, std::pair{eager.acc, graphed.acc}}) {
      EXPECT_EQ(ctx.to_vector<float>(a), ctx.to_vector<float>(b)) << "rank " << comm.rank();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectiveOpsTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "ranks" + std::to_string(info.param); });

// Runs `capture_on(rank)` on every rank of a world of `n`; every rank must
// raise an Error containing `words`, all within a few seconds.
template <typename... Words>
void expect_every_rank_refuses(int n, const std::function<void(Context&, Communicator&)>& capture_on,
                               const Words&... words) {
  std::atomic<int> refused{0};
  const auto start = std::chrono::steady_clock::now();
  HostWorld::run(
      n,
      [&](Communicator& comm) {
        Context ctx(Device::kHost, 2);
        ctx.set_communication_stream(2);
        EXPECT_ERROR_CONTAINS(capture_on(ctx, comm), words...);
        ++refused;
      },
      10s);
  EXPECT_EQ(refused.load(), n);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(CollectiveCaptureCheckTest, ADifferentShapeOnOneRankIsAnErrorOnEveryRankNamingTheOp) {
  expect_every_rank_refuses(
      3,
      [](Context& ctx, Communicator& comm) {
        const Tensor g = ctx.persistent("grad.block0", f32(4, comm.rank() == 2 ? 5 : 4));
        const Tensor h = ctx.persistent("grad.head", f32(2, 2));
        CapturedStep::capture(ctx, [&] {
          ops::all_reduce_(ctx, comm, h, ReduceOp::kSum);
          ops::all_reduce_(ctx, comm, g, ReduceOp::kSum);
          return std::vector<Tensor>{};
        });
      },
      "would record different collectives", "collective #1 is all_reduce_([4, 4] fp32)", "value 'grad.block0'",
      "but all_reduce_([4, 5] fp32)", "on rank 2", "every rank must capture the same collectives in the same order");
}

TEST(CollectiveCaptureCheckTest, ARankWithoutTheCollectiveIsNamedNotWaitedFor) {
  expect_every_rank_refuses(
      2,
      [](Context& ctx, Communicator& comm) {
        const Tensor g = ctx.persistent("grad", f32(4, 4));
        CapturedStep::capture(ctx,
                              [&] {
                                if (comm.rank() == 0) ops::all_reduce_(ctx, comm, g, ReduceOp::kSum);
                                return std::vector<Tensor>{ops::sum(ctx, g)};
                              },
                              {.communicators = {&comm}});
      },
      "collective #0 is all_reduce_([4, 4] fp32)", "but nothing (its list ends there) on rank 1");
}

TEST(CollectiveCaptureCheckTest, ASendWhoseReceiveDiffersIsAnError) {
  expect_every_rank_refuses(
      2,
      [](Context& ctx, Communicator& comm) {
        const Tensor x = ctx.persistent("x", f32(4, 4));
        CapturedStep::capture(ctx, [&] {
          if (comm.rank() == 0) {
            ops::send(ctx, comm, x, 1);
            return std::vector<Tensor>{};
          }
          return std::vector<Tensor>{ops::recv(ctx, comm, f32(4, 2), 0)};
        });
      },
      "send #0 from rank 0 to rank 1 is [[4, 4] fp32]", "the matching receive on rank 1 is [[4, 2] fp32]");
}

TEST(CollectiveCaptureCheckTest, ARingWithOneRankOutOfStepIsAnError) {
  expect_every_rank_refuses(
      3,
      [](Context& ctx, Communicator& comm) {
        const Tensor x = ctx.persistent("x", f32(4, 4));
        CapturedStep::capture(ctx, [&] {
          const int to = comm.rank() == 1 ? 0 : (comm.rank() + 1) % 3;  // rank 1 sends backwards
          return std::vector<Tensor>{ops::send_recv(ctx, comm, x, to, (comm.rank() + 2) % 3)};
        });
      },
      "send #0 from rank 1 to rank 0 is [[4, 4] fp32]", "the matching receive on rank 0 is nothing");
}

TEST(CollectiveOpsArgumentTest, BadCallsAreClearErrors) {
  HostWorld world(2);
  auto comm = world.communicator(0, "dp");
  Context ctx(Device::kHost, 2);
  const Tensor odd = ctx.persistent("odd", f32(3, 4));
  EXPECT_ERROR_CONTAINS(ops::reduce_scatter(ctx, *comm, odd, ReduceOp::kSum), "has 3 rows",
                        "not a multiple of the world size 2");
  EXPECT_ERROR_CONTAINS(ops::send(ctx, *comm, odd, 0), "peer must be another rank");
  EXPECT_ERROR_CONTAINS(ops::broadcast_(ctx, *comm, odd, 2), "root must be a rank in [0, 2)");
  const Tensor scalar = ctx.persistent("scalar", {Shape{}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(ops::all_gather(ctx, *comm, scalar), "at least one dimension");
  EXPECT_ERROR_CONTAINS(ctx.set_communication_stream(3), "a side stream in [1, 3)");
  EXPECT_ERROR_CONTAINS(ctx.set_communication_stream(0), "a side stream in [1, 3)");
}

}  // namespace
}  // namespace stepgraph
