// step_bench --pp's runner (Note [Pipeline-parallel rows] in
// benchmarks/pipeline_step_runner.h) on host worlds of 2 ranks (threads):
// the rows, eager against graphed losses, the pipeline's first loss against
// one rank training the whole model, the theoretical and measured bubble,
// interleaved stages (V = 2) on a 4-layer tiny GPT, a world of one, and the
// configs and flags it refuses.
#include "benchmarks/pipeline_step_runner.h"

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

// Rank 0's JSON of run_pipeline_config over a host world of 2 ranks (both must agree).
nlohmann::json run_two_ranks(const StepConfig& config, const PipelineRunOptions& pipeline) {
  std::mutex lock;
  std::vector<nlohmann::json> by_rank(2);
  HostWorld::run(2, [&](Communicator& comm) {
    nlohmann::json c = run_pipeline_config(config, quick(Device::kHost), &comm, pipeline);
    std::lock_guard<std::mutex> guard(lock);
    by_rank[static_cast<std::size_t>(comm.rank())] = std::move(c);
  });
  EXPECT_EQ(by_rank[1]["loss_check"], by_rank[0]["loss_check"]);
  EXPECT_EQ(by_rank[1]["pp_loss_check"], by_rank[0]["pp_loss_check"]);
  return by_rank[0];
}

// The checks every two-rank result passes.
void expect_pipeline_rows(const nlohmann::json& c, int virtual_stages, std::int64_t microbatches) {
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  EXPECT_EQ(c["pp"], 2);
  EXPECT_EQ(c["virtual_stages"], virtual_stages);
  EXPECT_EQ(c["microbatches"], microbatches);
  EXPECT_EQ(c["tokens"], microbatches * 32);  // one sequence of seq_len 32 a microbatch
  EXPECT_EQ(c["sequences"], microbatches);
  EXPECT_EQ(c["schedule"], virtual_stages > 1 ? "interleaved 1F1B" : "1F1B");
  const double theoretical = 1.0 / (virtual_stages * microbatches + 1.0);
  EXPECT_DOUBLE_EQ(c["theoretical_bubble_fraction"].get<double>(), theoretical);
  ASSERT_EQ(c["systems"].size(), 4u);
  const std::vector<std::string> names = {"stepgraph_eager_pp1", "stepgraph_graph_pp1", "stepgraph_eager_pp2",
                                          "stepgraph_graph_pp2"};
  for (std::size_t i = 0; i < names.size(); ++i) {
    const nlohmann::json& s = c["systems"][i];
    EXPECT_EQ(s["system"], names[i]);
    EXPECT_EQ(s["pp"], i < 2 ? 1 : 2);
    EXPECT_EQ(s["rank_median_us"].size(), 2u);
    EXPECT_EQ(s["rank_first_loss"][0], s["rank_first_loss"][1]) << "the loss is given to every rank";
    if (i % 2 == 1) {
      EXPECT_EQ(s["rank_pool_bytes"].size(), 2u);
      EXPECT_GE(s["rank_pool_bytes"][1].get<std::int64_t>(), s["rank_pool_lower_bound_bytes"][1].get<std::int64_t>());
      EXPECT_DOUBLE_EQ(
          s["graph_speedup_vs_eager"].get<double>(),
          c["systems"][i - 1]["step_us"]["median_us"].get<double>() / s["step_us"]["median_us"].get<double>());
    } else {
      EXPECT_FALSE(s.contains("graph_speedup_vs_eager"));
    }
    if (i < 2) {
      EXPECT_TRUE(s["measured_bubble_fraction"].is_null());
      EXPECT_DOUBLE_EQ(s["theoretical_bubble_fraction"].get<double>(), 0.0);
    } else {
      const nlohmann::json& base = c["systems"][i - 2];
      EXPECT_EQ(s["baseline_system"], base["system"]);
      const double measured =
          1.0 - base["step_us"]["median_us"].get<double>() / (2.0 * s["step_us"]["median_us"].get<double>());
      EXPECT_DOUBLE_EQ(s["measured_bubble_fraction"].get<double>(), measured);
      EXPECT_DOUBLE_EQ(s["theoretical_bubble_fraction"].get<double>(), theoretical);
      EXPECT_DOUBLE_EQ(s["bubble_ratio"].get<double>(), measured / theoretical);
    }
  }
  const nlohmann::json& check = c["loss_check"];
  EXPECT_EQ(check["compared"], nlohmann::json({"stepgraph_eager_pp2", "stepgraph_graph_pp2"}));
  EXPECT_TRUE(check["identical"].get<bool>()) << check.dump();
  EXPECT_TRUE(check["ranks_agree"].get<bool>()) << check.dump();
  // Pipelining changes no sum's order: the pipeline's losses are one rank's, bit for bit.
  EXPECT_EQ(check["stepgraph_eager_pp2"], check["stepgraph_eager_pp1"]);
  EXPECT_TRUE(c["pp_loss_check"]["eager"]["identical"].get<bool>()) << c["pp_loss_check"].dump();
  EXPECT_TRUE(c["pp_loss_check"]["graph"]["identical"].get<bool>()) << c["pp_loss_check"].dump();
  EXPECT_FALSE(pipeline_losses_disagree(c));
}

TEST(PipelineStepRunnerHostTest, TinyInTwoStages) {
  const nlohmann::json c = run_two_ranks(step_config("tiny"), {.virtual_stages = 1, .microbatches = 4});
  expect_pipeline_rows(c, 1, 4);
  EXPECT_EQ(c["blocks_per_chunk"], 1);
  const std::string line = pipeline_config_line(c);
  EXPECT_NE(line.find("stepgraph_graph_pp2"), std::string::npos) << line;
  EXPECT_NE(line.find("theoretical"), std::string::npos) << line;
}

// Interleaved 1F1B: a tiny GPT of 4 layers, 2 chunks of one block a rank.
TEST(PipelineStepRunnerHostTest, InterleavedStagesOfAFourLayerTiny) {
  StepConfig config = step_config("tiny");
  config.model.layers = 4;
  const nlohmann::json c = run_two_ranks(config, {.virtual_stages = 2, .microbatches = 4});
  expect_pipeline_rows(c, 2, 4);
  EXPECT_EQ(c["blocks_per_chunk"], 1);
}

TEST(PipelineStepRunnerHostTest, WorldOfOneRunsTheBaselineRows) {
  const nlohmann::json c =
      run_pipeline_config(step_config("tiny"), quick(Device::kHost), nullptr, {.virtual_stages = 1, .microbatches = 2});
  ASSERT_EQ(c["status"], "ok") << c.dump(1);
  ASSERT_EQ(c["systems"].size(), 2u);
  EXPECT_EQ(c["systems"][0]["system"], "stepgraph_eager_pp1");
  EXPECT_EQ(c["loss_check"]["compared"], nlohmann::json({"stepgraph_eager_pp1", "stepgraph_graph_pp1"}));
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>());
  EXPECT_FALSE(c.contains("pp_loss_check"));
  // A world of one refuses interleaving as a config row, not a crash.
  const nlohmann::json refused =
      run_pipeline_config(step_config("tiny"), quick(Device::kHost), nullptr, {.virtual_stages = 2, .microbatches = 2});
  EXPECT_EQ(refused["status"], "failed");
  EXPECT_NE(refused["reason"].get<std::string>().find("--virtual-stages 2 needs --pp 2 or more"), std::string::npos)
      << refused["reason"];
}

TEST(PipelineStepRunnerTest, TheoreticalBubble) {
  EXPECT_DOUBLE_EQ(theoretical_bubble_fraction(2, 1, 8), 1.0 / 9.0);
  EXPECT_DOUBLE_EQ(theoretical_bubble_fraction(2, 2, 8), 1.0 / 17.0);
  EXPECT_DOUBLE_EQ(theoretical_bubble_fraction(4, 1, 4), 3.0 / 7.0);
  EXPECT_DOUBLE_EQ(theoretical_bubble_fraction(1, 1, 8), 0.0);
  EXPECT_ERROR_CONTAINS(theoretical_bubble_fraction(2, 1, 0), "microbatches must be >= 1");
}

TEST(PipelineStepRunnerTest, StepConfigIsMicrobatchesOfOneSequence) {
  const StepConfig step = pipeline_step_config(step_config("large"), 8);
  EXPECT_EQ(step.sequences, 8);
  EXPECT_EQ(step.seq_len, 4096);
  EXPECT_EQ(step.tokens, 8 * 4096);
  EXPECT_EQ(step.model.layers, 4);
}

TEST(PipelineStepRunnerTest, RefusesConfigsTheStagesCannotSplit) {
  EXPECT_NO_THROW(check_pipeline_config(step_config("large"), 2, {.virtual_stages = 2, .microbatches = 8}));
  EXPECT_NO_THROW(check_pipeline_config(step_config("medium"), 2, {.virtual_stages = 1, .microbatches = 8}));
  EXPECT_ERROR_CONTAINS(check_pipeline_config(step_config("tiny"), 2, {.virtual_stages = 2, .microbatches = 4}),
                        "config tiny has 2 layers, which do not divide by --pp x --virtual-stages = 4");
  EXPECT_ERROR_CONTAINS(check_pipeline_config(step_config("large"), 8, {.virtual_stages = 1, .microbatches = 8}),
                        "config large has 4 layers");
  EXPECT_ERROR_CONTAINS(check_pipeline_config(step_config("moe"), 2, {.virtual_stages = 1, .microbatches = 8}),
                        "config moe is not a dense GPT");
  EXPECT_ERROR_CONTAINS(check_pipeline_config(step_config("large"), 2, {.virtual_stages = 2, .microbatches = 5}),
                        "--microbatches 5 must be a multiple of --pp");
  EXPECT_ERROR_CONTAINS(check_pipeline_config(step_config("large"), 2, {.virtual_stages = 0, .microbatches = 8}),
                        "--virtual-stages must be >= 1");
  EXPECT_ERROR_CONTAINS(check_pipeline_config(step_config("large"), 2, {.virtual_stages = 1, .microbatches = 0}),
                        "--microbatches must be >= 1");
}

// The derived fields from made-up timings: the bubble and the graph speedup.
TEST(PipelineStepRunnerTest, BubbleAndSpeedupFromResults) {
  const auto row = [](double median_us, float loss, float rank1_loss = 0) {
    ModeResult r;
    r.samples_us = {median_us, median_us, median_us};
    r.step_us = summarize(r.samples_us);
    r.pipelined_step_us = median_us;
    r.first_losses = {loss};
    r.pool_bytes = 110;
    r.pool_lower_bound_bytes = 100;
    PipelineRowResult out;
    out.ranks = {r, r};
    if (rank1_loss != 0) out.ranks[1].first_losses = {rank1_loss};
    out.combined = combine_ranks(out.ranks);
    return out;
  };
  PipelineResults results;
  results.world_size = 2;
  results.pipeline = {.virtual_stages = 1, .microbatches = 8};
  results.alone_eager = row(1000, 5.0f);
  results.alone_graph = row(800, 5.0f);
  results.pipeline_eager = row(900, 5.0f);
  results.pipeline_graph = row(600, 5.0f);
  const nlohmann::json c = pipeline_config_json(step_config("large"), results);
  const nlohmann::json& graph = c["systems"][3];
  EXPECT_DOUBLE_EQ(graph["graph_speedup_vs_eager"].get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(graph["measured_bubble_fraction"].get<double>(), 1.0 - 800.0 / 1200.0);
  EXPECT_DOUBLE_EQ(graph["theoretical_bubble_fraction"].get<double>(), 1.0 / 9.0);
  EXPECT_DOUBLE_EQ(graph["bubble_ratio"].get<double>(), 9.0 / 3.0);
  EXPECT_DOUBLE_EQ(graph["rank_pool_ratio"][1].get<double>(), 1.1);
  EXPECT_DOUBLE_EQ(c["systems"][2]["measured_bubble_fraction"].get<double>(), 1.0 - 1000.0 / 1800.0);
  EXPECT_FALSE(pipeline_losses_disagree(c));
  results.pipeline_graph = row(600, 5.5f);  // eager and graph differ at pp2
  EXPECT_TRUE(pipeline_losses_disagree(pipeline_config_json(step_config("large"), results)));
  results.pipeline_graph = row(600, 5.0f, 5.25f);  // the broadcast loss differs between the stages
  nlohmann::json split = pipeline_config_json(step_config("large"), results);
  EXPECT_FALSE(split["loss_check"]["ranks_agree"].get<bool>());
  EXPECT_TRUE(pipeline_losses_disagree(split));
  results.pipeline_graph = row(600, 5.0f);
  results.alone_graph = row(800, 5.0f, 5.25f);  // ranks alone may differ: only the pipeline broadcasts
  EXPECT_FALSE(pipeline_losses_disagree(pipeline_config_json(step_config("large"), results)));
  results.alone_graph = row(800, 6.0f);  // the pipeline's first loss is not one rank's
  split = pipeline_config_json(step_config("large"), results);
  EXPECT_FALSE(split["pp_loss_check"]["graph"]["agrees"].get<bool>());
  EXPECT_TRUE(pipeline_losses_disagree(split));
}

}  // namespace
}  // namespace stepgraph::bench
