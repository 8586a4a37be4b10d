// step_bench --cp's runner (Note [Context-parallel rows] in
// benchmarks/step_runner.h) on host worlds of 2 ranks (threads): the rows,
// their sequence lengths and efficiency, eager against graphed losses, and
// that the context-parallel step trains the same global batch as one rank
// alone, also where one sequence spans both ranks (the `long` config's
// packing).
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "benchmarks/step_runner.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "tests/benchmarks/quick_run.h"
#include "tests/support/expect_error.h"

namespace stepgraph::bench {
namespace {

// Rank 0's JSON of run_cp_config over a host world of 2 ranks (both must agree).
nlohmann::json run_two_ranks(const StepConfig& config) {
  std::mutex lock;
  std::vector<nlohmann::json> by_rank(2);
  HostWorld::run(2, [&](Communicator& comm) {
    nlohmann::json c = run_cp_config(config, quick(Device::kHost), &comm);
    std::lock_guard<std::mutex> guard(lock);
    by_rank[static_cast<std::size_t>(comm.rank())] = std::move(c);
  });
  EXPECT_EQ(by_rank[1]["loss_check"], by_rank[0]["loss_check"]);
  return by_rank[0];
}

TEST(StepRunnerCpTest, ContextParallelConfigHasSequencesNTimesAsLong) {
  const StepConfig wide = context_parallel_config(step_config("long"), 2);
  EXPECT_EQ(wide.seq_len, 32768);
  EXPECT_EQ(wide.tokens, 32768);
  EXPECT_EQ(wide.sequences, 1);
  EXPECT_ERROR_CONTAINS(context_parallel_config(step_config("tiny"), 0), "--cp must be the number of ranks");
}

TEST(StepRunnerCpHostTest, TinyOnTwoRanks) {
  const StepConfig config = step_config("tiny");
  const nlohmann::json c = run_two_ranks(config);
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  EXPECT_EQ(c["cp"], 2);
  EXPECT_EQ(c["cp_seq_len"], 64);
  ASSERT_EQ(c["systems"].size(), 4u);
  const std::vector<std::string> names = {"stepgraph_eager_cp1", "stepgraph_graph_cp1", "stepgraph_eager_cp2",
                                          "stepgraph_graph_cp2"};
  for (std::size_t i = 0; i < names.size(); ++i) {
    const nlohmann::json& s = c["systems"][i];
    EXPECT_EQ(s["system"], names[i]);
    EXPECT_EQ(s["seq_len"], i < 2 ? 32 : 64);
    EXPECT_EQ(s["cp"], i < 2 ? 1 : 2);
    EXPECT_EQ(s["rank_median_us"].size(), 2u);
    // Per GPU: the cp2 rows' tokens are the baseline's on each rank.
    EXPECT_NEAR(s["tokens_per_s"].get<double>() * s["step_us"]["median_us"].get<double>() * 1e-6, 64.0, 1e-6);
    if (i < 2) {
      EXPECT_TRUE(s["efficiency"].is_null());
      EXPECT_TRUE(s["step_time_ratio"].is_null());
    } else {
      // Note [Context-parallel rows]: per-GPU TFLOP/s over the baseline's, and the step time ratio.
      const nlohmann::json& base = c["systems"][i - 2];
      EXPECT_EQ(s["baseline_system"], base["system"]);
      EXPECT_DOUBLE_EQ(s["efficiency"].get<double>(), s["tflops"].get<double>() / base["tflops"].get<double>());
      EXPECT_DOUBLE_EQ(s["step_time_ratio"].get<double>(),
                       base["step_us"]["median_us"].get<double>() / s["step_us"]["median_us"].get<double>());
      EXPECT_GT(s["efficiency"].get<double>(), s["step_time_ratio"].get<double>());
    }
  }
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>()) << c["loss_check"].dump();
}

// One sequence spanning both ranks (as `long` at --cp 2): the packing has an
// empty sequence after it, and the context-parallel first loss is the loss of
// the same global batch on one rank alone.
TEST(StepRunnerCpHostTest, OneSequenceOverTwoRanksTrainsTheGlobalBatch) {
  StepConfig config = step_config("tiny");
  config.sequences = 1;
  config.seq_len = 64;
  config.tokens = 64;
  const nlohmann::json c = run_two_ranks(config);
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>()) << c["loss_check"].dump();

  const ModeResult alone = run_mode(context_parallel_config(config, 2), StepMode::kEager, quick(Device::kHost));
  const std::vector<float> cp = c["loss_check"]["stepgraph_eager_cp2"];
  ASSERT_FALSE(cp.empty() || alone.first_losses.empty());
  EXPECT_NEAR(cp.front(), alone.first_losses.front(), 1e-4 * std::fabs(alone.first_losses.front()));
}

}  // namespace
}  // namespace stepgraph::bench
