// step_bench --dp's runner (Note [Data-parallel rows] in benchmarks/step_runner.h): the
// flag checks, combining the ranks' samples, the scaling arithmetic of the
// JSON, and real data-parallel runs of the tiny config on host worlds of 2
// ranks (threads), all-reduce and ZeRO-1. On CUDA where there is a GPU (the
// bundle), world size 1 with the small config.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "benchmarks/step_runner.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/benchmarks/quick_run.h"

namespace stepgraph::bench {
namespace {

TEST(StepRunnerDpTest, DpFlagMustMatchTheWorld) {
  EXPECT_NO_THROW(check_dp_flag(0, 1));
  EXPECT_NO_THROW(check_dp_flag(1, 1));
  EXPECT_NO_THROW(check_dp_flag(4, 4));
  EXPECT_ERROR_CONTAINS(check_dp_flag(-1, 1), "--dp must be the number of ranks (>= 1), got -1");
  EXPECT_ERROR_CONTAINS(check_dp_flag(0, 2), "one of 2 ranks", "--dp was not given: pass --dp 2");
  EXPECT_ERROR_CONTAINS(check_dp_flag(2, 1), "--dp 2 needs 2 ranks", "torchrun --no-python --nproc-per-node 2",
                        "this run has 1 (no launcher variables: one process); --dp 1 runs the baseline alone");
  EXPECT_ERROR_CONTAINS(check_dp_flag(2, 4), "--dp 2 needs 2 ranks", "this run has 4");
}

// The names the JSON and the flags use (step_bench reads --dp-mode into the enum where it parses).
TEST(StepRunnerDpTest, DpModeNames) {
  EXPECT_EQ(data_parallel_mode_name(DataParallelMode::kAllReduce), "allreduce");
  EXPECT_EQ(data_parallel_mode_name(DataParallelMode::kZero1), "zero1");
}

ModeResult fake(std::vector<double> samples, double pipelined, float first_loss, std::int64_t persistent = 100) {
  ModeResult r;
  r.samples_us = std::move(samples);
  r.step_us = summarize(r.samples_us);
  r.pipelined_step_us = pipelined;
  r.first_losses = {first_loss, first_loss - 0.5f};
  r.final_loss = first_loss - 1.0f;
  r.persistent_bytes = persistent;
  r.transient_peak_bytes = 10;
  r.pool_bytes = 8;
  r.pool_lower_bound_bytes = 8;
  r.capture = {1, 2, 3, 4, 5};
  r.capture_wall_ms = 20;
  return r;
}

TEST(StepRunnerDpTest, CombineRanksTakesTheSlowestRankOfEachSample) {
  const RankedResult r = combine_ranks({fake({10, 30, 20}, 15, 4.0f, 100), fake({25, 5, 20}, 18, 6.0f, 300)});
  EXPECT_EQ(r.combined.samples_us, (std::vector<double>{25, 30, 20}));
  EXPECT_DOUBLE_EQ(r.combined.step_us.median_us, 25);
  EXPECT_DOUBLE_EQ(r.combined.step_us.min_us, 20);
  EXPECT_DOUBLE_EQ(r.combined.pipelined_step_us, 18);
  EXPECT_EQ(r.combined.persistent_bytes, 300);
  EXPECT_EQ(r.combined.first_losses, (std::vector<float>{4.0f, 3.5f}));  // rank 0's
  EXPECT_EQ(r.rank_median_us, (std::vector<double>{20, 20}));
  EXPECT_EQ(r.rank_first_loss, (std::vector<float>{4.0f, 6.0f}));
  EXPECT_ERROR_CONTAINS(combine_ranks({fake({1, 2}, 1, 1), fake({1}, 1, 1)}), "rank 1 timed 1 steps, rank 0 2");
}

TEST(StepRunnerDpTest, ModeResultsTravelAsJson) {
  ModeResult r = fake({1.25, 3.5, 2.0}, 2.5, 7.125f);
  r.device_used_delta_bytes = 4096;
  const ModeResult back = mode_result_from_json(nlohmann::json::parse(mode_result_to_json(r).dump()));
  EXPECT_EQ(back.samples_us, r.samples_us);
  EXPECT_DOUBLE_EQ(back.step_us.median_us, 2.0);
  EXPECT_EQ(back.first_losses, r.first_losses);
  EXPECT_EQ(back.final_loss, r.final_loss);
  EXPECT_EQ(back.device_used_delta_bytes, r.device_used_delta_bytes);
  EXPECT_EQ(back.capture.instantiate_ms, 5);
  EXPECT_EQ(back.capture_wall_ms, 20);
  EXPECT_FALSE(mode_result_from_json(mode_result_to_json(fake({1}, 1, 1))).device_used_delta_bytes.has_value());
}

const nlohmann::json& system_named(const nlohmann::json& config, const std::string& name) {
  for (const nlohmann::json& s : config["systems"]) {
    if (s["system"] == name) return s;
  }
  ADD_FAILURE() << "no system " << name << " in " << config.dump(1);
  static const nlohmann::json none;
  return none;
}

TEST(StepRunnerDpTest, ScalingEfficiencyAndExposedCommunicationComeFromTheBaseline) {
  const StepConfig config = step_config("tiny");
  DataParallelResults results;
  results.world_size = 2;
  results.mode = DataParallelMode::kZero1;
  results.baseline_eager = combine_ranks({fake({200, 200, 200}, 190, 6.0f), fake({200, 200, 200}, 190, 5.0f)});
  results.baseline_graph = combine_ranks({fake({100, 100, 100}, 90, 6.0f), fake({100, 100, 100}, 90, 5.0f)});
  results.dp_eager = combine_ranks({fake({250, 250, 250}, 200, 5.5f), fake({250, 250, 250}, 200, 5.5f)});
  results.dp_graph = combine_ranks({fake({125, 125, 125}, 100, 5.5f), fake({125, 125, 125}, 100, 5.5f)});
  const nlohmann::json c = dp_config_json(config, results);
  EXPECT_EQ(c["status"], "ok");
  EXPECT_EQ(c["world_size"], 2);
  EXPECT_EQ(c["global_tokens"], 2 * config.tokens);
  EXPECT_EQ(c["dp_mode"], "zero1");
  ASSERT_EQ(c["systems"].size(), 4u);

  const nlohmann::json& graph = system_named(c, "stepgraph_graph_dp2");
  EXPECT_EQ(graph["world_size"], 2);
  EXPECT_EQ(graph["dp_mode"], "zero1");
  EXPECT_EQ(graph["baseline_system"], "stepgraph_graph_dp1");
  EXPECT_DOUBLE_EQ(graph["tokens_per_s"].get<double>(), config.tokens / 125e-6);  // per GPU
  EXPECT_DOUBLE_EQ(graph["global_tokens_per_s"].get<double>(), 2 * config.tokens / 125e-6);
  EXPECT_DOUBLE_EQ(graph["scaling_efficiency"].get<double>(), 0.8);  // 100 / 125
  EXPECT_DOUBLE_EQ(graph["exposed_comm_us"].get<double>(), 25);
  EXPECT_DOUBLE_EQ(graph["exposed_comm_fraction"].get<double>(), 0.2);
  EXPECT_DOUBLE_EQ(graph["pipelined_scaling_efficiency"].get<double>(), 0.9);
  EXPECT_DOUBLE_EQ(graph["pipelined_exposed_comm_us"].get<double>(), 10);
  EXPECT_DOUBLE_EQ(graph["pipelined_exposed_comm_fraction"].get<double>(), 0.1);
  EXPECT_DOUBLE_EQ(graph["speedup_vs_stepgraph_eager"].get<double>(), 2.0);  // against the eager at the same N
  EXPECT_EQ(graph["pool_ratio"], 1.0);
  EXPECT_EQ(graph["rank_median_us"], nlohmann::json({125.0, 125.0}));

  const nlohmann::json& eager = system_named(c, "stepgraph_eager_dp2");
  EXPECT_DOUBLE_EQ(eager["scaling_efficiency"].get<double>(), 0.8);  // 200 / 250
  EXPECT_FALSE(eager.contains("pool_bytes"));
  const nlohmann::json& base = system_named(c, "stepgraph_graph_dp1");
  EXPECT_EQ(base["world_size"], 1);
  EXPECT_TRUE(base["dp_mode"].is_null());
  EXPECT_TRUE(base["scaling_efficiency"].is_null());
  EXPECT_TRUE(base["exposed_comm_us"].is_null());

  // The data-parallel first loss is the mean of the ranks' own (6 and 5).
  EXPECT_TRUE(c["dp_loss_check"]["graph"]["agrees"].get<bool>()) << c["dp_loss_check"].dump();
  EXPECT_DOUBLE_EQ(c["dp_loss_check"]["graph"]["baseline_mean_first_loss"].get<double>(), 5.5);
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>());
  EXPECT_EQ(c["loss_check"]["compared"], nlohmann::json({"stepgraph_eager_dp2", "stepgraph_graph_dp2"}));

  results.dp_graph = combine_ranks({fake({125}, 100, 5.9f), fake({125}, 100, 5.9f)});
  results.dp_eager = combine_ranks({fake({250}, 200, 5.5f), fake({250}, 200, 5.5f)});
  results.baseline_eager = combine_ranks({fake({200}, 190, 6.0f), fake({200}, 190, 5.0f)});
  results.baseline_graph = combine_ranks({fake({100}, 90, 6.0f), fake({100}, 90, 5.0f)});
  EXPECT_FALSE(dp_config_json(config, results)["dp_loss_check"]["graph"]["agrees"].get<bool>());
}

TEST(StepRunnerDpTest, WorldOfOneHasTheBaselineRowsOnly) {
  DataParallelResults results;
  results.baseline_eager = combine_ranks({fake({200}, 190, 6.0f)});
  results.baseline_graph = combine_ranks({fake({100}, 90, 6.0f)});
  const nlohmann::json c = dp_config_json(step_config("tiny"), results);
  ASSERT_EQ(c["systems"].size(), 2u);
  EXPECT_EQ(c["systems"][0]["system"], "stepgraph_eager_dp1");
  EXPECT_EQ(c["systems"][1]["system"], "stepgraph_graph_dp1");
  EXPECT_TRUE(c["dp_mode"].is_null());
  EXPECT_FALSE(c.contains("dp_loss_check"));
  results.dp_graph = results.baseline_graph;  // N = 1 with data-parallel rows: a bug
  EXPECT_ERROR_CONTAINS(dp_config_json(step_config("tiny"), results), "world size 1 with data-parallel results");
}

// Every row of a real run carries the data-parallel fields.
void expect_dp_fields(const nlohmann::json& c, int world) {
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  for (const nlohmann::json& s : c["systems"]) {
    for (const char* key : {"world_size", "dp_mode", "rank_median_us", "tokens_per_s", "global_tokens_per_s",
                            "scaling_efficiency", "exposed_comm_us", "exposed_comm_fraction", "pipelined_step_us"}) {
      EXPECT_TRUE(s.contains(key)) << s["system"] << " lacks " << key;
    }
    EXPECT_EQ(s["rank_median_us"].size(), static_cast<std::size_t>(world));  // dp1 rows too: every rank ran alone
    EXPECT_TRUE(std::isfinite(s["final_loss"].get<double>()));
  }
}

void run_host_world(DataParallelMode mode) {
  const StepConfig config = step_config("tiny");
  std::mutex lock;
  std::vector<nlohmann::json> by_rank(2);
  HostWorld::run(2, [&](Communicator& comm) {
    nlohmann::json c = run_dp_config(config, quick(Device::kHost), &comm, mode);
    std::lock_guard<std::mutex> guard(lock);
    by_rank[static_cast<std::size_t>(comm.rank())] = std::move(c);
  });
  const nlohmann::json& c = by_rank[0];
  expect_dp_fields(c, 2);
  std::set<std::string> names;
  for (const nlohmann::json& s : c["systems"]) names.insert(s["system"]);
  EXPECT_EQ(names, (std::set<std::string>{"stepgraph_eager_dp1", "stepgraph_graph_dp1", "stepgraph_eager_dp2",
                                          "stepgraph_graph_dp2"}));
  EXPECT_EQ(c["dp_mode"], std::string(data_parallel_mode_name(mode)));
  // The ranks trained on different batches: their first losses alone differ,
  // and the data-parallel first loss is their mean, eager and graphed.
  const nlohmann::json& check = c["dp_loss_check"];
  for (const char* m : {"eager", "graph"}) {
    SCOPED_TRACE(m);
    EXPECT_NE(check[m]["baseline_rank_first_losses"][0], check[m]["baseline_rank_first_losses"][1]);
    EXPECT_TRUE(check[m]["agrees"].get<bool>()) << check.dump(1);
  }
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>()) << c["loss_check"].dump();
  const std::vector<float> dp = c["loss_check"]["stepgraph_graph_dp2"];
  EXPECT_LT(dp.back(), dp.front()) << "the data-parallel loss did not fall";
  // Every rank built the same JSON (the results went to every rank).
  EXPECT_EQ(by_rank[1]["systems"].size(), c["systems"].size());
  EXPECT_EQ(by_rank[1]["loss_check"], c["loss_check"]);
}

TEST(StepRunnerDpHostTest, AllReduceOnTwoRanks) { run_host_world(DataParallelMode::kAllReduce); }

TEST(StepRunnerDpHostTest, Zero1OnTwoRanks) { run_host_world(DataParallelMode::kZero1); }

TEST(StepRunnerDpHostTest, OneProcessRunsTheBaselineAlone) {
  const nlohmann::json c = run_dp_config(step_config("tiny"), quick(Device::kHost), nullptr, DataParallelMode::kZero1);
  expect_dp_fields(c, 1);
  ASSERT_EQ(c["systems"].size(), 2u);
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>());
  StepConfig broken = step_config("tiny");
  broken.tokens = 0;
  const nlohmann::json failed = run_dp_config(broken, quick(Device::kHost), nullptr, DataParallelMode::kAllReduce);
  EXPECT_EQ(failed["status"], "failed");
}

TEST(StepRunnerDpCudaTest, SmallConfigAtWorldSizeOne) {
  SG_SKIP_WITHOUT_GPU();
  const nlohmann::json c =
      run_dp_config(step_config("small"), quick(Device::kCuda), nullptr, DataParallelMode::kAllReduce);
  expect_dp_fields(c, 1);
  ASSERT_EQ(c["systems"].size(), 2u);
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>()) << c["loss_check"].dump();
  for (const nlohmann::json& s : c["systems"]) EXPECT_GT(s["device_used_delta_bytes"].get<std::int64_t>(), 0);
}

}  // namespace
}  // namespace stepgraph::bench
