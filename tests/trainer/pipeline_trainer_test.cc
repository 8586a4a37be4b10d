// The trainer's pipeline parallelism (--pp, --virtual-stages,
// --microbatches) on host thread worlds, through the same train() the
// trainer's ranks run: eager against graph and every rank against rank 0 bit
// for bit, the stages against one rank without --pp, resume against an
// uninterrupted run, and the flags it refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_set.h"
#include "engine/host_world.h"
#include "tests/support/expect_error.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/world_runs.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

using testing::SmallModel;

constexpr int kSteps = 10;

// Unresolved: `model`'s flags for kSteps steps in fp32 (global batch 16 examples or 8 sequences).
TrainerOptions flags(SmallModel model) {
  TrainerOptions o =
      testing::small_model_flags(model, {.steps = kSteps, .log_every = 5, .dtype = DType::kFloat32, .seed = 7});
  o.batch = model == SmallModel::kWindow ? 16 : 8;
  return o;
}

// `o` at --pp `pp` (and `edit`ed), resolved.
TrainerOptions pipelined(TrainerOptions o, std::int64_t pp, std::int64_t microbatches = 0,
                         std::int64_t virtual_stages = 1) {
  o.pp = pp;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  return resolve_defaults(o, Device::kHost);
}

// `o` without --pp, on one rank: the reference. The pipeline has no
// non-finite skip, so neither has the reference (a finite step's update is the same either way).
std::vector<float> one_rank(TrainerOptions o) {
  o.skip_nonfinite = false;
  std::ostringstream log;
  return train(resolve_defaults(o, Device::kHost), Device::kHost, log).losses;
}

using testing::bits;
using testing::train_ranks;
using testing::worst_relative;
using testing::WorldLosses;

WorldLosses expect_every_rank_and_mode_agree(const TrainerOptions& o, int ranks) {
  return testing::expect_every_rank_and_mode_agree(o, ranks, kSteps);
}

class PipelineTrainerTest : public ::testing::TestWithParam<SmallModel> {};

// One microbatch: the stages run the ops one rank runs on the whole batch,
// on the same operands (the loss scaled by 1 / M = 1, each gradient "summed"
// over one microbatch: a copy), so the losses are one rank's bit for bit.
TEST_P(PipelineTrainerTest, TwoStagesOfOneMicrobatchEqualOneRankBitForBit) {
  const WorldLosses run = expect_every_rank_and_mode_agree(pipelined(flags(GetParam()), 2, 1), 2);
  EXPECT_EQ(bits(run.losses[0]), bits(one_rank(flags(GetParam()))));
  EXPECT_NE(run.log.find("pipeline parallel: 2 stages"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("1 microbatches"), std::string::npos) << run.log;
}

// Several microbatches: the step's loss is the sum of the microbatches'
// means times 1 / M, and each gradient the sum of the microbatches'
// gradients, where one rank takes one mean and one GEMM over all rows: the
// same terms added in another order, so the stages equal one rank to fp32
// rounding (1e-5 relative over 10 steps leaves room for AdamW to amplify a
// last-bit difference; a microbatch trained twice or left out, or a wrong
// scale, is off by 1e-2 and more).
TEST_P(PipelineTrainerTest, TwoStagesOfTheDefaultMicrobatchesEqualOneRank) {
  const WorldLosses run = expect_every_rank_and_mode_agree(pipelined(flags(GetParam()), 2), 2);
  EXPECT_NE(run.log.find("4 microbatches"), std::string::npos) << "the default is 2 x --pp:\n" << run.log;
  EXPECT_NE(run.log.find("1F1B"), std::string::npos) << run.log;
  const std::vector<float> want = one_rank(flags(GetParam()));
  const double worst = worst_relative(run.losses[0], want);
  EXPECT_LE(worst, 1e-5);
  EXPECT_LT(run.losses[0].back(), run.losses[0].front());
  std::printf("pp 2, 4 microbatches: largest relative loss difference to one rank over %d steps: %.3g\n", kSteps,
              worst);
}

INSTANTIATE_TEST_SUITE_P(Models, PipelineTrainerTest, ::testing::Values(SmallModel::kWindow, SmallModel::kSequence),
                         [](const auto& info) { return info.param == SmallModel::kWindow ? "window" : "gpt"; });

// Pipelining changes no sum's order (Note [The GPT in pipeline stages]):
// 2 stages, 2 stages of 2 interleaved chunks and 4 stages all add every
// gradient over the microbatches 0, 1, ..., M - 1 and run the same ops on
// the same operands, so on the same 4 microbatches they agree bit for bit.
TEST(PipelineTrainerScheduleTest, InterleavedChunksAndFourStagesEqualTwoStagesBitForBit) {
  TrainerOptions o = flags(SmallModel::kSequence);
  o.layers = 4;
  const WorldLosses two = expect_every_rank_and_mode_agree(pipelined(o, 2, 4), 2);
  const WorldLosses interleaved = expect_every_rank_and_mode_agree(pipelined(o, 2, 4, 2), 2);
  EXPECT_NE(interleaved.log.find("2 chunks a rank, 4 microbatches of 2 sequences, interleaved 1F1B"), std::string::npos)
      << interleaved.log;
  EXPECT_NE(interleaved.log.find("holds blocks [0, 1) and [2, 3), the embedding"), std::string::npos)
      << interleaved.log;
  const WorldLosses four = expect_every_rank_and_mode_agree(pipelined(o, 4, 4), 4);
  EXPECT_EQ(bits(interleaved.losses[0]), bits(two.losses[0])) << "--virtual-stages 2";
  EXPECT_EQ(bits(four.losses[0]), bits(two.losses[0])) << "--pp 4";
}

// --pp 2 x --dp 2 on 4 ranks (the window model) and --pp 2 x --tp 2 on 4
// ranks (the GPT, its heads, ffn and vocabulary split): against one rank on
// the same global batch. Tolerance as above: the same fp32 terms in another
// order (the microbatches, the replicas' all-reduce, the TP partial sums).
TEST(PipelineTrainerWorldsTest, TwoStagesTimesTwoReplicasEqualOneRank) {
  const WorldLosses run = expect_every_rank_and_mode_agree(pipelined(flags(SmallModel::kWindow), 2, 2), 4);
  EXPECT_NE(run.log.find("summed over its 2 replicas"), std::string::npos) << run.log;
  const double worst = worst_relative(run.losses[0], one_rank(flags(SmallModel::kWindow)));
  EXPECT_LE(worst, 1e-5);
  std::printf("pp 2 x dp 2: largest relative loss difference to one rank over %d steps: %.3g\n", kSteps, worst);
}

TEST(PipelineTrainerWorldsTest, TwoStagesTimesTwoTensorParallelRanksEqualOneRank) {
  TrainerOptions o = flags(SmallModel::kSequence);
  o.tp = 2;
  const WorldLosses run = expect_every_rank_and_mode_agree(pipelined(o, 2, 2), 4);
  const double worst = worst_relative(run.losses[0], one_rank(flags(SmallModel::kSequence)));
  EXPECT_LE(worst, 1e-5);
  std::printf("pp 2 x tp 2: largest relative loss difference to one rank over %d steps: %.3g\n", kSteps, worst);
}

// Interleaved chunks in the 2-D worlds: 2 stages of 2 chunks x 2 replicas
// (the window model) and x 2 tensor-parallel ranks (the GPT), 4 blocks,
// against one rank. Tolerance as above.
TEST(PipelineTrainerWorldsTest, InterleavedChunksTimesTwoReplicasOrTwoTensorParallelRanksEqualOneRank) {
  TrainerOptions window = flags(SmallModel::kWindow);
  window.layers = 4;
  const WorldLosses replicas = expect_every_rank_and_mode_agree(pipelined(window, 2, 2, 2), 4);
  EXPECT_LE(worst_relative(replicas.losses[0], one_rank(window)), 1e-5);
  TrainerOptions gpt = flags(SmallModel::kSequence);
  gpt.layers = 4;
  TrainerOptions tensor = gpt;
  tensor.tp = 2;
  const WorldLosses sharded = expect_every_rank_and_mode_agree(pipelined(tensor, 2, 2, 2), 4);
  EXPECT_LE(worst_relative(sharded.losses[0], one_rank(gpt)), 1e-5);
}

// Trains `o` on `ranks` uninterrupted, then to step 4 with a checkpoint and
// on from it: every rank's resumed losses equal the uninterrupted run's.
// Returns the resumed run's options.
TrainerOptions expect_resume_equals_uninterrupted(const TrainerOptions& o, int ranks, const std::string& name) {
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove(path);
  const WorldLosses whole = train_ranks(o, ranks);
  TrainerOptions first = o;
  first.checkpoint = path.string();
  first.steps = 4;
  train_ranks(first, ranks);
  TrainerOptions rest = first;
  rest.steps = o.steps;
  rest.resume = true;
  const WorldLosses resumed = train_ranks(rest, ranks);
  for (int r = 0; r < ranks; ++r) {
    EXPECT_EQ(bits(resumed.losses[r]), bits(std::vector<float>(whole.losses[r].begin() + 4, whole.losses[r].end())))
        << "rank " << r;
  }
  EXPECT_NE(resumed.log.find("resumed from"), std::string::npos) << resumed.log;
  return rest;
}

// Each stage saves its own parameters and AdamW state (a part per rank, the
// manifest commits them): a resume continues exactly, 1F1B and interleaved.
TEST(PipelineTrainerResumeTest, ResumeEqualsAnUninterruptedRun) {
  TrainerOptions o = flags(SmallModel::kSequence);
  o.layers = 4;
  expect_resume_equals_uninterrupted(pipelined(o, 2), 2, "pp2_resume.safetensors");
  const TrainerOptions rest = expect_resume_equals_uninterrupted(pipelined(o, 2, 4, 2), 2, "pp2v2_resume.safetensors");
  for (int r = 0; r < 2; ++r) EXPECT_EQ(read_checkpoint_set_part(rest.checkpoint, r, 2).step, rest.steps);
}

// Resuming with another --virtual-stages, --microbatches or --pp names the checkpoint's values.
TEST(PipelineTrainerResumeTest, AnotherPipelineIsRefusedNamingTheCheckpointsValues) {
  TrainerOptions o = flags(SmallModel::kSequence);
  o.layers = 4;
  const TrainerOptions rest = expect_resume_equals_uninterrupted(pipelined(o, 2, 4, 2), 2, "pp2v2_refuse.safetensors");
  TrainerOptions other = rest;
  other.virtual_stages = 1;
  EXPECT_ERROR_CONTAINS(train_ranks(other, 2), "config.virtual-stages: checkpoint 2, this run 1");
  other = rest;
  other.microbatches = 2;
  EXPECT_ERROR_CONTAINS(train_ranks(other, 2), "config.microbatches: checkpoint 4, this run 2");
  // Without --pp the two ranks are data-parallel replicas, which read one file: the set's own flags are named.
  TrainerOptions replicas = o;
  replicas.checkpoint = rest.checkpoint;
  replicas.resume = true;
  replicas = resolve_defaults(replicas, Device::kHost);
  EXPECT_ERROR_CONTAINS(train_ranks(replicas, 2), "config.pp: checkpoint 2, this run (not set: pass --pp");
  // And a run with --pp refuses a single file of a run without it.
  TrainerOptions single = o;
  single.checkpoint = (std::filesystem::path(::testing::TempDir()) / "single.safetensors").string();
  single.steps = 4;
  train_ranks(resolve_defaults(single, Device::kHost), 2);
  TrainerOptions staged = pipelined(o, 2, 4, 2);
  staged.checkpoint = single.checkpoint;
  staged.resume = true;
  EXPECT_ERROR_CONTAINS(train_ranks(staged, 2), "config.pp: checkpoint (not recorded), this run 2");
}

// What --pp refuses, each naming the flags.
TEST(PipelineTrainerFlagsTest, ThePipelineFlagsNeedPp) {
  for (const char* flag : {"--virtual-stages", "--microbatches"}) {
    const ParsedCommandLine parsed = parse_command_line(std::vector<std::string>{flag, "2"});
    EXPECT_EQ(parsed.exit_code, 2) << flag;
    EXPECT_NE(parsed.message.find(std::string(flag) + " "), std::string::npos) << parsed.message;
    EXPECT_NE(parsed.message.find("it needs --pp N (N > 1)"), std::string::npos) << parsed.message;
  }
  const ParsedCommandLine parsed =
      parse_command_line(std::vector<std::string>{"--pp", "2", "--virtual-stages", "2", "--microbatches", "6"});
  ASSERT_TRUE(parsed.options.has_value()) << parsed.message;
  EXPECT_EQ(parsed.options->pp, 2);
  EXPECT_EQ(parsed.options->virtual_stages, 2);
  EXPECT_EQ(parsed.options->microbatches, 6);
}

TEST(PipelineTrainerFlagsTest, WhatThePipelineDoesNotSupportIsRefusedNamingTheFlags) {
  const auto refused = [](void (*edit)(TrainerOptions&), std::initializer_list<std::string> words) {
    TrainerOptions o = flags(SmallModel::kSequence);
    o.pp = 2;
    edit(o);
    try {
      resolve_defaults(o, Device::kHost);
      ADD_FAILURE() << "no error for " << *words.begin();
    } catch (const Error& error) {
      for (const std::string& word : words) EXPECT_NE(error.message().find(word), std::string::npos) << error.message();
    }
  };
  refused([](TrainerOptions& o) { o.experts = 2; }, {"--pp 2 does not support --experts (2)"});
  refused([](TrainerOptions& o) { o.dropout = 0.1; }, {"--pp 2", "--dropout (0.1)"});
  refused(
      [](TrainerOptions& o) {
        o.fp8 = Fp8Recipe::current();
        o.dtype.reset();
      },
      {"--pp 2", "--fp8 (current)"});
  refused([](TrainerOptions& o) { o.cp = 2; }, {"--pp 2 with --cp 2"});
  refused([](TrainerOptions& o) { o.dtype = DType::kFloat16; }, {"--pp 2 with --dtype fp16", "--dtype bf16 or fp32"});
  refused([](TrainerOptions& o) { o.dp_mode = DataParallelMode::kZero1; }, {"--pp 2 with --dp-mode zero1"});
  refused([](TrainerOptions& o) { o.skip_nonfinite = true; }, {"--pp 2 with --skip-nonfinite"});
  refused([](TrainerOptions& o) { o.layers = 3; }, {"--layers (3) must be a positive multiple of --pp (2)"});
  refused(
      [](TrainerOptions& o) {
        o.layers = 4;
        o.virtual_stages = 2;
        o.microbatches = 3;
        o.batch = 9;
      },
      {"--microbatches (3) must be a multiple of --pp (2) with --virtual-stages 2"});
  refused([](TrainerOptions& o) { o.microbatches = 3; }, {"--batch (8) must divide by --microbatches (3)"});
  // The default skip is off with --pp, and the default microbatches 2 x --pp.
  TrainerOptions o = flags(SmallModel::kSequence);
  o.pp = 2;
  const TrainerOptions resolved = resolve_defaults(o, Device::kHost);
  EXPECT_EQ(resolved.skip_nonfinite, false);
  EXPECT_EQ(resolved.microbatches, 4);
}

TEST(PipelineTrainerFlagsTest, TheWorldAndTheBatchMustFitTheLayout) {
  TrainerOptions four_blocks = flags(SmallModel::kWindow);
  four_blocks.layers = 4;
  EXPECT_ERROR_CONTAINS(train_ranks(pipelined(four_blocks, 4), 2), "--tp 1 x --pp 4 must divide the world of 2 ranks");
  TrainerOptions o = flags(SmallModel::kWindow);
  o.dp = 2;
  EXPECT_ERROR_CONTAINS(train_ranks(pipelined(o, 2), 2), "--dp 2 needs a world of 4 ranks");
  // 16 examples over 2 replicas and 16 microbatches.
  EXPECT_ERROR_CONTAINS(train_ranks(pipelined(flags(SmallModel::kWindow), 2, 16), 4), "--batch 16 is the global batch",
                        "--microbatches 16 (a multiple of 32)");
  // A microbatch of one sequence of 3 tokens does not split over 2 tensor-parallel ranks.
  TrainerOptions odd = flags(SmallModel::kSequence);
  odd.seq_len = 3;
  odd.tp = 2;
  EXPECT_ERROR_CONTAINS(train_ranks(pipelined(odd, 2, 8), 4), "a microbatch's 3 tokens",
                        "over the 2 tensor-parallel ranks");
  // One process cannot hold two stages.
  std::ostringstream log;
  EXPECT_ERROR_CONTAINS(train(pipelined(flags(SmallModel::kWindow), 2), Device::kHost, log),
                        "--tp 1 x --pp 2 must divide the world of 1 ranks");
}

}  // namespace
}  // namespace stepgraph::trainer
