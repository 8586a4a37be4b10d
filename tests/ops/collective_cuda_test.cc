// Collectives through real NCCL on one GPU (world size 1: NCCL cannot put two
// ranks of a communicator on one GPU; several ranks are tested on host thread
// worlds and on machines with several GPUs). The collectives are captured
// into a step's graph and replayed 1,000 times; with one rank every
// collective is an identity, so the result must equal the same step without
// them, bit for bit.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kRows = 256;
constexpr std::int64_t kCols = 512;

TensorMeta f32() { return {Shape{kRows, kCols}, DType::kFloat32}; }

std::unique_ptr<Communicator> single_rank() { return make_nccl_communicator(make_nccl_unique_id(), 0, 1); }

struct State {
  Tensor x, grad, acc;
};

State make_state(Context& ctx, const std::string& prefix) {
  State s{ctx.persistent(prefix + "x", f32()), ctx.persistent(prefix + "grad", f32()),
          ctx.persistent(prefix + "acc", f32())};
  std::vector<float> values(static_cast<std::size_t>(kRows * kCols));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 97) * 0.03125f - 1.0f;
  ctx.copy_from_host(s.x, values.data(), values.size() * sizeof(float));
  ctx.copy_from_host(s.grad, values.data(), values.size() * sizeof(float));
  return s;
}

// The step with or without its collectives (identities on one rank).
std::vector<Tensor> step(Context& ctx, Communicator* comm, const State& s) {
  Tensor y = ops::mul(ctx, s.x, s.x);
  if (comm != nullptr) {
    ops::all_reduce_(ctx, *comm, s.grad, ReduceOp::kSum);
    y = ops::all_reduce(ctx, *comm, y, ReduceOp::kMax);
    y = ops::all_gather(ctx, *comm, ops::reduce_scatter(ctx, *comm, y, ReduceOp::kSum));
    ops::broadcast_(ctx, *comm, s.x, 0);
  }
  ops::axpy_(ctx, s.acc, y, 0.5f);
  ops::axpy_(ctx, s.acc, s.grad, 0.25f);
  return {ops::sum(ctx, s.acc).set_name("acc")};
}

TEST(NcclCollectiveTest, NvlsStaysOffAndTheVersionIsKnown) {
  SG_SKIP_WITHOUT_GPU();
  auto comm = single_rank();
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);
  EXPECT_STREQ(nvls, "0");
  std::printf("NCCL %s, %s\n", nccl_version().c_str(), comm->describe().c_str());
  comm->check_health();
}

TEST(NcclCollectiveTest, EagerCollectivesOnOneRankAreIdentities) {
  SG_SKIP_WITHOUT_GPU();
  auto comm = single_rank();
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const State s = make_state(ctx, "");
  const std::vector<float> before = ctx.to_vector<float>(s.x);
  ops::all_reduce_(ctx, *comm, s.x, ReduceOp::kSum);
  EXPECT_EQ(ctx.to_vector<float>(s.x), before);
  EXPECT_EQ(ctx.to_vector<float>(ops::all_gather(ctx, *comm, s.x)), before);
  EXPECT_EQ(ctx.to_vector<float>(ops::reduce_scatter(ctx, *comm, s.x, ReduceOp::kSum)), before);
  const std::vector<std::string> exchanged = comm->exchange("hello", "test");
  ASSERT_EQ(exchanged.size(), 1u);
  EXPECT_EQ(exchanged[0], "hello");
}

TEST(NcclCollectiveTest, CapturedCollectivesReplayedAThousandTimesEqualTheStepWithout) {
  SG_SKIP_WITHOUT_GPU();
  auto comm = single_rank();
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const State with = make_state(ctx, "with.");
  const State without = make_state(ctx, "without.");
  auto graph_with =
      CapturedStep::capture(ctx, [&] { return step(ctx, comm.get(), with); },
                            {.pool_report_policy = PoolReportPolicy::kError, .communicators = {comm.get()}});
  auto graph_without = CapturedStep::capture(ctx, [&] { return step(ctx, nullptr, without); },
                                             {.pool_report_policy = PoolReportPolicy::kError});
  int on_comm_stream = 0;
  for (const Instruction& instruction : graph_with->program().instructions()) {
    if (instruction.op->collective != nullptr) on_comm_stream += instruction.stream == 2 ? 1 : 0;
  }
  EXPECT_EQ(on_comm_stream, 5);
  for (int i = 0; i < 1000; ++i) {
    graph_with->replay();
    graph_without->replay();
  }
  ctx.synchronize();
  comm->check_health();
  const std::vector<float> a = ctx.to_vector<float>(with.acc);
  const std::vector<float> b = ctx.to_vector<float>(without.acc);
  ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_EQ(ops::item(ctx, graph_with->outputs()[0]), ops::item(ctx, graph_without->outputs()[0]));
  EXPECT_NE(a[1], 0.0f);

  // The step profile of the captured step: every op timed on its stream, the
  // collectives on the communication stream.
  const StepProfile profile = graph_with->profile();
  std::printf("%s", profile.to_string().c_str());
  ASSERT_EQ(profile.ops.size(), graph_with->program().instructions().size());
  int collectives = 0;
  for (const ProfiledOp& op : profile.ops) {
    EXPECT_LE(op.start_us, op.end_us) << op.op;
    EXPECT_GE(op.start_us, 0.0) << op.op;
    if (op.collective) ++collectives;
  }
  EXPECT_EQ(collectives, 5);
  EXPECT_GT(profile.total_us, 0.0);
  EXPECT_GT(profile.stream_busy_us.at(0), 0.0);
  EXPECT_LE(profile.exposed_communication_us, profile.communication_us + 1e-9);
  graph_with->replay();  // the step replays as before after a profile
  ctx.synchronize();
}

TEST(NcclCollectiveTest, AHostCommunicatorCannotMoveCudaTensors) {
  SG_SKIP_WITHOUT_GPU();
  auto comm = single_rank();
  Context host(Device::kHost);
  const Tensor t = host.persistent("t", f32());
  EXPECT_ERROR_CONTAINS(ops::all_reduce_(host, *comm, t, ReduceOp::kSum), "cannot move host tensors");
}

}  // namespace
}  // namespace stepgraph
