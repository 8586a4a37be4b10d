// Interleaved (virtual) pipeline stages: V chunks a rank, Megatron's
// interleaved 1F1B order and TransformerEngine's signed form for it, the
// transfer groups between chunks, and the check that refuses orders that
// deadlock or send another tensor, on every rank.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "train/pipeline_schedule.h"
#include "train/stage_schedule_check.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

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
  // Different chunks or microbatches.
  EXPECT_ERROR_CONTAINS(check_interleaved_stage_schedules({InterleavedSchedule::interleaved_one_f_one_b(4, 2, 0, 2),
                                                           InterleavedSchedule::interleaved_one_f_one_b(4, 2, 1, 1)}),
                        "stage 0 runs 2 chunk(s)", "stage 1 runs 1");
}

}  // namespace
}  // namespace stepgraph
