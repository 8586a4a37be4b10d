// Interleaved (virtual) pipeline stages: V chunks a rank, Megatron's
// interleaved 1F1B order and TransformerEngine's signed form for it, the
// transfer groups between chunks, and the check that refuses orders that
// deadlock or send another tensor, on every rank. On host thread worlds
// (P = 2, V = 2 over 8 LayerNormMLP layers, M = 4; P = 4, V = 2 over 8 and 16
// layers, M = 8) the model's outputs, input gradients and gradient sums equal
// one rank running every layer bit for bit, eager and captured, two iterations.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/any_layer.h"
#include "layers/layernorm_mlp.h"
#include "train/interleaved_stage_pipeline.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"
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
constexpr int kIterations = 2;
const TensorMeta kActivation{Shape{kTokens, kHidden}, DType::kFloat32};

using pipeline_testing::Batches;
using pipeline_testing::Mode;
using pipeline_testing::mode_name;
using pipeline_testing::Results;
using Stack = pipeline_testing::MlpStack;

// Every rank's chunks over the iterations, merged into one Results per iteration.
std::vector<Results> pipelined(int stages, int chunks, std::size_t layer_count, std::int64_t microbatches,
                               const Batches& b, Mode mode) {
  std::vector<Results> out(kIterations);
  for (Results& r : out) {
    r.outputs.resize(microbatches);
    r.grad_inputs.resize(microbatches);
  }
  std::mutex mutex;
  HostWorld::run(stages, [&](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Stack stack(ctx, layer_count);
    InterleavedStagePipeline stage(ctx, comm, stack.layers(), chunks, microbatches, kActivation);
    EXPECT_EQ(stage.schedule().to_string(),
              InterleavedSchedule::interleaved_one_f_one_b(microbatches, stages, comm.rank(), chunks).to_string());
    std::vector<Tensor> x, dy, y(microbatches), dx(microbatches);
    for (std::int64_t m = 0; m < microbatches; ++m) {
      x.push_back(ctx.persistent("x." + std::to_string(m), kActivation));
      dy.push_back(ctx.persistent("dy." + std::to_string(m), kActivation));
    }
    auto iteration = [&] {
      std::vector<Tensor> results;
      for (const ChunkPass& p : stage.schedule().passes()) {
        const auto m = static_cast<std::size_t>(p.pass.microbatch);
        if (p.pass.kind == PipelinePass::Kind::kForward) {
          y[m] = stage.forward(ctx, p.chunk, p.pass.microbatch, stage.takes_model_input(p.chunk) ? x[m] : Tensor{});
          if (y[m].defined()) results.push_back(y[m]);
        } else {
          dx[m] = stage.backward(ctx, p.chunk, p.pass.microbatch,
                                 stage.takes_model_gradient(p.chunk) ? dy[m] : Tensor{});
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
      const std::size_t layer_graphs = stage.schedule().passes().size() * (layer_count / (stages * chunks));
      EXPECT_GT(step->segment_count(), layer_graphs);  // the transfer groups are graphs of their own
    }
    bool holds_first = false, holds_last = false;
    for (int c = 0; c < chunks; ++c) {
      holds_first = holds_first || stage.takes_model_input(c);
      holds_last = holds_last || stage.takes_model_gradient(c);
    }
    for (int it = 0; it < kIterations; ++it) {
      for (std::int64_t m = 0; m < microbatches; ++m) {
        write_floats(ctx, x[m], b.x[it][m]);
        write_floats(ctx, dy[m], b.dy[it][m]);
      }
      if (step) {
        step->replay();
        std::size_t k = 0;  // the step's outputs, in the order the iteration returned them
        for (const ChunkPass& p : stage.schedule().passes()) {
          const auto m = static_cast<std::size_t>(p.pass.microbatch);
          const bool forward = p.pass.kind == PipelinePass::Kind::kForward;
          if (forward && stage.takes_model_gradient(p.chunk)) y[m] = step->outputs().at(k++);
          if (!forward && stage.takes_model_input(p.chunk)) dx[m] = step->outputs().at(k++);
        }
      } else {
        (void)iteration();
      }
      std::lock_guard lock(mutex);
      Results& r = out[it];
      for (std::size_t m = 0; m < static_cast<std::size_t>(microbatches); ++m) {
        if (holds_last) r.outputs[m] = read_floats(ctx, y[m]);
        if (holds_first) r.grad_inputs[m] = read_floats(ctx, dx[m]);
      }
      const std::vector<Tensor> sums = stage.gradient_sums();
      for (std::size_t p = 0; p < stage.parameters().size(); ++p) {
        r.gradient_sums[stage.parameters()[p]->name] = read_floats(ctx, sums[p]);
      }
    }
  });
  return out;
}

void expect_interleaved_equals_one_rank(int stages, int chunks, std::size_t layer_count, std::int64_t microbatches) {
  testing::SeededRng rng;
  const Batches b = pipeline_testing::draw_batches(rng, kIterations, microbatches, kActivation.numel());
  const std::vector<Results> want = pipeline_testing::one_rank_reference(layer_count, microbatches, kActivation, b);
  for (const Mode mode : {Mode::kEager, Mode::kGraphed}) {
    SCOPED_TRACE(std::string(mode_name(mode)) + ", " + std::to_string(stages) + " stages x " +
                 std::to_string(chunks) + " chunks of " + std::to_string(layer_count) + " layers");
    const std::vector<Results> got = pipelined(stages, chunks, layer_count, microbatches, b, mode);
    for (int it = 0; it < kIterations; ++it) {
      SCOPED_TRACE("iteration " + std::to_string(it));
      for (std::size_t m = 0; m < static_cast<std::size_t>(microbatches); ++m) {
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

TEST(InterleavedStagePipelineTest, TwoStagesTwoChunksOfEightLayersEqualOneRankBitwise) {
  expect_interleaved_equals_one_rank(2, 2, 8, 4);
}

TEST(InterleavedStagePipelineTest, FourStagesTwoChunksOfEightLayersEqualOneRankBitwise) {
  expect_interleaved_equals_one_rank(4, 2, 8, 8);
}

TEST(InterleavedStagePipelineTest, FourStagesTwoChunksOfSixteenLayersEqualOneRankBitwise) {
  expect_interleaved_equals_one_rank(4, 2, 16, 8);
}

// Stage 1 runs every forward first: the same Error on both ranks, at
// construction, far below the world's timeout.
TEST(InterleavedStagePipelineTest, MismatchedInterleavedOrderIsAnErrorOnEveryRankInBoundedTime) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  HostWorld::run(
      2,
      [&](Communicator& comm) {
        Context ctx(Device::kHost);
        Stack stack(ctx, 8);
        InterleavedStagePipelineOptions options;
        if (comm.rank() == 1) {
          options.schedule =
              InterleavedSchedule::from_chunk_signed({1, 1, 2, 2, 1, 1, 2, 2, -2, -2, -1, -1, -2, -2, -1, -1}, 2);
        }
        try {
          InterleavedStagePipeline stage(ctx, comm, stack.layers(), 2, 4, kActivation, options);
        } catch (const Error& error) {
          std::lock_guard lock(mutex);
          errors[comm.rank()] = error.message();
        }
      },
      std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("pipeline stage schedules"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
  EXPECT_EQ(errors[0], errors[1]);
}

TEST(InterleavedStagePipelineTest, LayersThatDoNotSplitIntoChunksAreRefused) {
  EXPECT_ERROR_CONTAINS(InterleavedStagePipeline::chunk_layers(6, 0, 4), "6 layer(s)", "4 chunks");
  const InterleavedStagePipeline::LayerRange range = InterleavedStagePipeline::chunk_layers(16, 5, 8);
  EXPECT_EQ(range.first, 10u);
  EXPECT_EQ(range.last, 12u);
}

std::vector<InterleavedSchedule> interleaved(std::int64_t microbatches, int stages, int chunks) {
  std::vector<InterleavedSchedule> out;
  for (int s = 0; s < stages; ++s) {
    out.push_back(InterleavedSchedule::interleaved_one_f_one_b(microbatches, stages, s, chunks));
  }
  return out;
}

// Megatron's order for P = 2, V = 2, M = 4: stage 0 warms up with
// (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 forwards, stage 1 with 2.
TEST(InterleavedScheduleTest, MegatronOrderForTwoStagesTwoChunks) {
  EXPECT_EQ(InterleavedSchedule::interleaved_one_f_one_b(4, 2, 0, 2).to_string(),
            "c0F0 c0F1 c1F0 c1F1 c0F2 c1B0 c0F3 c1B1 c1F2 c0B0 c1F3 c0B1 c1B2 c1B3 c0B2 c0B3");
  EXPECT_EQ(InterleavedSchedule::interleaved_one_f_one_b(4, 2, 1, 2).to_string(),
            "c0F0 c0F1 c1F0 c1B0 c1F1 c1B1 c0F2 c0B0 c0F3 c0B1 c1F2 c1B2 c1F3 c1B3 c0B2 c0B3");
  // As many microbatches as stages: every forward first.
  EXPECT_EQ(InterleavedSchedule::interleaved_one_f_one_b(2, 2, 1, 2).to_string(),
            "c0F0 c0F1 c1F0 c1F1 c1B0 c1B1 c0B0 c0B1");
}

// Each chunk's backwards run in microbatch order 0, 1, ..., M - 1 (what
// makes the gradient sums equal one rank's: see the world tests).
TEST(InterleavedScheduleTest, EveryChunkRunsItsBackwardsInMicrobatchOrder) {
  for (const int stages : {2, 4}) {
    for (const int chunks : {1, 2, 3}) {
      for (const InterleavedSchedule& s : interleaved(2 * stages, stages, chunks)) {
        for (int c = 0; c < chunks; ++c) {
          std::int64_t next = 0;
          for (const PipelinePass& pass : s.chunk_schedule(c).passes()) {
            if (pass.kind == PipelinePass::Kind::kBackward) EXPECT_EQ(pass.microbatch, next++) << s.to_string();
          }
        }
      }
    }
  }
}

// TransformerEngine's `_order` names chunks, not microbatches.
TEST(InterleavedScheduleTest, TransformerEngineSignedFormRoundTrips) {
  const InterleavedSchedule megatron = InterleavedSchedule::interleaved_one_f_one_b(4, 2, 0, 2);
  const std::vector<std::int64_t> order = megatron.to_chunk_signed();
  EXPECT_EQ(order, (std::vector<std::int64_t>{1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1}));
  EXPECT_EQ(InterleavedSchedule::from_chunk_signed(order, 2).to_string(), megatron.to_string());
  EXPECT_ERROR_CONTAINS(InterleavedSchedule::from_chunk_signed({1, 3, -1, -3}, 2), "entry 1 is 3", "[1, 2]");
  EXPECT_ERROR_CONTAINS(InterleavedSchedule::from_chunk_signed({1, -1, -2, 2}, 2), "backward before its forward");
  EXPECT_ERROR_CONTAINS(InterleavedSchedule::from_chunk_signed({1, -1, 1, -1, 1, -1, 2, -2}, 2),
                        "chunk 0 runs 3 microbatch(es) but the schedule has 2");
  // A chunk whose passes run out of microbatch order has no signed form.
  const InterleavedSchedule swapped({{0, {PipelinePass::Kind::kForward, 1}},
                                     {0, {PipelinePass::Kind::kForward, 0}},
                                     {0, {PipelinePass::Kind::kBackward, 0}},
                                     {0, {PipelinePass::Kind::kBackward, 1}}},
                                    1);
  EXPECT_ERROR_CONTAINS(swapped.to_chunk_signed(), "c0F1 runs out of microbatch order");
}

TEST(InterleavedScheduleTest, MicrobatchesThatAreNotAMultipleOfTheStagesAreRefused) {
  EXPECT_ERROR_CONTAINS(InterleavedSchedule::interleaved_one_f_one_b(6, 4, 0, 2), "microbatches (6)",
                        "multiple of the stages (4)");
}

TEST(InterleavedStageCheckTest, InterleavedOneFOneBPairsEverySendWithItsReceive) {
  for (const int stages : {1, 2, 3, 4, 8}) {
    for (const int chunks : {1, 2, 3}) {
      for (const std::int64_t groups : {1, 2, 4}) {
        EXPECT_NO_THROW(check_interleaved_stage_schedules(interleaved(groups * stages, stages, chunks)))
            << stages << " stages, " << chunks << " chunks, " << groups * stages << " microbatches";
      }
    }
  }
}

TEST(InterleavedStageCheckTest, TransfersCrossChunksAndWrapToStageZero) {
  // P = 2, V = 2: the model's chunks 0..3 on stages 0, 1, 0, 1. Stage 1's
  // chunk 0 (model chunk 1) sends its activation to stage 0's chunk 1.
  const InterleavedTransfers plan =
      interleaved_transfer_plan(InterleavedSchedule::interleaved_one_f_one_b(4, 2, 1, 2), 1, 2);
  ASSERT_EQ(plan.groups.size(), plan.issued_before.size());
  ASSERT_GE(plan.groups.size(), 2u);
  EXPECT_EQ(plan.groups[0].at(0).to_string(), "recv F0 (chunk 0|1) from stage 0");
  EXPECT_EQ(plan.issued_before[0], 0u);
  EXPECT_EQ(plan.groups[1].at(0).to_string(), "send F0 (chunk 1|2) to stage 0");
  EXPECT_EQ(plan.groups[1].at(1).to_string(), "recv F1 (chunk 0|1) from stage 0");
  EXPECT_EQ(plan.issued_before[1], 1u);
  // Every group holds at most one send and one receive (one send_recv op).
  for (const StageTransferGroup& group : plan.groups) {
    int sends = 0, recvs = 0;
    for (const StageTransfer& t : group) (t.kind == StageTransfer::Kind::kSend ? sends : recvs)++;
    EXPECT_LE(sends, 1);
    EXPECT_LE(recvs, 1);
  }
}

// Orders that do not pair up: the check names the stuck or mismatched transfer.
TEST(InterleavedStageCheckTest, MismatchedInterleavedOrdersAreRefused) {
  std::vector<InterleavedSchedule> stages = interleaved(4, 2, 2);
  // Stage 1's own order, written in the signed form, pairs up.
  stages[1] = InterleavedSchedule::from_chunk_signed({1, 1, 2, -2, 2, -2, 1, -1, 1, -1, 2, -2, 2, -2, -1, -1}, 2);
  EXPECT_NO_THROW(check_interleaved_stage_schedules(stages));
  // Every forward first on stage 1.
  stages[1] = InterleavedSchedule::from_chunk_signed({1, 1, 2, 2, 1, 1, 2, 2, -2, -2, -1, -1, -2, -2, -1, -1}, 2);
  EXPECT_ERROR_CONTAINS(check_interleaved_stage_schedules(stages), "pipeline stage schedules", "interleaved_one_f_one_b");
  // Another stage's warmup on stage 0: every stage waits for another.
  stages = interleaved(8, 4, 2);
  stages[0] = InterleavedSchedule::interleaved_one_f_one_b(8, 4, 3, 2);
  EXPECT_ERROR_CONTAINS(check_interleaved_stage_schedules(stages), "deadlock", "stage 0");
  // Stage 1's chunk 0 takes microbatch 1's forward before 0's: stage 0 sends F0 where it receives F1.
  std::vector<ChunkPass> swapped = InterleavedSchedule::interleaved_one_f_one_b(4, 2, 1, 2).passes();
  std::swap(swapped[0], swapped[1]);
  stages = interleaved(4, 2, 2);
  stages[1] = InterleavedSchedule(swapped, 2);
  EXPECT_ERROR_CONTAINS(check_interleaved_stage_schedules(stages), "do not match",
                        "stage 0 sends F0 (chunk 0|1) to stage 1", "receives F1 (chunk 0|1)");
  // Different chunks or microbatches.
  EXPECT_ERROR_CONTAINS(check_interleaved_stage_schedules({InterleavedSchedule::interleaved_one_f_one_b(4, 2, 0, 2),
                                                           InterleavedSchedule::interleaved_one_f_one_b(4, 2, 1, 1)}),
                        "stage 0 runs 2 chunk(s)", "stage 1 runs 1");
}

}  // namespace
}  // namespace stepgraph
