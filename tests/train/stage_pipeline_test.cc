// Pipeline stages across ranks: a stack of LayerNormMLP layers split into
// P = 2 and P = 4 stages on the ranks of a host thread world, each stage in
// its own 1F1B order with activations and gradients by send/recv, equals one
// rank running all layers on the same microbatches bit for bit: the last
// stage's outputs, the first stage's input gradients and every parameter's
// gradient summed over the microbatches; eager and captured alike, over two
// iterations. Stage schedules that do not pair up are an Error on every rank
// before any transfer.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/any_layer.h"
#include "layers/layernorm_mlp.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"
#include "train/stage_pipeline.h"
#include "train/stage_schedule_check.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"
#include "tests/train/pipeline_test_model.h"

namespace stepgraph {
namespace {

using testing::bits;
using testing::read_floats;
using testing::write_floats;

constexpr std::int64_t kHidden = 32;
constexpr std::int64_t kTokens = 8;
constexpr std::int64_t kMicrobatches = 4;
constexpr int kIterations = 2;
const TensorMeta kActivation{Shape{kTokens, kHidden}, DType::kFloat32};

using pipeline_testing::Batches;
using pipeline_testing::Mode;
using pipeline_testing::mode_name;
using pipeline_testing::Results;
using Stack = pipeline_testing::MlpStack;

// Every rank's stage over the iterations; the ranks' parts merged into one
// Results per iteration (outputs from the last stage, input gradients from
// the first, each stage's parameters).
std::vector<Results> pipelined(int stages, std::size_t layer_count, const Batches& b, Mode mode) {
  std::vector<Results> out(kIterations);
  for (Results& r : out) {
    r.outputs.resize(kMicrobatches);
    r.grad_inputs.resize(kMicrobatches);
  }
  std::mutex mutex;
  HostWorld::run(stages, [&](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Stack stack(ctx, layer_count);
    StagePipeline stage(ctx, comm, stack.layers(), kMicrobatches, kActivation);
    EXPECT_EQ(stage.schedule().to_string(),
              PipelineSchedule::one_f_one_b(kMicrobatches, stages - 1 - comm.rank()).to_string());
    std::vector<Tensor> x, dy, y(kMicrobatches), dx(kMicrobatches);
    for (std::int64_t m = 0; m < kMicrobatches; ++m) {
      x.push_back(ctx.persistent("x." + std::to_string(m), kActivation));
      dy.push_back(ctx.persistent("dy." + std::to_string(m), kActivation));
    }
    // One iteration: every pass of this stage's schedule.
    auto iteration = [&] {
      std::vector<Tensor> results;
      for (const PipelinePass& pass : stage.schedule().passes()) {
        const auto m = static_cast<std::size_t>(pass.microbatch);
        if (pass.kind == PipelinePass::Kind::kForward) {
          y[m] = stage.forward(ctx, pass.microbatch, stage.is_first() ? x[m] : Tensor{});
          if (y[m].defined()) results.push_back(y[m]);
        } else {
          dx[m] = stage.backward(ctx, pass.microbatch, stage.is_last() ? dy[m] : Tensor{});
          if (dx[m].defined()) results.push_back(dx[m]);
        }
      }
      return results;
    };
    std::shared_ptr<CapturedStep> step;
    if (mode == Mode::kGraphed) {
      CaptureOptions options;
      options.pool_report_policy = PoolReportPolicy::kError;
      options.communicators = {&comm};
      step = CapturedStep::capture(ctx, iteration, options);
      // The send/recv groups are graphs of their own beside each layer's.
      const std::size_t layer_graphs = stage.schedule().passes().size() * (layer_count / stages);
      if (stages > 1) EXPECT_GT(step->segment_count(), layer_graphs);
      else EXPECT_EQ(step->segment_count(), layer_graphs);
    }
    for (int it = 0; it < kIterations; ++it) {
      for (std::int64_t m = 0; m < kMicrobatches; ++m) {
        write_floats(ctx, x[m], b.x[it][m]);
        write_floats(ctx, dy[m], b.dy[it][m]);
      }
      if (step) {
        step->replay();
        std::size_t k = 0;  // the step's outputs, in the order the iteration returned them
        for (const PipelinePass& pass : stage.schedule().passes()) {
          const auto m = static_cast<std::size_t>(pass.microbatch);
          const bool forward = pass.kind == PipelinePass::Kind::kForward;
          if (forward && stage.is_last()) y[m] = step->outputs().at(k++);
          if (!forward && stage.is_first()) dx[m] = step->outputs().at(k++);
        }
      } else {
        (void)iteration();
      }
      std::lock_guard lock(mutex);
      Results& r = out[it];
      for (std::size_t m = 0; m < static_cast<std::size_t>(kMicrobatches); ++m) {
        if (stage.is_last()) r.outputs[m] = read_floats(ctx, y[m]);
        if (stage.is_first()) r.grad_inputs[m] = read_floats(ctx, dx[m]);
      }
      for (std::size_t p = 0; p < stage.parameters().size(); ++p) {
        r.gradient_sums[stage.parameters()[p]->name] = read_floats(ctx, stage.gradient_sums()[p]);
      }
    }
  });
  return out;
}

void expect_pipeline_equals_one_rank(int stages, std::size_t layer_count) {
  testing::SeededRng rng;
  const Batches b = pipeline_testing::draw_batches(rng, kIterations, kMicrobatches, kActivation.numel());
  const std::vector<Results> want = pipeline_testing::one_rank_reference(layer_count, kMicrobatches, kActivation, b);
  for (const Mode mode : {Mode::kEager, Mode::kGraphed}) {
    SCOPED_TRACE(std::string(mode_name(mode)) + ", " + std::to_string(stages) + " stages of " +
                 std::to_string(layer_count) + " layers");
    const std::vector<Results> got = pipelined(stages, layer_count, b, mode);
    for (int it = 0; it < kIterations; ++it) {
      SCOPED_TRACE("iteration " + std::to_string(it));
      for (std::size_t m = 0; m < static_cast<std::size_t>(kMicrobatches); ++m) {
        EXPECT_EQ(bits(got[it].outputs[m]), bits(want[it].outputs[m])) << "output of microbatch " << m;
        EXPECT_EQ(bits(got[it].grad_inputs[m]), bits(want[it].grad_inputs[m])) << "input gradient of microbatch " << m;
      }
      ASSERT_EQ(got[it].gradient_sums.size(), want[it].gradient_sums.size());
      for (const auto& [name, sum] : want[it].gradient_sums) {
        ASSERT_EQ(got[it].gradient_sums.count(name), 1u) << name << " is on no stage";
        EXPECT_EQ(bits(got[it].gradient_sums.at(name)), bits(sum)) << name << "'s gradient sum";
      }
    }
  }
}

// One stage holds every layer and sends nothing.
TEST(StagePipelineTest, OneStageEqualsOneRankBitwise) { expect_pipeline_equals_one_rank(1, 2); }

TEST(StagePipelineTest, TwoStagesOfFourLayersEqualOneRankBitwise) { expect_pipeline_equals_one_rank(2, 4); }

TEST(StagePipelineTest, FourStagesOfEightLayersEqualOneRankBitwise) { expect_pipeline_equals_one_rank(4, 8); }

TEST(StagePipelineTest, OneFOneBPerStagePairsEverySendWithItsReceive) {
  for (const int stages : {1, 2, 3, 4, 8}) {
    for (const std::int64_t microbatches : {1, 2, 4, 7, 16}) {
      std::vector<PipelineSchedule> schedules;
      for (int s = 0; s < stages; ++s) schedules.push_back(PipelineSchedule::one_f_one_b(microbatches, stages - 1 - s));
      EXPECT_NO_THROW(check_stage_schedules(schedules)) << stages << " stages, " << microbatches << " microbatches";
    }
  }
  // Every forward before every backward pairs up too (each stage waits only on its predecessor's forwards).
  EXPECT_NO_THROW(check_stage_schedules(std::vector<PipelineSchedule>(4, PipelineSchedule::all_forward_all_backward(4))));
}

TEST(StagePipelineTest, TransfersAreGroupedWithTheNextPassesInput) {
  // Stage 1 of 2 (the last): receives F0, then sends B0 with receiving F1, ...
  const std::vector<StageTransferGroup> groups = stage_transfers(PipelineSchedule::one_f_one_b(2, 0), 1, 2);
  ASSERT_EQ(groups.size(), 3u);  // {recv F0}, {send B0, recv F1}, {send B1}
  EXPECT_EQ(groups[0].at(0).to_string(), "recv F0 from stage 0");
  EXPECT_EQ(groups[1].at(0).to_string(), "send B0 to stage 0");
  EXPECT_EQ(groups[1].at(1).to_string(), "recv F1 from stage 0");
  EXPECT_EQ(groups[2].at(0).to_string(), "send B1 to stage 0");
}

// Stage 0 in 1F1B against stage 1 in all-forward-all-backward: between the
// two the sends and receives are the same tensors in the same order (what the
// capture uniformity check compares), yet stage 0 waits for B0 while stage 1
// waits for F2.
TEST(StagePipelineTest, SchedulesThatDeadlockAreRefused) {
  EXPECT_ERROR_CONTAINS(check_stage_schedules({PipelineSchedule::one_f_one_b(4, 1),
                                               PipelineSchedule::all_forward_all_backward(4)}),
                        "deadlock", "stage 0", "stage 1", "one_f_one_b");
  // The warmups swapped: the last stage would wait for backwards no one sends.
  EXPECT_ERROR_CONTAINS(check_stage_schedules({PipelineSchedule::one_f_one_b(4, 0),
                                               PipelineSchedule::one_f_one_b(4, 1)}),
                        "deadlock");
}

TEST(StagePipelineTest, SchedulesThatSendAnotherMicrobatchAreRefused) {
  EXPECT_ERROR_CONTAINS(check_stage_schedules({PipelineSchedule::from_signed({1, 2, -1, -2}),
                                               PipelineSchedule::from_signed({2, -2, 1, -1})}),
                        "do not match", "stage 0 sends F0", "receives F1");
}

// On a world the mismatch is the same Error on every rank, raised at
// construction (before any transfer) instead of a wait until the world's
// timeout: the body's timeout here is far above what the test takes.
TEST(StagePipelineTest, MismatchedScheduleIsAnErrorOnEveryRankInBoundedTime) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  HostWorld::run(
      2,
      [&](Communicator& comm) {
        Context ctx(Device::kHost);
        Stack stack(ctx, 4);
        StagePipelineOptions options;
        if (comm.rank() == 1) options.schedule = PipelineSchedule::all_forward_all_backward(kMicrobatches);
        try {
          StagePipeline stage(ctx, comm, stack.layers(), kMicrobatches, kActivation, options);
        } catch (const Error& error) {
          std::lock_guard lock(mutex);
          errors[comm.rank()] = error.message();
        }
      },
      std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("deadlock"), std::string::npos) << "rank " << r << ": " << errors[r];
  EXPECT_EQ(errors[0], errors[1]);
}

TEST(StagePipelineTest, LayersThatDoNotSplitEvenlyAreRefused) {
  EXPECT_ERROR_CONTAINS(StagePipeline::stage_layers(6, 0, 4), "6 layer(s)", "4 pipeline stages");
  EXPECT_ERROR_CONTAINS(StagePipeline::stage_layers(2, 0, 4), "2 layer(s)", "4 pipeline stages");
  const StagePipeline::LayerRange range = StagePipeline::stage_layers(8, 2, 4);
  EXPECT_EQ(range.first, 4u);
  EXPECT_EQ(range.last, 6u);
}

TEST(StagePipelineTest, PassesOutOfOrderAndMisplacedInputsAreRefused) {
  std::mutex mutex;
  std::vector<std::string> errors;
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    Stack stack(ctx, 2);
    StagePipeline stage(ctx, comm, stack.layers(), kMicrobatches, kActivation);
    const Tensor x = ctx.persistent("x", kActivation);
    std::vector<std::string> mine;
    auto note = [&](auto&& call) {
      try {
        call();
        mine.push_back("no error");
      } catch (const Error& error) {
        mine.push_back(error.message());
      }
    };
    note([&] { (void)stage.forward(ctx, 1, stage.is_first() ? x : Tensor{}); });  // F0 comes first
    note([&] { (void)stage.forward(ctx, 0, stage.is_first() ? Tensor{} : x); });  // x where it must not be
    std::lock_guard lock(mutex);
    errors.insert(errors.end(), mine.begin(), mine.end());
  });
  ASSERT_EQ(errors.size(), 4u);
  for (const std::string& e : errors) EXPECT_EQ(e.find("no error"), std::string::npos) << e;
  bool saw_order = false, saw_x = false, saw_no_x = false;
  for (const std::string& e : errors) {
    saw_order = saw_order || e.find("F1 is not the schedule's next pass, F0") != std::string::npos;
    saw_x = saw_x || e.find("stage 0 needs microbatch 0's input x") != std::string::npos;
    saw_no_x = saw_no_x || e.find("pass no x") != std::string::npos;
  }
  EXPECT_TRUE(saw_order && saw_x && saw_no_x) << errors[0] << "\n" << errors[1] << "\n" << errors[2] << "\n" << errors[3];
}

}  // namespace
}  // namespace stepgraph
