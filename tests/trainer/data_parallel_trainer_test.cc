// The trainer's data parallelism on host thread worlds (the same train() the
// trainer's ranks run, each thread a rank): 2 and 4 ranks against one
// process on the same global batch, eager against graph bit for bit on every
// rank, resume against an uninterrupted run, and ranks started with
// different flags. The process-level launch (--nproc-per-node, a killed
// rank) is tested in data_parallel_launch_test.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "layers/residual_stack.h"
#include "tests/support/expect_error.h"
#include "tests/trainer/small_model.h"
#include "checkpoint/checkpoint_set.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"
#include "trainer/train_state.h"

namespace stepgraph::trainer {
namespace {

// Unresolved: the flags of 12 steps of `model` in fp32 on the host (the
// reduction-order tolerance below is fp32's).
TrainerOptions run_flags(testing::SmallModel model, StepMode mode) {
  TrainerOptions o =
      testing::small_model_flags(model, {.steps = 12, .log_every = 4, .dtype = DType::kFloat32, .seed = 5});
  o.mode = mode;
  return o;
}

// The window model (gpt_options below: the sequence model).
TrainerOptions options(StepMode mode) {
  TrainerOptions o = run_flags(testing::SmallModel::kWindow, mode);
  o.batch = 32;  // the global batch
  return resolve_defaults(o, Device::kHost);
}

// Each rank's losses from train() on a thread world of `ranks`.
std::vector<std::vector<float>> train_ranks(const TrainerOptions& o, int ranks) {
  std::vector<std::vector<float>> losses(static_cast<std::size_t>(ranks));
  HostWorld::run(ranks, [&](Communicator& comm) {
    std::ostringstream log;
    losses[static_cast<std::size_t>(comm.rank())] = train(o, Device::kHost, log, &comm).losses;
  });
  return losses;
}

// The graphed options, edited by `edit` on each rank, trained on a thread
// world of `ranks`: for the Error a rank meets.
void train_edited(int ranks, const std::function<void(TrainerOptions&, int rank)>& edit) {
  HostWorld::run(ranks, [&](Communicator& comm) {
    TrainerOptions o = options(StepMode::kGraph);
    edit(o, comm.rank());
    std::ostringstream log;
    train(o, Device::kHost, log, &comm);
  });
}

std::vector<std::uint32_t> bits(const std::vector<float>& values) {
  std::vector<std::uint32_t> out(values.size());
  std::memcpy(out.data(), values.data(), values.size() * sizeof(float));
  return out;
}

// What a world's run against one process found.
struct WorldRun {
  std::vector<float> rank0;  // rank 0's graphed losses
  double worst;              // the largest relative loss difference to one process
};

// Trains `one` in one process, then the graphed options `world` and their
// eager twin on a thread world of `ranks`: every rank reports rank 0's global
// loss, each rank's eager losses equal its graphed ones bit for bit, and
// rank 0's are within 1e-5 relative of one process's (the tolerance each
// caller justifies).
WorldRun expect_world_matches_one_process(const TrainerOptions& one, TrainerOptions world, int ranks) {
  std::ostringstream log;
  const std::vector<float> single = train(one, Device::kHost, log).losses;
  const std::vector<std::vector<float>> graph = train_ranks(world, ranks);
  world.mode = StepMode::kEager;
  const std::vector<std::vector<float>> eager = train_ranks(world, ranks);
  for (std::size_t r = 0; r < graph.size(); ++r) {
    EXPECT_EQ(bits(graph[r]), bits(graph[0])) << "rank " << r << " reports another global loss than rank 0";
    EXPECT_EQ(bits(eager[r]), bits(graph[r])) << "rank " << r << ": eager and graph differ";
  }
  double worst = 0;
  EXPECT_EQ(graph[0].size(), single.size());
  for (std::size_t s = 0; s < std::min(single.size(), graph[0].size()); ++s) {
    worst = std::max(worst, std::abs(static_cast<double>(graph[0][s]) - single[s]) / std::abs(single[s]));
  }
  EXPECT_LE(worst, 1e-5);
  return {graph[0], worst};
}

class DataParallelTrainerTest : public ::testing::TestWithParam<int> {};

// Tolerance: the ranks' gradients differ from one process's only in the
// order of fp32 additions (a rank's rows, then the ranks), 1e-7 relative per
// step; 1e-5 relative on the loss over 12 steps leaves room for AdamW to
// amplify that, while a missing or mis-scaled reduction is off by 1e-2 and
// more (the rank's own slice alone trains on other data).
TEST_P(DataParallelTrainerTest, EveryRankMatchesOneProcessOnTheGlobalBatch) {
  const int ranks = GetParam();
  const WorldRun run = expect_world_matches_one_process(options(StepMode::kGraph), options(StepMode::kGraph), ranks);
  EXPECT_LT(run.rank0.back(), run.rank0.front());
  std::printf("%d ranks: largest relative loss difference to one process over %zu steps: %.3g\n", ranks,
              run.rank0.size(), run.worst);
}

// --dp-mode zero1 trains exactly like allreduce on the host (its reduce-scatter
// adds in the same rank order as its all-reduce: Note [Sharded AdamW]).
TEST_P(DataParallelTrainerTest, Zero1EqualsAllReduceBitForBit) {
  const int ranks = GetParam();
  TrainerOptions zero1 = options(StepMode::kGraph);
  zero1.dp_mode = DataParallelMode::kZero1;
  zero1.skip_nonfinite = false;  // ZeRO-1 cannot skip on the device (its allreduce twin does)
  const std::vector<std::vector<float>> sharded = train_ranks(zero1, ranks);
  const std::vector<std::vector<float>> all_reduce = train_ranks(options(StepMode::kGraph), ranks);
  for (int r = 0; r < ranks; ++r) EXPECT_EQ(bits(sharded[r]), bits(all_reduce[r])) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, DataParallelTrainerTest, ::testing::Values(2, 4),
                         [](const auto& info) { return "ranks" + std::to_string(info.param); });

// Trains `o` on 2 ranks uninterrupted, then to step 5 with a checkpoint at
// `file_name` in a fresh temporary path and on from it to the end: every
// rank's resumed losses must equal the uninterrupted run's. Returns the
// options of the resumed run (its checkpoint the path).
TrainerOptions expect_resume_equals_uninterrupted(const TrainerOptions& o, const std::string& file_name) {
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / file_name;
  std::filesystem::remove(path);
  const std::vector<std::vector<float>> whole = train_ranks(o, 2);
  TrainerOptions first = o;
  first.checkpoint = path.string();
  first.steps = 5;
  train_ranks(first, 2);
  TrainerOptions rest = first;
  rest.steps = o.steps;
  rest.resume = true;
  const std::vector<std::vector<float>> resumed = train_ranks(rest, 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(bits(resumed[r]), bits(std::vector<float>(whole[r].begin() + 5, whole[r].end()))) << "rank " << r;
  }
  return rest;
}

// The resumed run `rest` of 2 ranks wrote a manifest at its checkpoint that
// names one part per rank, at its last step (Note [Checkpoint sets]).
void expect_one_part_per_rank(const TrainerOptions& rest) {
  for (int r = 0; r < 2; ++r) EXPECT_EQ(read_checkpoint_set_part(rest.checkpoint, r, 2).step, rest.steps);
}

TEST(DataParallelTrainerResumeTest, ResumeEqualsAnUninterruptedRunOnTwoRanks) {
  const TrainerOptions rest = expect_resume_equals_uninterrupted(options(StepMode::kGraph), "dp_resume.safetensors");
  // The checkpoint of 2 ranks is refused at another world size, naming it.
  std::ostringstream log;
  EXPECT_ERROR_CONTAINS(train(rest, Device::kHost, log), "config.dp");
}

// ZeRO-1: each rank writes its own shard file, and a resume continues exactly.
TEST(DataParallelTrainerResumeTest, Zero1ResumeFromPerRankFilesEqualsAnUninterruptedRun) {
  TrainerOptions o = options(StepMode::kGraph);
  o.dp_mode = DataParallelMode::kZero1;
  o.skip_nonfinite = false;
  const TrainerOptions rest = expect_resume_equals_uninterrupted(o, "zero1_resume.safetensors");
  expect_one_part_per_rank(rest);
  // A manifest whose parts are gone (replaced by a later set) is refused.
  TrainerOptions at7 = o;
  at7.checkpoint = rest.checkpoint + ".mixed";
  at7.steps = 7;
  train_ranks(at7, 2);
  std::filesystem::copy_file(at7.checkpoint, at7.checkpoint + ".step7", std::filesystem::copy_options::overwrite_existing);
  TrainerOptions at9 = at7;
  at9.steps = 9;
  at9.resume = true;
  train_ranks(at9, 2);
  std::filesystem::copy_file(at7.checkpoint + ".step7", at7.checkpoint, std::filesystem::copy_options::overwrite_existing);
  at9.steps = 12;
  EXPECT_ERROR_CONTAINS(train_ranks(at9, 2), "(step 7) names", "which does not exist");
}

TEST(DataParallelTrainerFlagsTest, RanksWithDifferentFlagsStopNamingTheFlag) {
  EXPECT_ERROR_CONTAINS(train_edited(2,
                                     [](TrainerOptions& o, int rank) {
                                       if (rank == 1) o.hidden = 64;
                                     }),
                        "different flags: --hidden is 32 on rank 0 but 64 on rank 1");
}

TEST(DataParallelTrainerFlagsTest, BatchAndDpMustFitTheWorld) {
  EXPECT_ERROR_CONTAINS(train_edited(4, [](TrainerOptions& o, int) { o.batch = 30; }),
                        "--batch 30 is the global batch and must split evenly over the 4");
  EXPECT_ERROR_CONTAINS(train_edited(2, [](TrainerOptions& o, int) { o.dp = 4; }),
                        "--dp 4 needs a world of 4 ranks, but this run has 2");
}

// Tensor parallelism through train() (Note [Tensor-parallel ResidualStack]):
// TP=2 on a world of 2 and TP=2 x DP=2 on a world of 4, with the overlapped
// schedules, against one process on the same global batch. Tolerance as for
// data parallelism above: the ranks add the same fp32 terms in another order
// (the split ffn's and vocabulary's partial sums), 1e-5 relative on the loss
// over 12 steps; a missing reduction is off by 1e-2 and more.
struct TensorParallelCase {
  int ranks;
  const char* overlap;
};

class TensorParallelTrainerTest : public ::testing::TestWithParam<TensorParallelCase> {
 protected:
  // `one` at --tp 2 with the case's --overlap on its world, against one process.
  static WorldRun expect_tp2_matches_one_process(const TrainerOptions& one) {
    TrainerOptions o = one;
    o.tp = 2;
    o.overlap = MLPOverlap::parse(GetParam().overlap);
    return expect_world_matches_one_process(one, o, GetParam().ranks);
  }
};

TEST_P(TensorParallelTrainerTest, EveryRankMatchesOneProcessOnTheGlobalBatch) {
  const auto [ranks, overlap] = GetParam();
  const WorldRun run = expect_tp2_matches_one_process(options(StepMode::kGraph));
  std::printf("tp 2 x dp %d (%s): largest relative loss difference to one process over %zu steps: %.3g\n",
              ranks / 2, overlap, run.rank0.size(), run.worst);
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelTrainerTest,
                         ::testing::Values(TensorParallelCase{2, "bulk"}, TensorParallelCase{2, "overlap"},
                                           TensorParallelCase{4, "overlap"}),
                         [](const auto& info) {
                           return "ranks" + std::to_string(info.param.ranks) + "_" + info.param.overlap;
                         });

// `o` at --tp 2 (overlapped) on 2 ranks: each tensor-parallel rank holds its
// own shards, so it writes its own file, and a resume continues exactly.
void expect_tp2_resume_from_per_rank_files(TrainerOptions o, const std::string& file_name) {
  o.tp = 2;
  o.overlap = MLPOverlap::overlapped();
  expect_one_part_per_rank(expect_resume_equals_uninterrupted(o, file_name));
}

TEST(TensorParallelTrainerResumeTest, ResumeFromPerRankFilesEqualsAnUninterruptedRun) {
  expect_tp2_resume_from_per_rank_files(options(StepMode::kGraph), "tp_resume.safetensors");
}

TEST(TensorParallelTrainerFlagsTest, TpMustDivideTheWorldAndTheFfn) {
  EXPECT_ERROR_CONTAINS(train_edited(2, [](TrainerOptions& o, int) { o.tp = 4; }),
                        "--tp 4 must divide the world of 2 ranks");
  TrainerOptions o = options(StepMode::kGraph);
  o.tp = 3;
  EXPECT_ERROR_CONTAINS(resolve_defaults(o, Device::kHost), "--ffn (64) must divide by --tp (3)");
  // A mode that does not fit its collective is refused where --overlap is read, naming the flag.
  const ParsedCommandLine parsed =
      parse_command_line(std::vector<std::string>{"--tp", "2", "--overlap", "pipelined,none,none,none"});
  EXPECT_FALSE(parsed.options.has_value());
  EXPECT_EQ(parsed.exit_code, 2);
  EXPECT_NE(parsed.message.find("--overlap: "), std::string::npos) << parsed.message;
  EXPECT_NE(parsed.message.find("fc1_fprop (all-gather then GEMM)"), std::string::npos) << parsed.message;
}

// The GPT (the sequence model, heads > 0) at --tp 2 on a world of 2 and
// --tp 2 x --dp 2 on a world of 4: attention's heads split over the ranks
// (Note [Tensor-parallel attention]) with the MLPs, against one process on
// the same global batch. Tolerance as above: the same fp32 terms in another
// order (the projections' partial sums over the heads, the ffn's and the
// vocabulary's), 1e-5 relative on the loss over 12 steps.
// Unresolved: the flags as given.
TrainerOptions gpt_flags(StepMode mode) {
  TrainerOptions o = run_flags(testing::SmallModel::kSequence, mode);
  o.heads = 4;
  o.kv_heads = 2;
  o.batch = 8;  // the global batch of sequences
  // A multiple of every TP size's padding (fp32 at --tp 4: 16 logits), so one
  // process trains the same head as the ranks.
  o.vocab = 16;
  return o;
}

TrainerOptions gpt_options(StepMode mode) { return resolve_defaults(gpt_flags(mode), Device::kHost); }

TEST_P(TensorParallelTrainerTest, TheGptMatchesOneProcessOnTheGlobalBatch) {
  const auto [ranks, overlap] = GetParam();
  const WorldRun run = expect_tp2_matches_one_process(gpt_options(StepMode::kGraph));
  EXPECT_LT(run.rank0.back(), run.rank0.front());
  std::printf("gpt tp 2 x dp %d (%s): largest relative loss difference to one process over %zu steps: %.3g\n",
              ranks / 2, overlap, run.rank0.size(), run.worst);
}

// More ranks than kv heads: --tp 4 with --kv-heads 2, each kv head copied on
// two ranks (Note [Tensor-parallel attention]), against one process.
TEST(TensorParallelTrainerGptTest, MoreRanksThanKvHeadsMatchesOneProcess) {
  TrainerOptions o = gpt_options(StepMode::kGraph);
  o.tp = 4;
  o.overlap = MLPOverlap::overlapped();
  const WorldRun run = expect_world_matches_one_process(gpt_options(StepMode::kGraph), o, 4);
  std::printf("gpt tp 4, kv_heads 2: largest relative loss difference to one process over %zu steps: %.3g\n",
              run.rank0.size(), run.worst);
}

// The GPT's tensor-parallel ranks write their own files, and a resume continues exactly.
TEST(TensorParallelTrainerGptTest, ResumeFromPerRankFilesEqualsAnUninterruptedRun) {
  expect_tp2_resume_from_per_rank_files(gpt_options(StepMode::kGraph), "gpt_tp_resume.safetensors");
}

// The attention's heads split over --tp: --heads must divide by it and
// --kv-heads divide it or by it (copies of kv heads, 16-bit only), each
// refusal naming the flags.
TEST(TensorParallelTrainerFlagsTest, HeadsAndKvHeadsMustDivideByTp) {
  TrainerOptions o = gpt_flags(StepMode::kGraph);
  o.tp = 2;
  o.heads = 6;
  o.kv_heads = 0;
  o.hidden = 48;
  o.ffn = 64;
  EXPECT_NO_THROW(resolve_defaults(o, Device::kHost));
  o.tp = 4;
  EXPECT_ERROR_CONTAINS(resolve_defaults(o, Device::kHost), "--heads (6) must divide by --tp (4)");
  o.heads = 4;
  o.hidden = 32;
  o.kv_heads = 2;
  EXPECT_NO_THROW(resolve_defaults(o, Device::kHost));  // each kv head copied on 2 ranks
  o.heads = 12;
  o.hidden = 48;
  o.kv_heads = 3;
  EXPECT_ERROR_CONTAINS(resolve_defaults(o, Device::kHost), "--kv-heads (3) and --tp (4) must divide one another");
  o.heads = 4;
  o.hidden = 64;
  o.kv_heads = 2;
  o.fp8 = Fp8Recipe::current();
  o.dtype.reset();  // bf16, as --fp8 needs
  o.batch = 16;
  o.seq_len = 16;
  EXPECT_ERROR_CONTAINS(resolve_defaults(o, Device::kHost), "--fp8", "--tp (4) above --kv-heads (2)");
}

// Dropout under tensor parallelism: each rank's rows draw one rank's numbers
// (Note [Dropout in a captured step]), so the ranks drop exactly what one
// process drops and train like it (the same tolerance as above: only the
// order of fp32 sums differs). Without the rank's offset every rank would
// drop the first rows' elements, off by far more.
TEST(TensorParallelTrainerGptTest, DropoutMatchesOneProcess) {
  TrainerOptions one = gpt_options(StepMode::kGraph);
  one.dropout = 0.2;
  TrainerOptions o = one;
  o.tp = 2;
  o.overlap = MLPOverlap::overlapped();
  const WorldRun run = expect_world_matches_one_process(one, o, 2);
  std::printf("gpt tp 2 with dropout 0.2: largest relative loss difference to one process over %zu steps: %.3g\n",
              run.rank0.size(), run.worst);
}

// What a tensor-parallel stack cannot run yet is ResidualStack's rule
// (tensor_parallel_gap): the trainer asks it before building the model, and
// the stack refuses it for callers that do not ask first.
TEST(TensorParallelTrainerFlagsTest, TheStackRefusesWhatItsGapNames) {
  EXPECT_EQ(ResidualStack::tensor_parallel_gap({.heads = 4}), std::nullopt);
  EXPECT_EQ(ResidualStack::tensor_parallel_gap({.hidden = 32, .dropout = 0.5f}), std::nullopt);
  EXPECT_EQ(ResidualStack::tensor_parallel_gap({.hidden = 30, .dropout = 0.5f}),
            std::optional<std::string>("dropout (0.5) with hidden 30 (not a multiple of 4)"));
  EXPECT_ERROR_CONTAINS(HostWorld::run(2,
                                       [](Communicator& comm) {
                                         Context ctx(Device::kHost);
                                         ResidualStack stack(ctx,
                                                             {.hidden = 30,
                                                              .ffn = 64,
                                                              .layers = 1,
                                                              .vocab = 16,
                                                              .dtype = DType::kFloat32,
                                                              .dropout = 0.25f},
                                                             &comm);
                                       }),
                        "ResidualStack: dropout (0.25) with hidden 30 (not a multiple of 4) is not supported with "
                        "tensor parallelism yet");
}

// The GPT at --cp 2 on a world of 2, --tp 2 x --cp 2 and --cp 2 x --dp 2 on
// worlds of 4: each context-parallel rank holds its zig-zag chunks of its
// group's tokens (Note [Context-parallel ResidualStack]), against one
// process on the same global batch, eager == graph on every rank.
// Tolerance as above: the same fp32 terms in another order (the gradients
// summed over dp x cp, attention's dK and dV partials reduce-scattered over
// the CP ranks, under TP the projections' partial sums), 1e-5 relative on
// the loss over 12 steps; a rank's tokens cut wrongly, a wrong rotary
// position or a missing reduction is off by 1e-3 and more.
struct ContextParallelCase {
  int ranks;
  int tp;
  int cp;
};

class ContextParallelTrainerTest : public ::testing::TestWithParam<ContextParallelCase> {};

TEST_P(ContextParallelTrainerTest, TheGptMatchesOneProcessOnTheGlobalBatch) {
  const ContextParallelCase c = GetParam();
  TrainerOptions o = gpt_options(StepMode::kGraph);
  o.tp = c.tp;
  o.cp = c.cp;
  const WorldRun run = expect_world_matches_one_process(gpt_options(StepMode::kGraph), o, c.ranks);
  EXPECT_LT(run.rank0.back(), run.rank0.front());
  std::printf("gpt tp %d x cp %d x dp %d: largest relative loss difference to one process over %zu steps: %.3g\n", c.tp,
              c.cp, c.ranks / (c.tp * c.cp), run.rank0.size(), run.worst);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ContextParallelTrainerTest,
                         ::testing::Values(ContextParallelCase{2, 1, 2}, ContextParallelCase{4, 2, 2},
                                           ContextParallelCase{4, 1, 2}),
                         [](const auto& info) {
                           return "ranks" + std::to_string(info.param.ranks) + "_tp" + std::to_string(info.param.tp) +
                                  "_cp" + std::to_string(info.param.cp);
                         });

// Context-parallel ranks hold the same parameters: rank 0 writes the file,
// and a resume continues exactly; the checkpoint records --cp.
TEST(ContextParallelTrainerGptTest, ResumeEqualsAnUninterruptedRun) {
  TrainerOptions o = gpt_options(StepMode::kGraph);
  o.cp = 2;
  TrainerOptions rest = expect_resume_equals_uninterrupted(o, "gpt_cp_resume.safetensors");
  rest.cp = 1;
  rest.dp = 0;
  EXPECT_ERROR_CONTAINS(train_ranks(rest, 2), "config.cp");
}

// --cp needs the sequence model, a world of tp x cp x dp ranks and a
// group's tokens that cut into 2 cp chunks; MoE and dropout are refused.
TEST(ContextParallelTrainerFlagsTest, CpNamesWhatItNeeds) {
  TrainerOptions window = options(StepMode::kGraph);
  window.cp = 2;
  EXPECT_ERROR_CONTAINS(resolve_defaults(window, Device::kHost), "--cp 2 splits the sequence model's sequences",
                        "--heads > 0");
  TrainerOptions moe = gpt_flags(StepMode::kGraph);
  moe.cp = 2;
  moe.experts = 2;
  EXPECT_ERROR_CONTAINS(resolve_defaults(moe, Device::kHost), "--cp 2 does not support --experts (2)");
  const ParsedCommandLine parsed = parse_command_line(std::vector<std::string>{"--cp", "2", "--heads", "4"});
  EXPECT_EQ(parsed.exit_code, 0) << parsed.message;
  ASSERT_TRUE(parsed.options.has_value()) << parsed.message;
  EXPECT_EQ(parsed.options->cp, 2);
  TrainerOptions three = gpt_options(StepMode::kGraph);
  three.cp = 3;
  EXPECT_ERROR_CONTAINS(train_ranks(three, 2), "--tp 1 x --cp 3 must divide the world of 2 ranks");
  TrainerOptions odd = gpt_options(StepMode::kGraph);
  odd.cp = 2;
  odd.seq_len = 3;
  odd.context = 3;
  odd.batch = 2;
  EXPECT_ERROR_CONTAINS(train_ranks(odd, 2), "--cp 2", "6 tokens", "multiple of 4");
}

}  // namespace
}  // namespace stepgraph::trainer
