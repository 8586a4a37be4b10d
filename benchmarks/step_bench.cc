// The whole training step (forward, softmax cross-entropy, backward, AdamW)
// of named model configs, eager and graphed, on the same engine:
//
//   step_bench --configs small,medium,large,moe --steps 50 --warmup 10 --out step_bench.json
//   step_bench --device host --configs tiny --steps 3 --warmup 2   # host smoke run
//
// Per config and mode: step time (median, min, max; see Note [How a step is
// timed] in step_runner.h), tokens/s, model TFLOP/s and MFU (model_flops.h),
// graph/eager speedup, pool bytes against the plan's lower bound,
// capture+instantiate time, peak memory, and whether the first losses of the
// two modes agree. A config that cannot run yet (MoE blocks before they
// exist) is reported as not run with the reason; the others still run.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "benchmarks/bench_support.h"
#include "benchmarks/model_flops.h"
#include "benchmarks/step_configs.h"
#include "benchmarks/step_runner.h"
#include "engine/device.h"
#include "engine/error.h"

namespace stepgraph::bench {
namespace {

struct Options {
  std::string configs = "small,medium,large,moe";
  std::string device = "cuda";
  int steps = 50;
  int warmup = 10;
  std::string out;
};

std::string describe_device(Device device) {
  if (device == Device::kHost) return "host (reference kernels)";
  const DeviceCount found = cuda_device_count();
  SG_CHECK_CODE(found.count > 0, ErrorCode::kNoDevice, found.no_device_reason,
                "; step_bench --device host --configs tiny runs the host smoke config");
  return describe(device_properties(0));
}

void print_line(const nlohmann::json& c) {
  const std::string name = c["name"];
  if (c["status"] != "ok") {
    std::printf("%-7s %s: %s\n", name.c_str(), c["status"].get<std::string>().c_str(),
                c["reason"].get<std::string>().c_str());
    return;
  }
  const nlohmann::json& e = c["systems"][0];
  const nlohmann::json& g = c["systems"][1];
  auto ms = [](const nlohmann::json& s, const char* key) { return s["step_us"][key].get<double>() / 1000.0; };
  std::printf(
      "%-7s eager %.3f ms [%.3f-%.3f]  graph %.3f ms [%.3f-%.3f]  speedup %.2fx  graph %.1f TFLOP/s (MFU %.1f%%)  "
      "pool %.2fx lower bound  capture+instantiate %.1f ms  peak eager %.1f MiB graph %.1f MiB  first %d losses %s\n",
      name.c_str(), ms(e, "median_us"), ms(e, "min_us"), ms(e, "max_us"), ms(g, "median_us"), ms(g, "min_us"),
      ms(g, "max_us"), g["speedup_vs_stepgraph_eager"].get<double>(), g["tflops"].get<double>(),
      100.0 * g["mfu"].get<double>(), g["pool_ratio"].get<double>(),
      g["capture_ms"]["capture_plus_instantiate"].get<double>(), e["peak_bytes"].get<double>() / (1 << 20),
      g["peak_bytes"].get<double>() / (1 << 20), c["loss_check"]["steps"].get<int>(),
      c["loss_check"]["identical"].get<bool>() ? "identical" : "DIFFER");
  std::fflush(stdout);
}

int run(const Options& options) {
  SG_CHECK(options.device == "cuda" || options.device == "host", "--device must be cuda or host, got '", options.device,
           "'");
  const Device device = options.device == "cuda" ? Device::kCuda : Device::kHost;
  const std::vector<StepConfig> configs = parse_config_list(options.configs);
  for (const StepConfig& config : configs) {
    SG_CHECK(device == Device::kCuda || config.name == "tiny", "--device host runs only the smoke config 'tiny' ",
             "(the host reference kernels would take hours on '", config.name, "'); pass --configs tiny");
  }
  StepRunOptions run_options;
  run_options.device = device;
  run_options.steps = options.steps;
  run_options.warmup = options.warmup;
  check_run_options(run_options);

  nlohmann::json result = {
      {"benchmark", "training_step"},
      {"source", "stepgraph"},
      {"device", describe_device(device)},
      {"peak_tflops", kH100PeakTflops},
      {"steps", options.steps},
      {"warmup", options.warmup},
      {"timing",
       "host wall clock around one step followed by a synchronize (median, min, max over `steps` samples after "
       "`warmup` steps); pipelined_step_us: `steps` steps back to back, one synchronize, divided by `steps`"},
      {"flops", "6 * tokens * matmul parameters a token passes through (model_flops.h); nothing else counted"},
      {"memory",
       "peak_bytes: tensor bytes, persistent (parameters, fp32 grads, AdamW state, inputs) + transient peak "
       "(eager: the caching allocator's peak of live tensors; graph: the static pool); device_used_delta_bytes: "
       "cudaMemGetInfo used after the timed steps minus before the mode's Context existed"},
      {"optimizer", {{"name", "AdamW"}, {"lr", run_options.lr}, {"weight_decay", run_options.weight_decay}}},
      {"configs", nlohmann::json::array()},
  };
  std::printf("device: %s\n", result["device"].get<std::string>().c_str());
  bool failed = false;
  for (const StepConfig& config : configs) {
    nlohmann::json c = run_config(config, run_options);
    print_line(c);
    failed = failed || c["status"] == "failed";
    result["configs"].push_back(std::move(c));
    write_json(options.out, result);  // after every config: a later crash keeps the earlier results
  }
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph::bench

int main(int argc, char** argv) {
  CLI::App app{"Training step, eager and graphed: step time, tokens/s, MFU, pool, capture time, memory"};
  stepgraph::bench::Options options;
  app.add_option("--configs", options.configs, "comma-separated: small, medium, large, moe (tiny: host smoke)")
      ->capture_default_str();
  app.add_option("--steps", options.steps, "timed steps per mode (>= 50 for the report)")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed steps first; the first 5 compare eager and graph losses")
      ->capture_default_str();
  app.add_option("--device", options.device, "cuda, or host (only with --configs tiny)")->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  try {
    return stepgraph::bench::run(options);
  } catch (const stepgraph::Error& error) {
    std::cerr << "step_bench: " << error.message() << "\n";
    return EXIT_FAILURE;
  }
}
