// step_bench's runner: both modes of a real training step, the loss check and
// the JSON it writes. On the host with the smoke config; on CUDA where there
// is a GPU (the bundle), with the small benchmark config.
#include "benchmarks/step_runner.h"

#include <gtest/gtest.h>

#include <cmath>

#include "engine/error.h"
#include "tests/support/gpu.h"
#include "tests/support/expect_error.h"
#include "tests/benchmarks/quick_run.h"

namespace stepgraph::bench {
namespace {

void expect_ok_config(const nlohmann::json& c, int checked_steps) {
  ASSERT_EQ(c["status"], "ok") << c.dump(2);
  EXPECT_EQ(c["loss_check"]["steps"], checked_steps);
  EXPECT_TRUE(c["loss_check"]["identical"].get<bool>()) << c["loss_check"].dump();
  const std::vector<float> losses = c["loss_check"]["stepgraph_eager"];
  EXPECT_LT(losses.back(), losses.front()) << "the loss did not fall on a fixed batch";
  ASSERT_EQ(c["systems"].size(), 2u);
  const nlohmann::json& eager = c["systems"][0];
  const nlohmann::json& graph = c["systems"][1];
  EXPECT_EQ(eager["system"], "stepgraph_eager");
  EXPECT_EQ(graph["system"], "stepgraph_graph");
  EXPECT_DOUBLE_EQ(eager["speedup_vs_stepgraph_eager"].get<double>(), 1.0);
  for (const nlohmann::json& s : {eager, graph}) {
    const double median = s["step_us"]["median_us"];
    EXPECT_GT(median, 0);
    EXPECT_LE(s["step_us"]["min_us"].get<double>(), median);
    EXPECT_GE(s["step_us"]["max_us"].get<double>(), median);
    EXPECT_NEAR(s["tokens_per_s"].get<double>(), c["tokens"].get<double>() / (median * 1e-6),
                1e-6 * s["tokens_per_s"].get<double>());
    EXPECT_NEAR(s["tflops"].get<double>(), c["flops_per_step"].get<double>() / (median * 1e-6) / 1e12, 1e-9);
    EXPECT_GT(s["persistent_bytes"].get<std::int64_t>(), 0);
    EXPECT_EQ(s["peak_bytes"].get<std::int64_t>(),
              s["persistent_bytes"].get<std::int64_t>() + s["transient_peak_bytes"].get<std::int64_t>());
    EXPECT_TRUE(std::isfinite(s["final_loss"].get<double>()));
    // What the persistent bytes hold adds up to them: fp32 masters and
    // gradients alike, two moments a master, the rest not negative.
    const nlohmann::json& kinds = s["persistent_breakdown_bytes"];
    std::int64_t sum = 0;
    for (const auto& [kind, bytes] : kinds.items()) sum += bytes.get<std::int64_t>();
    EXPECT_EQ(sum, s["persistent_bytes"].get<std::int64_t>()) << kinds.dump();
    EXPECT_GT(kinds["masters"].get<std::int64_t>(), 0);
    EXPECT_EQ(kinds["gradients"], kinds["masters"]) << kinds.dump();
    EXPECT_EQ(kinds["moments"].get<std::int64_t>(), 2 * kinds["masters"].get<std::int64_t>()) << kinds.dump();
    EXPECT_GE(kinds["other"].get<std::int64_t>(), 0) << kinds.dump();
  }
  // The same parameters, gradients and optimizer state in both modes.
  EXPECT_EQ(eager["persistent_bytes"], graph["persistent_bytes"]);
  EXPECT_GT(graph["pool_bytes"].get<std::int64_t>(), 0);
  EXPECT_GE(graph["pool_bytes"].get<std::int64_t>(), graph["pool_lower_bound_bytes"].get<std::int64_t>());
  EXPECT_LE(graph["pool_ratio"].get<double>(), 1.10);
  EXPECT_GE(graph["transient_peak_bytes"].get<std::int64_t>(), graph["pool_bytes"].get<std::int64_t>());
  EXPECT_GT(graph["capture_ms"]["wall"].get<double>(), 0);
  // What fills the pool at its fullest: the values the lower bound counts there.
  std::int64_t at_peak = 0;
  for (const auto& entry : graph["pool_peak_by_op_bytes"]) at_peak += entry[1].get<std::int64_t>();
  EXPECT_GT(at_peak, 0);
  EXPECT_LE(at_peak, graph["pool_lower_bound_bytes"].get<std::int64_t>());
}

TEST(StepRunnerHostTest, TinyConfigRunsBothModesWithIdenticalLosses) {
  const nlohmann::json c = run_config(step_config("tiny"), quick(Device::kHost));
  expect_ok_config(c, 3);
  EXPECT_TRUE(c["systems"][0]["device_used_delta_bytes"].is_null());
}

TEST(StepRunnerHostTest, MoEConfigRunsOrSaysWhyNot) {
  StepConfig config = step_config("tiny");
  config.model.experts = 4;
  config.model.topk = 2;
  config.model.moe_every = 1;
  const nlohmann::json c = run_config(config, quick(Device::kHost));
  if (c["status"] == "not_run") {
    EXPECT_NE(c["reason"].get<std::string>().find("MoE"), std::string::npos) << c["reason"];
    EXPECT_TRUE(c["systems"].empty());
  } else {
    expect_ok_config(c, 3);
  }
}

TEST(StepRunnerHostTest, AFailingConfigIsReportedNotThrown) {
  StepConfig config = step_config("tiny");
  config.tokens = 0;  // TrainStep refuses it
  nlohmann::json c;
  EXPECT_NO_THROW(c = run_config(config, quick(Device::kHost)));
  EXPECT_EQ(c["status"], "failed");
  EXPECT_NE(c["reason"].get<std::string>().find("tokens"), std::string::npos) << c["reason"];
}

TEST(StepRunnerHostTest, BadOptionsAreErrors) {
  StepRunOptions options = quick(Device::kHost);
  options.steps = 0;
  EXPECT_ERROR_CONTAINS(run_mode(step_config("tiny"), StepMode::kEager, options), "--steps must be >= 1, got 0");
  options = quick(Device::kHost);
  options.warmup = 0;
  EXPECT_ERROR_CONTAINS(run_mode(step_config("tiny"), StepMode::kGraph, options), "--warmup must be >= 1", "got 0");
}

TEST(StepRunnerCudaTest, SmallConfigRunsBothModesWithIdenticalLosses) {
  SG_SKIP_WITHOUT_GPU();
  const nlohmann::json c = run_config(step_config("small"), quick(Device::kCuda));
  expect_ok_config(c, 3);
  for (const nlohmann::json& s : c["systems"]) EXPECT_GT(s["device_used_delta_bytes"].get<std::int64_t>(), 0);
  EXPECT_GT(c["systems"][1]["capture_ms"]["instantiate"].get<double>(), 0);
}

}  // namespace
}  // namespace stepgraph::bench
