// The step profile: its arithmetic (per-stream busy time, communication and
// the exposed part of it) on synthetic timings, and a real profile of a
// captured tensor-parallel step on a host world (the host runs the schedule in
// order, so every collective is exposed there).
#include "graphs/step_profile.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "graphs/planner.h"
#include "layers/layernorm_mlp.h"

namespace stepgraph {
namespace {

std::vector<TensorMeta> no_outputs(const OpParams&, std::span<const TensorMeta>) { return {}; }
CollectiveCall no_call(const OpParams&) { return {}; }

const OpDef kCompute{.name = "compute", .check = &no_outputs};
const OpDef kCollective{.name = "all_reduce_", .check = &no_outputs, .mutated_inputs = {0}, .collective = &no_call};

TEST(StepProfileTest, BusyTimeCommunicationAndExposedTimeFromTheIntervals) {
  Program program;
  const ValueId g = program.add_value("grad", {Shape{4}, DType::kFloat32}, ValueKind::kPersistent);
  const ValueId w = program.add_value("w", {Shape{4}, DType::kFloat32}, ValueKind::kPersistent);
  program.add_instruction({.op = &kCompute, .inputs = {w}, .stream = 0});
  program.add_instruction({.op = &kCollective, .inputs = {g}, .stream = 2});
  program.add_instruction({.op = &kCompute, .inputs = {w}, .stream = 1});
  const StepPlan plan = plan_step(program);
  // compute on stream 0 over [0, 10], the collective over [5, 20], compute on stream 1 over [12, 15]:
  // communication 15 us, of which [5, 10] and [12, 15] overlap compute: 7 us exposed.
  const StepProfile profile = build_step_profile(program, plan, {{{0, 10}, {5, 20}, {12, 15}}});
  ASSERT_EQ(profile.ops.size(), 3u);
  EXPECT_TRUE(profile.ops[1].collective);
  EXPECT_EQ(profile.ops[1].stream, 2);
  EXPECT_DOUBLE_EQ(profile.total_us, 20);
  ASSERT_EQ(profile.stream_busy_us.size(), 3u);
  EXPECT_DOUBLE_EQ(profile.stream_busy_us[0], 10);
  EXPECT_DOUBLE_EQ(profile.stream_busy_us[1], 3);
  EXPECT_DOUBLE_EQ(profile.stream_busy_us[2], 15);
  EXPECT_DOUBLE_EQ(profile.communication_us, 15);
  EXPECT_DOUBLE_EQ(profile.exposed_communication_us, 7);
  const std::vector<ProfiledOpTotal> totals = profile.by_op();
  ASSERT_EQ(totals.size(), 3u);  // compute on streams 0 and 1 are two rows
  EXPECT_EQ(totals[0].op, "all_reduce_");
  EXPECT_DOUBLE_EQ(totals[0].total_us, 15);
  EXPECT_EQ(totals[1].stream, 0);
  EXPECT_DOUBLE_EQ(totals[1].total_us, 10);
  EXPECT_EQ(totals[2].stream, 1);
  EXPECT_EQ(totals[2].count, 1);
  const std::string text = profile.to_string();
  EXPECT_NE(text.find("s2 all_reduce_"), std::string::npos) << text;
  EXPECT_NE(text.find("15.0 us  75.0%"), std::string::npos) << text;
  EXPECT_NE(text.find("communication 15.0 us, exposed 7.0 us (35% of the step)"), std::string::npos) << text;
  EXPECT_NE(text.find("all_reduce_  (collective)"), std::string::npos) << text;
}

TEST(StepProfileTest, SegmentsFollowOneAnother) {
  Program program;
  const ValueId w = program.add_value("w", {Shape{4}, DType::kFloat32}, ValueKind::kPersistent);
  program.add_instruction({.op = &kCompute, .inputs = {w}, .stream = 0});
  program.begin_segment("backward");
  program.add_instruction({.op = &kCompute, .inputs = {w}, .stream = 0});
  const StepPlan plan = plan_step(program);
  const StepProfile profile = build_step_profile(program, plan, {{{0, 4}}, {{1, 3}}});
  ASSERT_EQ(profile.ops.size(), 2u);
  EXPECT_DOUBLE_EQ(profile.ops[1].start_us, 5);  // after the first segment's 4 us
  EXPECT_DOUBLE_EQ(profile.total_us, 7);
  EXPECT_DOUBLE_EQ(profile.exposed_communication_us, 0);
}

// The schedule dump on the host: every instruction, its stream, the
// collectives marked; the host runs them one after another, so all of the
// communication is exposed.
TEST(StepProfileTest, AProfileOfACapturedTensorParallelStepOnTheHost) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LayerNormMLP layer(ctx, "mlp", {.hidden = 8, .ffn = 16, .dtype = DType::kFloat32}, 3, &comm);
    const Tensor x = ctx.persistent("x", {Shape{4, 8}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{4, 8}, DType::kFloat32});
    auto step = CapturedStep::capture(ctx,
                                      [&] {
                                        const LayerNormMLP::Forward f = layer.forward(ctx, {x});
                                        return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
                                      },
                                      {.communicators = {&comm}});
    const StepProfile profile = step->profile();
    ASSERT_EQ(profile.ops.size(), step->program().instructions().size());
    int collectives = 0;
    for (const ProfiledOp& op : profile.ops) {
      EXPECT_LE(op.start_us, op.end_us);
      if (!op.collective) continue;
      ++collectives;
      EXPECT_EQ(op.stream, 2) << op.op;
    }
    EXPECT_EQ(collectives, 5);  // all_gather, reduce_scatter; all_gather, reduce_scatter, all_reduce_many_
    EXPECT_DOUBLE_EQ(profile.exposed_communication_us, profile.communication_us);
    EXPECT_NE(profile.to_string().find("reduce_scatter  (collective)"), std::string::npos) << profile.to_string();
  });
}

}  // namespace
}  // namespace stepgraph
