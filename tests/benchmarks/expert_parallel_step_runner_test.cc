// step_bench --ep's runner (Note [Expert-parallel rows] in
// benchmarks/expert_parallel_step_runner.h) on host worlds of threads: the
// rows of moe_tiny at EP 2 and 4, eager against graphed losses, the
// expert-parallel first loss against the ranks' mean alone, each rank holding
// its share of the experts, the efficiency arithmetic, a world of one, and
// the configs it refuses.
#include "benchmarks/expert_parallel_step_runner.h"

#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/host_world.h"
#include "tests/benchmarks/quick_run.h"
#include "tests/support/expect_error.h"

namespace stepgraph::bench {
namespace {

// Rank 0's JSON of run_ep_config over a host world of `ranks` threads (every rank's must agree).
nlohmann::json run_ranks(const StepConfig& config, int ranks) {
  std::mutex lock;
  std::vector<nlohmann::json> by_rank(static_cast<std::size_t>(ranks));
  HostWorld::run(ranks, [&](Communicator& comm) {
    nlohmann::json c = run_ep_config(config, quick(Device::kHost), &comm);
    std::lock_guard<std::mutex> guard(lock);
    by_rank[static_cast<std::size_t>(comm.rank())] = std::move(c);
  });
  for (int r = 1; r < ranks; ++r) {
    EXPECT_EQ(by_rank[r]["loss_check"], by_rank[0]["loss_check"]) << "rank " << r;
    EXPECT_EQ(by_rank[r]["ep_loss_check"], by_rank[0]["ep_loss_check"]) << "rank " << r;
  }
  return by_rank[0];
}

void expect_expert_parallel_rows(const nlohmann::json& c, int n) {
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  EXPECT_EQ(c["ep"], n);
  EXPECT_EQ(c["experts"], 4);
  EXPECT_EQ(c["experts_per_rank"], 4 / n);
  EXPECT_EQ(c["global_tokens"], n * 64);
  ASSERT_EQ(c["systems"].size(), 4u);
  const std::string epn = "ep" + std::to_string(n);
  const std::vector<std::string> names = {"stepgraph_eager_ep1", "stepgraph_graph_ep1", "stepgraph_eager_" + epn,
                                          "stepgraph_graph_" + epn};
  for (std::size_t i = 0; i < names.size(); ++i) {
    const nlohmann::json& s = c["systems"][i];
    EXPECT_EQ(s["system"], names[i]);
    EXPECT_EQ(s["ep"], i < 2 ? 1 : n);
    EXPECT_EQ(s["experts_per_rank"], i < 2 ? 4 : 4 / n);
    EXPECT_EQ(s["rank_median_us"].size(), static_cast<std::size_t>(n));
    const int row_world = i < 2 ? 1 : n;  // every rank runs an ep1 row, but alone
    EXPECT_EQ(s["world_size"], row_world);
    EXPECT_DOUBLE_EQ(s["global_tokens_per_s"].get<double>(), row_world * s["tokens_per_s"].get<double>());
    if (i < 2) {
      EXPECT_TRUE(s["scaling_efficiency"].is_null());
      EXPECT_TRUE(s["baseline_system"].is_null());
      continue;
    }
    const nlohmann::json& base = c["systems"][i - 2];
    const double t1 = base["step_us"]["median_us"].get<double>();
    const double tn = s["step_us"]["median_us"].get<double>();
    EXPECT_EQ(s["baseline_system"], base["system"]);
    EXPECT_DOUBLE_EQ(s["scaling_efficiency"].get<double>(), t1 / tn);
    EXPECT_DOUBLE_EQ(s["exposed_comm_us"].get<double>(), tn - t1);
    EXPECT_DOUBLE_EQ(s["exposed_comm_fraction"].get<double>(), (tn - t1) / tn);
    // Each rank holds 1/N of the experts: fewer masters, gradients and moments than the whole config.
    EXPECT_LT(s["persistent_breakdown_bytes"]["masters"].get<std::int64_t>(),
              base["persistent_breakdown_bytes"]["masters"].get<std::int64_t>());
    EXPECT_EQ(s["rank_first_loss"][0], s["rank_first_loss"][n - 1]) << "the loss is the group's mean on every rank";
  }
  EXPECT_TRUE(c["systems"][1].contains("pool_ratio"));
  EXPECT_TRUE(c["systems"][3].contains("pool_ratio"));
  const nlohmann::json& check = c["loss_check"];
  EXPECT_EQ(check["compared"], nlohmann::json({"stepgraph_eager_" + epn, "stepgraph_graph_" + epn}));
  EXPECT_TRUE(check["identical"].get<bool>()) << check.dump();
  EXPECT_TRUE(check["ranks_agree"].get<bool>()) << check.dump();
  // The ranks trained different batches alone, and the group's loss is their mean.
  const nlohmann::json& mean = c["ep_loss_check"]["graph"];
  EXPECT_NE(mean["baseline_rank_first_losses"][0], mean["baseline_rank_first_losses"][1]);
  EXPECT_TRUE(mean["agrees"].get<bool>()) << c["ep_loss_check"].dump();
  EXPECT_TRUE(c["ep_loss_check"]["eager"]["agrees"].get<bool>()) << c["ep_loss_check"].dump();
  EXPECT_FALSE(ep_losses_disagree(c));
}

TEST(ExpertParallelStepRunnerHostTest, MoeTinyOverTwoRanks) {
  const nlohmann::json c = run_ranks(step_config("moe_tiny"), 2);
  expect_expert_parallel_rows(c, 2);
  const std::string line = ep_config_line(c);
  EXPECT_NE(line.find("stepgraph_graph_ep2"), std::string::npos) << line;
  EXPECT_NE(line.find("efficiency"), std::string::npos) << line;
  EXPECT_NE(line.find("vs the ranks' mean alone: agrees"), std::string::npos) << line;
}

TEST(ExpertParallelStepRunnerHostTest, MoeTinyOverFourRanksOneExpertEach) {
  expect_expert_parallel_rows(run_ranks(step_config("moe_tiny"), 4), 4);
}

TEST(ExpertParallelStepRunnerHostTest, WorldOfOneRunsTheBaselineRows) {
  const nlohmann::json c = run_ep_config(step_config("moe_tiny"), quick(Device::kHost), nullptr);
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  ASSERT_EQ(c["systems"].size(), 2u);
  EXPECT_EQ(c["systems"][0]["system"], "stepgraph_eager_ep1");
  EXPECT_EQ(c["loss_check"]["compared"], nlohmann::json({"stepgraph_eager_ep1", "stepgraph_graph_ep1"}));
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>());
  EXPECT_FALSE(c.contains("ep_loss_check"));
  // A dense config in a world of one is a failed row naming --ep, not a crash.
  const nlohmann::json dense = run_ep_config(step_config("tiny"), quick(Device::kHost), nullptr);
  EXPECT_EQ(dense["status"], "failed");
  EXPECT_NE(dense["reason"].get<std::string>().find("config tiny has no experts"), std::string::npos)
      << dense["reason"];
}

TEST(ExpertParallelStepRunnerTest, RefusesConfigsWhoseExpertsDoNotSplit) {
  EXPECT_NO_THROW(check_expert_parallel_config(step_config("moe"), 2));
  EXPECT_NO_THROW(check_expert_parallel_config(step_config("moe"), 8));
  EXPECT_ERROR_CONTAINS(check_expert_parallel_config(step_config("medium"), 2), "--ep 2: config medium has no experts",
                        "leave it out of --configs");
  EXPECT_ERROR_CONTAINS(check_expert_parallel_config(step_config("moe"), 3),
                        "config moe's 8 experts do not divide by --ep 3");
  EXPECT_ERROR_CONTAINS(check_expert_parallel_config(step_config("moe_tiny"), 0), "--ep must be the number of ranks");
}

// The derived fields from made-up timings, and what makes the losses disagree.
TEST(ExpertParallelStepRunnerTest, EfficiencyAndLossChecksFromResults) {
  const auto row = [](double median_us, float loss, float rank1_loss) {
    ModeResult r;
    r.samples_us = {median_us, median_us, median_us};
    r.step_us = summarize(r.samples_us);
    r.pipelined_step_us = median_us;
    r.first_losses = {loss};
    ModeResult other = r;
    other.first_losses = {rank1_loss};
    return combine_ranks({r, other});
  };
  ExpertParallelResults results;
  results.world_size = 2;
  results.alone_eager = row(1000, 5.0f, 6.0f);
  results.alone_graph = row(800, 5.0f, 6.0f);
  results.parallel_eager = row(1250, 5.5f, 5.5f);
  results.parallel_graph = row(1000, 5.5f, 5.5f);
  const nlohmann::json c = ep_config_json(step_config("moe"), results);
  const nlohmann::json& graph = c["systems"][3];
  EXPECT_DOUBLE_EQ(graph["scaling_efficiency"].get<double>(), 0.8);
  EXPECT_DOUBLE_EQ(graph["exposed_comm_us"].get<double>(), 200.0);
  EXPECT_DOUBLE_EQ(graph["exposed_comm_fraction"].get<double>(), 0.2);
  EXPECT_DOUBLE_EQ(c["systems"][2]["scaling_efficiency"].get<double>(), 0.8);
  EXPECT_EQ(graph["experts_per_rank"], 4);
  EXPECT_DOUBLE_EQ(c["ep_loss_check"]["graph"]["baseline_mean_first_loss"].get<double>(), 5.5);
  EXPECT_FALSE(ep_losses_disagree(c));
  results.parallel_graph = row(1000, 5.5f, 5.75f);  // the group's loss differs between its ranks
  nlohmann::json split = ep_config_json(step_config("moe"), results);
  EXPECT_FALSE(split["loss_check"]["ranks_agree"].get<bool>());
  EXPECT_TRUE(ep_losses_disagree(split));
  results.parallel_graph = row(1000, 5.0f, 5.0f);  // eager and graph differ, and 5.0 is not the ranks' mean
  split = ep_config_json(step_config("moe"), results);
  EXPECT_FALSE(split["loss_check"]["identical"].get<bool>());
  EXPECT_FALSE(split["ep_loss_check"]["graph"]["agrees"].get<bool>());
  EXPECT_TRUE(ep_losses_disagree(split));
}

}  // namespace
}  // namespace stepgraph::bench
