// Conditional bodies (Context::run_if_zero; Note [Conditional bodies] in
// engine/backend.h): a captured step whose body each replay runs or skips
// by a device flag equals eager execution of the same step, bit for bit,
// with nothing recorded again; and what a body may not do is an Error at
// trace time. Host cases run everywhere; CUDA cases need a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "graphs/program_dump.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

struct State {
  Tensor x, acc, flag;
};

State make_state(Context& ctx, const std::string& prefix) {
  const TensorMeta meta{Shape{64, 48}, DType::kFloat32};
  State s{ctx.persistent(prefix + "x", meta), ctx.persistent(prefix + "acc", meta),
          ctx.persistent(prefix + "flag", {Shape{1}, DType::kInt32})};
  std::vector<float> values(static_cast<std::size_t>(meta.numel()));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.01f * static_cast<float>(i % 97) - 0.3f;
  ctx.copy_from_host(s.x, values.data(), values.size() * sizeof(float));
  return s;
}

// The body reads a side-stream value (the planner joins before it), keeps a
// value of its own, and updates a persistent tensor that the side stream
// reads after it (its event is recorded after the body).
std::vector<Tensor> step(Context& ctx, const State& s) {
  const Tensor y = ops::mul(ctx, s.x, s.x);
  Tensor side;
  {
    StreamScope scope(ctx, 1);
    side = ops::axpy(ctx, y, s.x, 0.5f);
  }
  ctx.run_if_zero(s.flag, [&] {
    const Tensor t = ops::add(ctx, side, y);
    ops::axpy_(ctx, s.acc, t, 0.25f);
    ops::axpy_(ctx, s.x, t, -0.125f);
  });
  Tensor total;
  {
    StreamScope scope(ctx, 1);
    total = ops::sum(ctx, s.acc);
  }
  return {total, ops::sum(ctx, y)};
}

// The step raises an Error naming `words`.
template <typename Call>
void expect_error(Call&& call, std::string_view words) {
  EXPECT_TRUE(testing::raises_error_containing("the call", call, {words}));
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void set_flag(Context& ctx, const Tensor& flag, std::int32_t value) {
  ctx.copy_from_host(flag, &value, sizeof(value));
}

// `replays` steps with flags drawn at random, eager and graphed from equal
// states; the same bits after every step, no recording after the capture.
void expect_graph_equals_eager(Device device, int replays) {
  testing::SeededRng rng;
  Context ctx(device, /*side_streams=*/1);
  const State eager = make_state(ctx, "eager.");
  const State graph = make_state(ctx, "graph.");
  auto captured = CapturedStep::capture(
      ctx, [&] { return step(ctx, graph); }, {.pool_report_policy = PoolReportPolicy::kError});
  const std::int64_t recordings = CapturedStep::total_recordings();
  std::bernoulli_distribution skip(0.3);
  int skipped = 0;
  for (int r = 0; r < replays; ++r) {
    const std::int32_t flag = skip(rng) ? 1 + r % 3 : 0;  // any nonzero value skips
    skipped += flag != 0;
    set_flag(ctx, eager.flag, flag);
    set_flag(ctx, graph.flag, flag);
    const std::vector<Tensor> want = step(ctx, eager);
    captured->replay();
    ASSERT_TRUE(same_bits(ctx.to_vector<float>(want[0]), ctx.to_vector<float>(captured->outputs()[0])))
        << "replay " << r << " (flag " << flag << ")";
    if (r % 50 == 0 || r + 1 == replays) {
      ASSERT_TRUE(same_bits(ctx.to_vector<float>(eager.x), ctx.to_vector<float>(graph.x))) << "replay " << r;
      ASSERT_TRUE(same_bits(ctx.to_vector<float>(eager.acc), ctx.to_vector<float>(graph.acc))) << "replay " << r;
    }
  }
  EXPECT_EQ(CapturedStep::total_recordings(), recordings);
  EXPECT_GT(skipped, 0);
  EXPECT_LT(skipped, replays);
}

TEST(ConditionalBodyHostTest, GraphEqualsEagerWhateverTheFlags) { expect_graph_equals_eager(Device::kHost, 200); }

TEST(ConditionalBodyCudaTest, GraphEqualsEagerOverThousandReplaysWithRandomFlags) {
  SG_SKIP_WITHOUT_GPU();
  expect_graph_equals_eager(Device::kCuda, 1000);
}

TEST(ConditionalBodyHostTest, ASkippedBodyLeavesItsTensorsUnchanged) {
  Context ctx(Device::kHost, 1);
  const State s = make_state(ctx, "");
  const std::vector<float> x_before = ctx.to_vector<float>(s.x);
  auto captured = CapturedStep::capture(ctx, [&] { return step(ctx, s); });
  set_flag(ctx, s.flag, 1);
  captured->replay();
  EXPECT_TRUE(same_bits(ctx.to_vector<float>(s.x), x_before));
  EXPECT_EQ(ctx.to_vector<float>(s.acc), std::vector<float>(64 * 48, 0.0f));
  set_flag(ctx, s.flag, 0);
  captured->replay();
  EXPECT_FALSE(same_bits(ctx.to_vector<float>(s.x), x_before));
}

TEST(ConditionalBodyHostTest, ThePlanJoinsBeforeTheBodyAndDumpsIt) {
  Context ctx(Device::kHost, 1);
  const State s = make_state(ctx, "");
  auto captured = CapturedStep::capture(ctx, [&] { return step(ctx, s); });
  const StepPlan& plan = captured->plan();
  bool in_body = false;
  int bodies = 0;
  for (const ScheduleEntry& entry : plan.schedule) {
    if (entry.kind == ScheduleEntry::Kind::kIfZeroBegin) in_body = true, ++bodies;
    if (entry.kind == ScheduleEntry::Kind::kIfEnd) in_body = false;
    if (in_body) {
      EXPECT_NE(entry.kind, ScheduleEntry::Kind::kRecord);
      EXPECT_NE(entry.kind, ScheduleEntry::Kind::kWait);
      EXPECT_EQ(entry.stream, 0);
    }
  }
  EXPECT_EQ(bodies, 1);
  const std::string dump = dump_program(captured->program(), &plan);
  EXPECT_NE(dump.find("if_zero_begin"), std::string::npos) << dump;
  EXPECT_NE(dump.find("  }\n"), std::string::npos) << dump;
}

TEST(ConditionalBodyHostTest, WhatABodyMayNotDoIsAnError) {
  Context ctx(Device::kHost, 1);
  const State s = make_state(ctx, "");
  expect_error(
      [&] {
        CapturedStep::capture(ctx, [&] {
          Tensor made;
          ctx.run_if_zero(s.flag, [&] { made = ops::mul(ctx, s.x, s.x); });
          return std::vector<Tensor>{ops::sum(ctx, made)};
        });
      },
      "made inside a run_if_zero body");
  expect_error(
      [&] {
        CapturedStep::capture(ctx, [&] {
          Tensor made;
          ctx.run_if_zero(s.flag, [&] { made = ops::mul(ctx, s.x, s.x); });
          return std::vector<Tensor>{made};
        });
      },
      "made inside a run_if_zero body");
  expect_error(
      [&] {
        CapturedStep::capture(ctx, [&] {
          ctx.run_if_zero(s.flag, [&] { ctx.run_if_zero(s.flag, [&] { ops::axpy_(ctx, s.acc, s.x, 1.0f); }); });
          return std::vector<Tensor>{ops::sum(ctx, s.acc)};
        });
      },
      "do not nest");
  expect_error(
      [&] {
        CapturedStep::capture(ctx, [&] {
          ctx.run_if_zero(s.flag, [&] { ctx.begin_segment("second"); });
          return std::vector<Tensor>{ops::sum(ctx, s.acc)};
        });
      },
      "stays in one segment");
  expect_error([&] { ctx.run_if_zero(s.x, [] {}); }, "must be an int32 tensor of one element");
}

TEST(ConditionalBodyHostTest, CollectivesInsideABodyAreAnError) {
  HostWorld::run(1, [](Communicator& comm) {
    Context ctx(Device::kHost, 1);
    const State s = make_state(ctx, "");
    expect_error(
        [&] {
          CapturedStep::capture(ctx, [&] {
            ctx.run_if_zero(s.flag, [&] { ops::all_reduce_(ctx, comm, s.acc, ReduceOp::kSum); });
            return std::vector<Tensor>{ops::sum(ctx, s.acc)};
          });
        },
        "collective inside a run_if_zero body");
  });
}

TEST(ConditionalBodyHostTest, EagerReadsTheFlagAndRunsOrSkips) {
  Context ctx(Device::kHost, 1);
  const State s = make_state(ctx, "");
  int calls = 0;
  ctx.run_if_zero(s.flag, [&] { ++calls; });
  set_flag(ctx, s.flag, 7);
  ctx.run_if_zero(s.flag, [&] { ++calls; });
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace stepgraph
