// An expert-parallel training step never reads a count on the host.
//
// A captured step cannot read anything on the host: Context::copy_to_host
// (to_vector) and every op whose OpDef reads_to_host are Errors while
// tracing, since a device-to-host read would end a stream capture. So a
// TrainStep of an expert-parallel model (host thread worlds: EP 2, and
// EP 2 x DP 2) that captures proves it, and the test also checks what it
// captured:
//   - the step's counts are really in it, computed and consumed on the
//     device: every MoE block's counts of every rank (ep.counts,
//     all-gathered), read by the device ops of the exchanges, forward and
//     backward;
//   - no instruction of the program reads to the host;
//   - the step replays with new batches, new routing each time, and equals
//     the eager step bit for bit, with no host copy of any count taken;
// and the control: the same kind of step that also reads the counts on the
// host (ctx.to_vector of the MoE layer's ep_counts, as a layer reading its
// splits would) is refused at capture, naming the device-to-host copy, as
// is an op that reads to the host. On a GPU the same property holds for
// the CUDA graph (a device-to-host memcpy cannot be stream-captured); this
// host test does not inspect CUDA graph nodes.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "engine/op.h"
#include "graphs/captured_step.h"
#include "graphs/program.h"
#include "layers/moe_mlp.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/moe_train_rig.h"
#include "tests/support/seed.h"
#include "train/expert_data_parallel_groups.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = testing::kSmallMoeHidden;
constexpr std::int64_t kVocab = testing::kSmallMoeVocab;
constexpr std::int64_t kExperts = testing::kSmallMoeExperts;
constexpr std::int64_t kTokens = 8;  // a rank's
constexpr std::int64_t kLayers = 2;  // both MoE
constexpr int kReplays = 20;

// A rig over `ep` on kTokens of this rank's, both blocks MoE.
struct Rig : testing::MoeTrainRig<ResidualStack> {
  Rig(Context& ctx, Communicator* ep, const GradientGroups& sums)
      : MoeTrainRig(ctx, testing::small_moe_config(1), kTokens, ep, sums) {}
};

// The ids of the values of `program` named `name`.
std::vector<ValueId> values_named(const Program& program, const std::string& name) {
  std::vector<ValueId> out;
  for (const ValueInfo& value : program.values()) {
    if (value.name == name) out.push_back(value.id);
  }
  return out;
}
// The ops of the instructions that read value `id`, in program order.
std::vector<std::string> readers_of(const Program& program, ValueId id) {
  std::vector<std::string> out;
  for (const Instruction& instruction : program.instructions()) {
    for (const ValueId input : instruction.inputs) {
      if (input == id) {
        out.emplace_back(instruction.op->name);
        break;
      }
    }
  }
  return out;
}

// Captures the step, checks its program and replays it against eager.
void expect_captured_step_reads_nothing_on_the_host(int ep_size, int dp_size) {
  const testing::TestSeed seed;
  HostWorld::run(ep_size * dp_size, [&](Communicator& world) {
    const int w = world.rank();
    SCOPED_TRACE("rank " + std::to_string(w) + " of ep " + std::to_string(ep_size) + " x dp " +
                 std::to_string(dp_size));
    const ExpertDataParallelGroups groups = split_expert_data_parallel(world, ep_size);
    // EP alone: data_parallel is the EP group itself.
    Communicator* ep = dp_size == 1 ? &world : groups.expert_parallel.get();
    const GradientGroups sums =
        dp_size == 1
            ? GradientGroups{.data_parallel = &world}
            : GradientGroups{.data_parallel = &world, .expert_data_parallel = groups.expert_data_parallel.get()};
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Rig eager(ctx, ep, sums);
    Rig graphed(ctx, ep, sums);
    auto graph = CapturedStep::capture(
        ctx, [&] { return graphed.step(ctx); },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = graphed.step.communicators()});

    const Program& program = graph->program();
    for (const Instruction& instruction : program.instructions()) {
      EXPECT_FALSE(instruction.op->reads_to_host) << "op " << instruction.op->name << " reads to the host";
    }
    // The counts are in the step: per MoE block, every rank's per-expert
    // counts all-gathered on the device (ep.counts), read by the device ops
    // that plan and run the exchanges, forward and backward.
    const std::vector<ValueId> counts = values_named(program, "ep.counts");
    EXPECT_EQ(counts.size(), static_cast<std::size_t>(kLayers)) << "every MoE block's counts, on the device";
    for (const ValueId id : counts) {
      const std::vector<std::string> readers = readers_of(program, id);
      EXPECT_GE(readers.size(), 2u) << "the forward's and the backward's exchanges read the counts; readers: "
                                    << ::testing::PrintToString(readers);
    }
    std::mt19937 rng(seed.value() + 7919u * static_cast<std::uint32_t>(w));
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<std::int32_t> label(0, kVocab - 1);
    std::vector<float> x(kTokens * kHidden);
    std::vector<std::int32_t> labels(kTokens);
    for (int replay = 0; replay < kReplays; ++replay) {
      for (float& v : x) v = normal(rng);
      for (std::int32_t& l : labels) l = label(rng);
      for (Rig* rig : {&eager, &graphed}) {
        testing::write_floats(ctx, rig->step.inputs(), x);
        ctx.copy_from_host(rig->step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
      }
      const float want = ctx.to_vector<float>(eager.step(ctx)[0]).at(0);
      graph->replay();
      const float got = ctx.to_vector<float>(graph->outputs()[0]).at(0);
      ASSERT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << "replay " << replay << ": graph != eager";
    }
    graphed.step.check_errors(ctx);
  });
}

TEST(ExpertParallelHostRead, CapturedEp2TrainStepHoldsTheCountsOnTheDeviceAndReadsNothingOnTheHost) {
  expect_captured_step_reads_nothing_on_the_host(2, 1);
}

TEST(ExpertParallelHostRead, CapturedEp2Dp2TrainStepHoldsTheCountsOnTheDeviceAndReadsNothingOnTheHost) {
  expect_captured_step_reads_nothing_on_the_host(2, 2);
}

// The control: the same exchange with a host read of its counts inside the
// step, which is what a layer reading its splits on the host would do.
TEST(ExpertParallelHostRead, AStepThatReadsItsCountsOnTheHostIsRefusedAtCapture) {
  HostWorld::run(2, [](Communicator& ep) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    MoEMLP layer(ctx, "moe", {.hidden = kHidden, .ffn = 32, .experts = kExperts, .topk = 2, .dtype = DType::kFloat32},
                 23, nullptr, &ep);
    const Tensor x = ctx.persistent("x", {Shape{kTokens, kHidden}, DType::kFloat32});
    // Every rank throws at the same call, before the step's later collectives.
    EXPECT_ERROR_CONTAINS(CapturedStep::capture(ctx,
                                                [&] {
                                                  const MoEMLP::Forward f = layer.forward(ctx, {x});
                                                  [[maybe_unused]] const std::vector<std::int32_t> counts =
                                                      ctx.to_vector<std::int32_t>(f.saved.ep_counts);
                                                  return std::vector<Tensor>{f.y};
                                                },
                                                {.communicators = {&ep}}),
                          "reading tensor 'ep.counts' on the host needs a device-to-host copy",
                          "cannot happen while tracing");
  });
}

// An op that reads its result to the host: the other way a step could.
const OpDef& host_reading_op() {
  static const OpDef op{
      .name = "test_reads_to_host",
      .check = [](const OpParams&, std::span<const TensorMeta> inputs) { return std::vector<TensorMeta>{inputs[0]}; },
      .run_host =
          [](const OpParams&, const KernelArgs& args) {
            std::memcpy(args.outputs[0], args.inputs[0], static_cast<std::size_t>(args.input_metas[0].bytes()));
          },
      .reads_to_host = true};
  return op;
}

TEST(ExpertParallelHostRead, AnOpThatReadsToTheHostIsRefusedAtCapture) {
  Context ctx(Device::kHost);
  const Tensor counts = ctx.persistent("counts", {Shape{2, kExperts}, DType::kInt32});
  EXPECT_ERROR_CONTAINS(CapturedStep::capture(ctx, [&] { return ctx.call(host_reading_op(), NoParams{}, {counts}); }),
                        "op test_reads_to_host reads its result on the host", "cannot be captured");
}

}  // namespace
}  // namespace stepgraph
