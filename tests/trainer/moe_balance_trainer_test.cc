// The trainer's MoE load balancing (--moe-aux-loss, --moe-bias-rate; Note
// [MoE load balancing] in layers/moe_mlp.h) on the host, through the same
// parse_command_line, resolve_defaults and train() the binary runs: bad values
// and either flag without --experts are refused naming the flag; a short run
// with both on trains, eager equals graph bit for bit (the losses and the aux
// losses), the step lines carry the aux loss and the setup line says which
// balancing runs; the checkpoint holds the expert bias, and a run resumed from
// a mid-run checkpoint equals the uninterrupted run bit for bit; a resume with
// another value, or with balancing turned on or off, names the flag. Under
// --ep 2 (a host thread world) every rank reports the same losses, eager as
// graph.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "tests/support/expect_error.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/world_runs.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

using testing::SmallModel;

constexpr double kAuxLoss = 1e-2;  // Switch's coefficient
// Above DeepSeek-V3's 1e-3 so that the biases move the top-k choice within a short run.
constexpr double kBiasRate = 1e-2;

// Unresolved: the small GPT (2 blocks, the second an MoE block of 4 experts,
// top-2) in fp32 for `steps` steps, with the given balancing.
TrainerOptions flags(std::int64_t steps, double aux_loss, double bias_rate, SmallModel model = SmallModel::kSequence) {
  TrainerOptions o = testing::small_model_flags(model, {.steps = steps, .log_every = 5, .dtype = DType::kFloat32, .seed = 5});
  o.experts = 4;
  o.moe_aux_loss = aux_loss;
  o.moe_bias_rate = bias_rate;
  return o;
}

TrainResult run(const TrainerOptions& o, std::ostream& log) {
  return train(resolve_defaults(o, Device::kHost), Device::kHost, log);
}

using testing::bits;

std::vector<float> tail(const std::vector<float>& values, std::size_t from) {
  return {values.begin() + static_cast<std::ptrdiff_t>(from), values.end()};
}

// The line of `log` that starts with `start`; empty if none.
std::string line_starting(const std::string& log, const std::string& start) {
  const std::size_t at = log.rfind("\n" + start);
  if (at == std::string::npos) return {};
  const std::size_t end = log.find('\n', at + 1);
  return log.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1);
}

ParsedCommandLine parse(std::vector<std::string> args) { return parse_command_line(args); }

TEST(MoeBalanceTrainerFlagsTest, TheFlagsParseWithExperts) {
  const ParsedCommandLine parsed = parse({"--experts", "4", "--moe-aux-loss", "1e-2", "--moe-bias-rate", "0.001"});
  ASSERT_TRUE(parsed.options.has_value()) << parsed.message;
  EXPECT_EQ(parsed.options->moe_aux_loss, 1e-2);
  EXPECT_EQ(parsed.options->moe_bias_rate, 1e-3);
  const TrainerOptions resolved = resolve_defaults(*parsed.options, Device::kHost);
  EXPECT_EQ(resolved.moe_aux_loss, 1e-2);
  EXPECT_EQ(resolved.moe_bias_rate, 1e-3);
  // Off by default, and 0 is off.
  const ParsedCommandLine plain = parse({"--experts", "4", "--moe-aux-loss", "0"});
  ASSERT_TRUE(plain.options.has_value()) << plain.message;
  EXPECT_EQ(plain.options->moe_aux_loss, 0);
  EXPECT_EQ(plain.options->moe_bias_rate, 0);
}

TEST(MoeBalanceTrainerFlagsTest, BadValuesAreRefusedNamingTheFlag) {
  for (const std::string flag : {"--moe-aux-loss", "--moe-bias-rate"}) {
    for (const std::string bad : {"-1", "-1e-3", "nan", "inf", "-inf", "1e400", "2e6", "abc", "", "0.01.5"}) {
      const ParsedCommandLine refused = parse({"--experts", "4", flag, bad});
      EXPECT_FALSE(refused.options.has_value()) << flag << " " << bad;
      EXPECT_EQ(refused.exit_code, 2) << flag << " " << bad;
      EXPECT_NE(refused.message.find(flag), std::string::npos) << refused.message;
    }
    // Given twice.
    const ParsedCommandLine twice = parse({"--experts", "4", flag, "0.01", flag, "0.02"});
    EXPECT_EQ(twice.exit_code, 2);
    EXPECT_NE(twice.message.find(flag), std::string::npos) << twice.message;
  }
  // Set in the options directly (not through the flags): resolve_defaults names the flag too.
  TrainerOptions negative = flags(4, -0.5, 0);
  EXPECT_ERROR_CONTAINS(resolve_defaults(negative, Device::kHost), "--moe-aux-loss must be a finite number",
                        "got -0.5");
  TrainerOptions not_finite = flags(4, 0, std::nan(""));
  EXPECT_ERROR_CONTAINS(resolve_defaults(not_finite, Device::kHost), "--moe-bias-rate must be a finite number");
  TrainerOptions infinite = flags(4, 0, INFINITY);
  EXPECT_ERROR_CONTAINS(resolve_defaults(infinite, Device::kHost), "--moe-bias-rate must be a finite number");
}

TEST(MoeBalanceTrainerFlagsTest, EitherFlagWithoutExpertsIsRefusedNamingIt) {
  for (const std::string flag : {"--moe-aux-loss", "--moe-bias-rate"}) {
    for (const std::vector<std::string>& args : {std::vector<std::string>{flag, "0.01"},
                                                 std::vector<std::string>{"--experts", "0", flag, "0.01"},
                                                 std::vector<std::string>{flag, "0"}}) {
      const ParsedCommandLine refused = parse(args);
      EXPECT_FALSE(refused.options.has_value()) << flag;
      EXPECT_EQ(refused.exit_code, 2) << flag;
      EXPECT_NE(refused.message.find(flag + " balances the MoE blocks' experts: it needs --experts N"),
                std::string::npos)
          << refused.message;
    }
  }
  TrainerOptions aux = flags(4, kAuxLoss, 0);
  aux.experts = 0;
  EXPECT_ERROR_CONTAINS(resolve_defaults(aux, Device::kHost), "--moe-aux-loss (0.01) balances the MoE blocks' experts",
                        "--experts N");
  TrainerOptions bias = flags(4, 0, kBiasRate);
  bias.experts = 0;
  EXPECT_ERROR_CONTAINS(resolve_defaults(bias, Device::kHost), "--moe-bias-rate (0.01) balances the MoE blocks' experts",
                        "--experts N");
  // --pp refuses --experts, and so balancing with them: named as before.
  TrainerOptions piped = flags(4, kAuxLoss, kBiasRate);
  piped.pp = 2;
  EXPECT_ERROR_CONTAINS(resolve_defaults(piped, Device::kHost), "--pp 2 does not support --experts (4)");
}

// Both on: the loss falls, eager equals graph bit for bit (losses and aux
// losses), the step lines carry the aux loss, the setup line names both
// methods, and the checkpoint holds a bias that moved.
TEST(MoeBalanceTrainerTest, BothOnTrainsEagerAsGraphAndLogsTheAuxLoss) {
  TrainerOptions o = flags(20, kAuxLoss, kBiasRate);
  o.mode = StepMode::kEager;
  std::ostringstream eager_log;
  const TrainResult eager = run(o, eager_log);
  o.mode = StepMode::kGraph;
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / "moe_balance_both.safetensors";
  std::filesystem::remove(path);
  o.checkpoint = path.string();
  std::ostringstream graph_log;
  const TrainResult graph = run(o, graph_log);
  const std::string log = graph_log.str();

  ASSERT_EQ(graph.losses.size(), 20u);
  ASSERT_EQ(graph.aux_losses.size(), 20u);
  EXPECT_EQ(bits(eager.losses), bits(graph.losses));
  EXPECT_EQ(bits(eager.aux_losses), bits(graph.aux_losses));
  EXPECT_LT(graph.losses.back(), graph.losses.front()) << log;
  for (float aux : graph.aux_losses) {
    // coef x E x sum_e f_e P_e: coef when balanced, at most coef x E (all on one expert).
    EXPECT_TRUE(std::isfinite(aux) && aux > 0 && aux <= kAuxLoss * 4 + 1e-6) << aux;
  }

  // "step 5 loss X aux Y tokens/s ...": the loss first, as tools/trainer_checks.sh and compare_losses.py read it.
  for (const char* step : {"step 5 loss ", "step 20 loss "}) {
    const std::string line = line_starting(log, step);
    ASSERT_FALSE(line.empty()) << log;
    const std::size_t aux_at = line.find(" aux ");
    ASSERT_NE(aux_at, std::string::npos) << line;
    EXPECT_LT(aux_at, line.find(" tokens/s ")) << line;
  }
  std::ostringstream want_aux;
  want_aux << " aux " << std::setprecision(4) << graph.aux_losses[19] << " tokens/s ";
  EXPECT_NE(line_starting(log, "step 20 loss ").find(want_aux.str()), std::string::npos)
      << want_aux.str() << "\n" << log;
  EXPECT_NE(log.find("moe balancing: the Switch auxiliary loss x 0.01 "), std::string::npos) << log;
  EXPECT_NE(log.find("; the expert bias at rate 0.01 (DeepSeek-V3's aux-loss-free balancing"), std::string::npos)
      << log;

  // The MoE block's bias is in the checkpoint and has moved from its start at 0.
  const Checkpoint saved = read_checkpoint(path);
  EXPECT_EQ(saved.metadata.at("config.moe-aux-loss"), "0.01");
  EXPECT_EQ(saved.metadata.at("config.moe-bias-rate"), "0.01");
  int biases = 0;
  for (const CheckpointTensor& tensor : saved.tensors) {
    if (!tensor.name.ends_with("expert_bias")) continue;
    ++biases;
    ASSERT_EQ(tensor.bytes.size(), 4 * sizeof(float)) << tensor.name;
    std::vector<float> bias(4);
    std::memcpy(bias.data(), tensor.bytes.data(), tensor.bytes.size());
    EXPECT_TRUE(bias[0] != 0 || bias[1] != 0 || bias[2] != 0 || bias[3] != 0) << tensor.name;
  }
  EXPECT_EQ(biases, 1);  // blocks 0 and 1, the second an MoE block
}

// Each method alone changes the run (the flags reach the blocks), and a run
// without balancing logs neither the aux loss nor a bias in its checkpoint.
TEST(MoeBalanceTrainerTest, EachMethodAloneChangesTheRunAndOffLogsNoAux) {
  std::ostringstream log;
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / "moe_balance_off.safetensors";
  std::filesystem::remove(path);
  TrainerOptions off_flags = flags(10, 0, 0);
  off_flags.checkpoint = path.string();
  const TrainResult off = run(off_flags, log);
  const std::string off_log = log.str();
  EXPECT_TRUE(off.aux_losses.empty());
  EXPECT_EQ(line_starting(off_log, "step 5 loss ").find(" aux "), std::string::npos) << off_log;
  EXPECT_NE(off_log.find("moe balancing: none (--moe-aux-loss and --moe-bias-rate are 0)"), std::string::npos)
      << off_log;
  const Checkpoint saved = read_checkpoint(path);
  EXPECT_EQ(saved.metadata.count("config.moe-aux-loss"), 0u);
  EXPECT_EQ(saved.metadata.count("config.moe-bias-rate"), 0u);
  for (const CheckpointTensor& tensor : saved.tensors) EXPECT_FALSE(tensor.name.ends_with("expert_bias")) << tensor.name;

  std::ostringstream aux_log;
  const TrainResult aux = run(flags(10, kAuxLoss, 0), aux_log);
  EXPECT_EQ(aux.aux_losses.size(), 10u);
  EXPECT_NE(aux_log.str().find("moe balancing: the Switch auxiliary loss x 0.01 "), std::string::npos);
  EXPECT_EQ(aux_log.str().find("the expert bias"), std::string::npos);
  std::ostringstream bias_log;
  const TrainResult bias = run(flags(10, 0, kBiasRate), bias_log);
  EXPECT_TRUE(bias.aux_losses.empty());
  EXPECT_NE(bias_log.str().find("moe balancing: the expert bias at rate 0.01 "), std::string::npos);
  EXPECT_EQ(line_starting(bias_log.str(), "step 5 loss ").find(" aux "), std::string::npos) << bias_log.str();
  // The first step's loss comes before any update; later ones differ where the balancing moved the model.
  EXPECT_EQ(bits({aux.losses[0]}), bits({off.losses[0]}));
  EXPECT_NE(bits(aux.losses), bits(off.losses));
  EXPECT_NE(bits(bias.losses), bits(off.losses));
}

// Trains `o` for 24 steps uninterrupted, then to step 13 saving every 5 and
// on from the checkpoint: the resumed losses and aux losses equal the
// uninterrupted run's bit for bit.
void expect_resume_equals_uninterrupted(TrainerOptions o, const std::string& name) {
  std::ostringstream log;
  o.steps = 24;
  const TrainResult whole = run(o, log);
  const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove(path);
  o.checkpoint = path.string();
  o.save_every = 5;
  o.steps = 13;  // saves at 5, 10 and 13
  const TrainResult first = run(o, log);
  EXPECT_EQ(bits(first.losses), bits(std::vector<float>(whole.losses.begin(), whole.losses.begin() + 13)));
  o.steps = 24;
  o.resume = true;
  std::ostringstream resumed_log;
  const TrainResult rest = run(o, resumed_log);
  EXPECT_EQ(rest.first_step, 14);
  EXPECT_NE(resumed_log.str().find("resumed from"), std::string::npos) << resumed_log.str();
  EXPECT_EQ(bits(rest.losses), bits(tail(whole.losses, 13)));
  if (o.moe_aux_loss > 0) {
    EXPECT_EQ(bits(rest.aux_losses), bits(tail(whole.aux_losses, 13)));
  }
}

TEST(MoeBalanceTrainerTest, ResumedRunEqualsAnUninterruptedOne) {
  TrainerOptions graph = flags(24, kAuxLoss, kBiasRate);
  expect_resume_equals_uninterrupted(graph, "moe_balance_resume_graph.safetensors");
  TrainerOptions eager = flags(24, kAuxLoss, kBiasRate, SmallModel::kWindow);
  eager.mode = StepMode::kEager;
  expect_resume_equals_uninterrupted(eager, "moe_balance_resume_eager_window.safetensors");
  // The bias alone: it is the only state balancing adds.
  expect_resume_equals_uninterrupted(flags(24, 0, kBiasRate), "moe_balance_resume_bias.safetensors");
}

// A resume with another value, or with a method turned on or off, names the
// flag's checkpoint entry (before any tensor is loaded: never the engine's
// word about a missing or extra blockN.expert_bias).
TEST(MoeBalanceTrainerTest, ResumingWithOtherBalancingNamesTheFlag) {
  const std::filesystem::path dir(::testing::TempDir());
  std::ostringstream log;
  TrainerOptions saved = flags(4, kAuxLoss, kBiasRate);
  saved.checkpoint = (dir / "moe_balance_refuse.safetensors").string();
  std::filesystem::remove(saved.checkpoint);
  run(saved, log);
  const auto resumed_with = [&](double aux_loss, double bias_rate) {
    TrainerOptions o = flags(8, aux_loss, bias_rate);
    o.checkpoint = saved.checkpoint;
    o.resume = true;
    return o;
  };
  EXPECT_ERROR_CONTAINS(run(resumed_with(kAuxLoss, 2e-2), log), "config.moe-bias-rate: checkpoint 0.01, this run 0.02");
  EXPECT_ERROR_CONTAINS(run(resumed_with(kAuxLoss, 0), log),
                        "config.moe-bias-rate: checkpoint 0.01, this run (not set: pass --moe-bias-rate");
  EXPECT_ERROR_CONTAINS(run(resumed_with(1e-3, kBiasRate), log), "config.moe-aux-loss: checkpoint 0.01, this run 0.001");
  EXPECT_ERROR_CONTAINS(run(resumed_with(0, kBiasRate), log),
                        "config.moe-aux-loss: checkpoint 0.01, this run (not set: pass --moe-aux-loss");
  try {
    run(resumed_with(0, 0), log);
    ADD_FAILURE() << "a resume without balancing was not refused";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("pass --moe-aux-loss"), std::string::npos) << error.message();
    EXPECT_NE(error.message().find("pass --moe-bias-rate"), std::string::npos) << error.message();
    EXPECT_EQ(error.message().find("expert_bias"), std::string::npos) << error.message();
  }

  // A checkpoint without balancing, resumed with it on.
  TrainerOptions plain = flags(4, 0, 0);
  plain.checkpoint = (dir / "moe_balance_refuse_plain.safetensors").string();
  std::filesystem::remove(plain.checkpoint);
  run(plain, log);
  TrainerOptions on = flags(8, 0, kBiasRate);
  on.checkpoint = plain.checkpoint;
  on.resume = true;
  try {
    run(on, log);
    ADD_FAILURE() << "a resume with --moe-bias-rate from a checkpoint without it was not refused";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.message();
    EXPECT_NE(error.message().find("config.moe-bias-rate: checkpoint (not recorded), this run 0.01"),
              std::string::npos)
        << error.message();
    EXPECT_EQ(error.message().find("expert_bias"), std::string::npos) << error.message();
  }
}

// --ep 2 on a host thread world with both on: every rank reports rank 0's
// loss and aux loss (the biases move alike on every rank: their loads are
// summed over the world), eager equals graph bit for bit.
TEST(MoeBalanceTrainerTest, ExpertParallelRanksAgreeEagerAsGraph) {
  TrainerOptions o = flags(10, kAuxLoss, kBiasRate);
  o.batch = 8;
  o.ep = 2;
  const auto train_ranks = [](const TrainerOptions& options) {
    std::vector<TrainResult> results(2);
    std::mutex mutex;
    HostWorld::run(2, [&](Communicator& comm) {
      std::ostringstream log;
      TrainResult result = train(options, Device::kHost, log, &comm);
      std::lock_guard lock(mutex);
      results[static_cast<std::size_t>(comm.rank())] = std::move(result);
    });
    return results;
  };
  o.mode = StepMode::kGraph;
  const std::vector<TrainResult> graph = train_ranks(resolve_defaults(o, Device::kHost));
  o.mode = StepMode::kEager;
  const std::vector<TrainResult> eager = train_ranks(resolve_defaults(o, Device::kHost));
  ASSERT_EQ(graph[0].aux_losses.size(), 10u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(bits(graph[r].losses), bits(graph[0].losses)) << "rank " << r;
    EXPECT_EQ(bits(graph[r].aux_losses), bits(graph[0].aux_losses)) << "rank " << r;
    EXPECT_EQ(bits(eager[r].losses), bits(graph[r].losses)) << "rank " << r;
    EXPECT_EQ(bits(eager[r].aux_losses), bits(graph[r].aux_losses)) << "rank " << r;
  }
  EXPECT_LT(graph[0].losses.back(), graph[0].losses.front());
}

}  // namespace
}  // namespace stepgraph::trainer
