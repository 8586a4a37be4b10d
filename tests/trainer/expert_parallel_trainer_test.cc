// The trainer's expert parallelism (--ep, alone and with --dp replicas) on
// host thread worlds, through the same train() the trainer's ranks run:
// eager against graph and every rank against rank 0 bit for bit, --ep 2,
// --ep 4 and --ep 2 x --dp 2 (given, or resolved from the world) against one
// rank without --ep on the same global batch, resume against an
// uninterrupted run (and the replicas' parts holding the same bits), the
// checkpoint's flags named on a resume with others, the flags --ep refuses,
// and the memory estimate's share of the experts.
//
// Tolerance against one rank: each expert's outputs and weight gradients are
// the one-rank layer's on the global batch bit for bit (Note [Expert-parallel
// MoE] in layers/moe_mlp.h: the exchange keeps the rows' order); the
// replicated parameters' gradients (embedding, attention, norms, router,
// dense block, head) are each rank's partial sum all-reduced, the same fp32
// terms added in another order, and the loss a mean of the ranks' means. So
// the first step's loss is equal bit for bit and each later step differs by
// the rounding that moved the weights, about 1e-7 relative (measured and
// printed below); 1e-5 relative over 10 steps leaves room for AdamW to
// amplify a last-bit difference. With --dp replicas the experts' gradients
// are also sums of partial sums (over the ranks holding them), again the same
// terms in another order: the same tolerance holds. A missing or doubled
// reduction (the experts' gradients summed over ranks holding other experts,
// not summed over their replicas, or one rank's tokens only) moves every
// weight by a whole lr step and the loss by 1e-3 or more within 10 steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_set.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "tests/support/expect_error.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/world_runs.h"
#include "trainer/memory_budget.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

using testing::SmallModel;

constexpr int kSteps = 10;
constexpr std::int64_t kExperts = 8;

// Unresolved: `model`'s flags with kExperts experts for kSteps steps in fp32
// (global batch 16 examples or 8 sequences; 4 blocks, 2 of them MoE).
TrainerOptions flags(SmallModel model) {
  TrainerOptions o =
      testing::small_model_flags(model, {.steps = kSteps, .log_every = 5, .dtype = DType::kFloat32, .seed = 7});
  o.batch = model == SmallModel::kWindow ? 16 : 8;
  o.layers = 4;
  o.experts = kExperts;
  return o;
}

TrainerOptions with_ep(TrainerOptions o, std::int64_t ep, std::int64_t dp = 0) {
  o.ep = ep;
  o.dp = dp;
  return resolve_defaults(o, Device::kHost);
}

std::vector<float> one_rank(const TrainerOptions& o) {
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

struct Case {
  SmallModel model;
  int ep;
  int replicas;    // the world is ep x replicas ranks
  bool given_dp;  // --dp replicas, or --dp left out (resolved from the world)
};

class ExpertParallelTrainerTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertParallelTrainerTest, EqualsOneRankOnTheGlobalBatchAndGraphEqualsEager) {
  const Case c = GetParam();
  const int ranks = c.ep * c.replicas;
  const WorldLosses run =
      expect_every_rank_and_mode_agree(with_ep(flags(c.model), c.ep, c.given_dp ? c.replicas : 0), ranks);
  const std::vector<float> want = one_rank(flags(c.model));
  const double worst = worst_relative(run.losses[0], want);
  EXPECT_LE(worst, 1e-5);
  EXPECT_LT(run.losses[0].back(), run.losses[0].front());
  std::printf("ep %d x dp %d (%s): largest relative loss difference to one rank over %d steps: %.3g\n", c.ep,
              c.replicas, c.model == SmallModel::kWindow ? "window" : "gpt", kSteps, worst);
  if (c.replicas == 1) {
    const std::string placed = c.ep == 2 ? "experts [0, 4) on rank 0, [4, 8) on rank 1 in each of the 2 MoE blocks"
                                         : "experts [0, 2) on rank 0, [2, 4) on rank 1, [4, 6) on rank 2, [6, 8) on "
                                           "rank 3 in each of the 2 MoE blocks";
    EXPECT_NE(run.log.find("expert parallel: " + std::to_string(c.ep) + " ranks"), std::string::npos) << run.log;
    EXPECT_NE(run.log.find(placed), std::string::npos) << run.log;
  } else {
    // Both groups: which ranks form each replica, which hold which experts.
    const std::string rows = c.model == SmallModel::kWindow ? "4 examples" : "2 sequences";
    for (const std::string& part :
         {std::string("expert x data parallel: 4 ranks ("), std::string("2 expert-parallel x 2 replicas"),
          std::string("the replicas' expert-parallel groups: {0, 1}, {2, 3}"),
          std::string("experts [0, 4) on ranks {0, 2}, [4, 8) on ranks {1, 3} (each set an expert-data-parallel "
                      "group) in each of the 2 MoE blocks"),
          std::string("this rank (0) is EP rank 0 of replica 0"), "each rank trains its own " + rows,
          std::string("each expert's over the 2 ranks holding it")}) {
      EXPECT_NE(run.log.find(part), std::string::npos) << part << "\n" << run.log;
    }
  }
  // Thread worlds map each other's memory (HostWorld's peer copies): the captured exchange moves the counted rows.
  EXPECT_NE(run.log.find("a captured step copies the counted rows straight into the owning rank's pool (peer "
                         "copies: "),
            std::string::npos)
      << run.log;
  EXPECT_NE(run.log.find("an eager step sends the padded all-to-all of the bound"), std::string::npos) << run.log;
  EXPECT_EQ(run.log.find("\ndata parallel:"), std::string::npos) << "the EP line says it all:\n" << run.log;
  // The non-finite skip works under EP (its flag is max-reduced over the EP ranks): on by default.
  EXPECT_NE(run.log.find("non-finite steps: skipped on the device"), std::string::npos) << run.log;
}

INSTANTIATE_TEST_SUITE_P(Worlds, ExpertParallelTrainerTest,
                         ::testing::Values(Case{SmallModel::kSequence, 2, 1, false},
                                           Case{SmallModel::kSequence, 2, 1, true},
                                           Case{SmallModel::kSequence, 4, 1, false},
                                           Case{SmallModel::kWindow, 2, 1, false},
                                           Case{SmallModel::kSequence, 2, 2, true},
                                           Case{SmallModel::kWindow, 2, 2, false}),
                         [](const auto& info) {
                           return std::string(info.param.model == SmallModel::kWindow ? "window" : "gpt") + "_ep" +
                                  std::to_string(info.param.ep) + "_dp" + std::to_string(info.param.replicas) +
                                  (info.param.given_dp ? "_given" : "");
                         });

// Trains `o` on `ranks` uninterrupted, then to step 4 with a checkpoint and
// on from it: every rank's resumed losses equal the uninterrupted run's bit
// for bit. Returns the resumed run's options.
TrainerOptions expect_resume_equals_uninterrupted(const TrainerOptions& o, int ranks, const std::string& name) {
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove(path);
  const WorldLosses whole = train_ranks(o, ranks);
  TrainerOptions first = o;
  first.checkpoint = path.string();
  first.steps = 4;
  const WorldLosses saved = train_ranks(first, ranks);
  EXPECT_NE(saved.log.find("(the manifest of one file per rank: --ep " + std::to_string(o.ep) + ")"), std::string::npos)
      << saved.log;
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

// Each rank saves its own experts and their AdamW state with the replicated
// parameters (a part per rank, the manifest commits them): a resume
// continues exactly, eager and graph, at --ep 2 and 4.
TEST(ExpertParallelTrainerResumeTest, ResumeEqualsAnUninterruptedRun) {
  const TrainerOptions rest =
      expect_resume_equals_uninterrupted(with_ep(flags(SmallModel::kSequence), 2), 2, "ep2_resume.safetensors");
  for (int r = 0; r < 2; ++r) EXPECT_EQ(read_checkpoint_set_part(rest.checkpoint, r, 2).step, rest.steps);
  TrainerOptions eager = flags(SmallModel::kSequence);
  eager.mode = StepMode::kEager;
  expect_resume_equals_uninterrupted(with_ep(eager, 4), 4, "ep4_eager_resume.safetensors");
}

// Expert x data parallelism keeps a part per rank too: a resume continues
// exactly, graph and eager, and the ranks holding the same experts (w and
// w + 2 of --ep 2 x --dp 2) wrote the same tensors: their experts, the
// replicated parameters and all AdamW state agree bit for bit.
TEST(ExpertParallelTrainerResumeTest, ExpertTimesDataParallelResumesExactlyAndTheReplicasPartsAgree) {
  const TrainerOptions rest =
      expect_resume_equals_uninterrupted(with_ep(flags(SmallModel::kSequence), 2, 2), 4, "ep2_dp2_resume.safetensors");
  std::vector<Checkpoint> parts;
  for (int r = 0; r < 4; ++r) {
    CheckpointSetPart part = read_checkpoint_set_part(rest.checkpoint, r, 4);
    EXPECT_EQ(part.step, rest.steps);
    EXPECT_EQ(part.checkpoint.metadata.at("config.dp"), "2");
    EXPECT_EQ(part.checkpoint.metadata.at("config.ep"), "2");
    parts.push_back(std::move(part.checkpoint));
  }
  for (int r = 0; r < 2; ++r) {
    const std::vector<CheckpointTensor>& mine = parts[r].tensors;
    const std::vector<CheckpointTensor>& replica = parts[r + 2].tensors;
    ASSERT_EQ(mine.size(), replica.size());
    for (std::size_t i = 0; i < mine.size(); ++i) {
      EXPECT_EQ(mine[i].name, replica[i].name);
      EXPECT_TRUE(mine[i].bytes == replica[i].bytes) << mine[i].name << " differs between ranks " << r << " and " << r + 2;
    }
  }
  // EP rank 0 and 1 of a replica hold other experts: their parts differ.
  std::size_t differing = 0;
  for (std::size_t i = 0; i < parts[0].tensors.size(); ++i) {
    differing += parts[0].tensors[i].bytes != parts[1].tensors[i].bytes ? 1 : 0;
  }
  EXPECT_GT(differing, 0u);
  TrainerOptions eager = flags(SmallModel::kWindow);
  eager.mode = StepMode::kEager;
  expect_resume_equals_uninterrupted(with_ep(eager, 2), 4, "ep2_dp2_eager_resume.safetensors");
}

// Dropout under EP: every rank's generator is the one rank's (the same seed),
// each drawing its own rows' masks; eager equals graph, and the generator's
// state is in every rank's part, so a resume continues exactly.
TEST(ExpertParallelTrainerResumeTest, DropoutRunsEagerAsGraphAndResumesExactly) {
  TrainerOptions o = flags(SmallModel::kSequence);
  o.dropout = 0.1;
  const TrainerOptions resolved = with_ep(o, 2);
  expect_every_rank_and_mode_agree(resolved, 2);
  expect_resume_equals_uninterrupted(resolved, 2, "ep2_dropout_resume.safetensors");
}

// Resuming with another --ep, another --experts, without --ep, or with --ep
// from a run without it names the checkpoint's values.
TEST(ExpertParallelTrainerResumeTest, AnotherExpertLayoutIsRefusedNamingTheCheckpointsValues) {
  const std::filesystem::path dir(::testing::TempDir());
  TrainerOptions four = with_ep(flags(SmallModel::kSequence), 4);
  four.checkpoint = (dir / "ep4_refuse.safetensors").string();
  four.steps = 4;
  std::filesystem::remove(four.checkpoint);
  train_ranks(four, 4);

  // A set of 4 parts resumed by 2 ranks: rank 0's part names the flags.
  TrainerOptions two = flags(SmallModel::kSequence);
  two.checkpoint = four.checkpoint;
  two.resume = true;
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(two, 2), 2), "config.ep: checkpoint 4, this run 2");
  // The same ranks with other experts.
  TrainerOptions fewer = flags(SmallModel::kSequence);
  fewer.experts = 4;
  fewer.checkpoint = four.checkpoint;
  fewer.resume = true;
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(fewer, 4), 4), "config.experts: checkpoint 8, this run 4");
  // Without --ep the 4 ranks are data-parallel replicas, which read one file: the set's flags are named.
  TrainerOptions replicas = flags(SmallModel::kSequence);
  replicas.checkpoint = four.checkpoint;
  replicas.resume = true;
  EXPECT_ERROR_CONTAINS(train_ranks(resolve_defaults(replicas, Device::kHost), 4),
                        "config.ep: checkpoint 4, this run (not set: pass --ep");
  // And one rank without --ep (its one file) resumed at --ep 2.
  TrainerOptions single = flags(SmallModel::kSequence);
  single.checkpoint = (dir / "ep_single.safetensors").string();
  single.steps = 4;
  std::filesystem::remove(single.checkpoint);
  train_ranks(resolve_defaults(single, Device::kHost), 2);
  TrainerOptions spread = flags(SmallModel::kSequence);
  spread.checkpoint = single.checkpoint;
  spread.resume = true;
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(spread, 2), 2), "config.ep: checkpoint (not recorded), this run 2");
}

// Resuming an --ep 2 x --dp 2 checkpoint with another --dp (another world),
// or with the same world cut otherwise (--ep 4), names the values that differ.
TEST(ExpertParallelTrainerResumeTest, AnotherExpertTimesDataLayoutIsRefusedNamingTheCheckpointsValues) {
  TrainerOptions saved = with_ep(flags(SmallModel::kSequence), 2, 2);
  saved.checkpoint = (std::filesystem::path(::testing::TempDir()) / "ep2_dp2_refuse.safetensors").string();
  saved.steps = 4;
  std::filesystem::remove(saved.checkpoint);
  train_ranks(saved, 4);
  TrainerOptions o = flags(SmallModel::kSequence);
  o.checkpoint = saved.checkpoint;
  o.resume = true;
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(o, 2, 1), 2), "config.dp: checkpoint 2, this run 1");
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(o, 4), 4), "config.dp: checkpoint 2, this run 1",
                        "config.ep: checkpoint 2, this run 4");
  TrainerOptions fewer = o;
  fewer.experts = 4;
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(fewer, 2, 2), 4), "config.experts: checkpoint 8, this run 4");
}

// What --ep refuses, each naming the flags.
TEST(ExpertParallelTrainerFlagsTest, WhatExpertParallelismDoesNotSupportIsRefusedNamingTheFlags) {
  const auto refused = [](void (*edit)(TrainerOptions&), std::initializer_list<std::string> words) {
    TrainerOptions o = flags(SmallModel::kSequence);
    o.ep = 2;
    edit(o);
    try {
      resolve_defaults(o, Device::kHost);
      ADD_FAILURE() << "no error for " << *words.begin();
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.message();
      for (const std::string& word : words) EXPECT_NE(error.message().find(word), std::string::npos) << error.message();
    }
  };
  refused([](TrainerOptions& o) { o.tp = 2; },
          {"--ep 2 with --tp 2:", "runs with data parallelism only for now", "leave it out"});
  refused([](TrainerOptions& o) { o.cp = 2; }, {"--ep 2 with --cp 2:"});
  refused([](TrainerOptions& o) { o.pp = 2; }, {"--ep 2 with --pp 2:"});
  refused([](TrainerOptions& o) { o.dp_mode = DataParallelMode::kZero1; }, {"--ep 2 with --dp-mode zero1:", "ZeRO-1"});
  refused(
      [](TrainerOptions& o) {
        o.dp = 2;
        o.dp_mode = DataParallelMode::kZero1;
      },
      {"--ep 2 with --dp-mode zero1:"});
  refused(
      [](TrainerOptions& o) {
        o.tp = 2;
        o.dp = 2;
        o.dp_mode = DataParallelMode::kZero1;
      },
      {"--ep 2 with --tp 2 and --dp-mode zero1:", "leave them out"});
  refused([](TrainerOptions& o) { o.experts = 0; }, {"--ep 2 spreads the MoE blocks' experts", "--experts N"});
  refused(
      [](TrainerOptions& o) {
        o.ep = 4;
        o.experts = 6;
      },
      {"--experts (6) must divide by --ep (4)"});
  refused(
      [](TrainerOptions& o) {
        o.fp8 = Fp8Recipe::current();
        o.dtype.reset();
        o.hidden = 32;
        o.ffn = 64;
        o.batch = 16;
      },
      {"--ep 2 with --fp8 current", "--fp8 none"});
  refused(
      [](TrainerOptions& o) {
        o.buckets = BucketSpec::parse("pow2");
        o.seq_len = 16;
      },
      {"--ep 2 with --buckets"});
  refused([](TrainerOptions& o) { o.batch = 3; }, {"--batch (3) must divide by --ep (2)", "sequences"});
  refused(
      [](TrainerOptions& o) {
        o.dp = 2;
        o.batch = 6;
      },
      {"--batch (6) must divide by --ep (2) x --dp (2)", "each of the 4 ranks"});
  // --ep 0 and 1 are none; --dp 1 is the world of --ep 2 alone.
  TrainerOptions none = flags(SmallModel::kSequence);
  none.ep = 0;
  EXPECT_EQ(resolve_defaults(none, Device::kHost).ep, 1);
  TrainerOptions one_replica = flags(SmallModel::kSequence);
  one_replica.ep = 2;
  one_replica.dp = 1;
  EXPECT_EQ(resolve_defaults(one_replica, Device::kHost).ep, 2);
  // --dp beside --ep: replicas of the expert-parallel group.
  TrainerOptions replicas = flags(SmallModel::kSequence);
  replicas.ep = 2;
  replicas.dp = 2;
  EXPECT_EQ(resolve_defaults(replicas, Device::kHost).dp, 2);
  // The default skip stays on: TrainStep skips a non-finite step on every EP rank alike.
  EXPECT_EQ(resolve_defaults(one_replica, Device::kHost).skip_nonfinite, true);
}

TEST(ExpertParallelTrainerFlagsTest, TheFlagParsesAndTheWorldMustBeEpTimesDpRanks) {
  const ParsedCommandLine parsed = parse_command_line(std::vector<std::string>{"--ep", "2", "--experts", "8"});
  ASSERT_TRUE(parsed.options.has_value()) << parsed.message;
  EXPECT_EQ(parsed.options->ep, 2);
  for (const char* bad : {"-1", "65537", "2.5"}) {
    const ParsedCommandLine refused = parse_command_line(std::vector<std::string>{"--ep", bad});
    EXPECT_EQ(refused.exit_code, 2) << bad;
    EXPECT_NE(refused.message.find("--ep"), std::string::npos) << refused.message;
  }
  const TrainerOptions o = with_ep(flags(SmallModel::kSequence), 2);
  EXPECT_ERROR_CONTAINS(train_ranks(o, 3), "--ep 2 needs a world of a multiple of 2 ranks", "this run has 3");
  std::ostringstream log;
  EXPECT_ERROR_CONTAINS(train(o, Device::kHost, log), "--ep 2 needs a world of a multiple of 2 ranks",
                        "this run has 1");
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(flags(SmallModel::kSequence), 2, 2), 2),
                        "--ep 2 x --dp 2 needs a world of 4 ranks", "this run has 2", "or leave --dp out");
  // --dp resolved from the world: the ranks' rows must still divide the batch (8 sequences over 8 ranks do;
  // 6 sequences over 4 do not).
  TrainerOptions odd = flags(SmallModel::kSequence);
  odd.batch = 6;
  EXPECT_ERROR_CONTAINS(train_ranks(with_ep(odd, 2), 4), "--batch 6 is the global batch and must split evenly over "
                        "the 4 ranks (--ep 2 x 2 data-parallel replicas");
}

// A rank holds experts / ep of every MoE block: a model whose experts one
// rank cannot hold fits at --ep 8, and the rows its experts receive (the
// exchange's bound) are counted.
TEST(ExpertParallelTrainerMemoryTest, ARankHoldsItsShareOfTheExperts) {
  constexpr double kLayers = 8, kHidden = 2048, kFfn = 8192, kExpertsHere = 64, kTokens = 8 * 128;
  TrainerOptions o;
  o.layers = 8;
  o.hidden = 2048;
  o.ffn = 8192;
  o.heads = 16;
  o.seq_len = 128;
  o.batch = 8;
  o.experts = 64;
  o.dtype = DType::kBFloat16;
  const TrainerOptions alone = resolve_defaults(o, Device::kCuda);
  o.ep = 8;
  const TrainerOptions spread = resolve_defaults(o, Device::kCuda);
  const MemoryNeed one = estimate_memory(alone, 8, 1);
  const MemoryNeed eight = estimate_memory(spread, 8, 8);
  // Every second block's 64 experts of 2 x hidden x ffn elements, 16 bytes each with AdamW: 128 GiB on one rank.
  const double experts_bytes = kLayers / 2 * kExpertsHere * 2 * kHidden * kFfn * 16;
  EXPECT_GE(one.other_bytes, experts_bytes);
  // At --ep 8 a rank holds 1/8 of them; what it receives is far less than the 7/8 it does not hold.
  EXPECT_LT(eight.other_bytes, one.other_bytes - experts_bytes * 7 / 8 + experts_bytes / 64);
  // Each MoE block's experts receive 8 ranks x (128 tokens x top-2) rows of 2048 bf16 features, at least.
  const double received = kLayers / 2 * 8 * (kTokens / 8) * 2 * kHidden * 2;
  EXPECT_GE(eight.other_bytes, experts_bytes / 8 + received);
  const MemoryLimit limit{.bytes = 80.0 * 1024 * 1024 * 1024, .what = "the memory of GPU 0 (80.0 GiB)"};
  EXPECT_NO_THROW(check_memory(eight, spread, 8, limit));
  EXPECT_ERROR_CONTAINS(check_memory(one, alone, 8, limit), "--experts");
}

}  // namespace
}  // namespace stepgraph::trainer
