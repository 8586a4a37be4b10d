#include "benchmarks/step_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>

#include "benchmarks/model_flops.h"
#include "engine/context.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "layers/adamw.h"
#include "layers/residual_stack.h"
#include "layers/train_step.h"

namespace stepgraph::bench {
namespace {

using Clock = std::chrono::steady_clock;

double microseconds_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// The fixed batch every step of both modes trains on.
void load_batch(Context& ctx, const TrainStep& step, const StepConfig& config, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(config.tokens * config.model.hidden));
  for (auto& v : x) v = float_to_bf16(uniform(rng));
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(config.model.vocab - 1));
  std::vector<std::int32_t> labels(static_cast<std::size_t>(config.tokens));
  for (auto& v : labels) v = label(rng);
  ctx.copy_from_host(step.inputs(), x.data(), x.size() * sizeof(std::uint16_t));
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
}

float read_loss(Context& ctx, const Tensor& loss) { return ctx.to_vector<float>(loss).at(0); }

// Device bytes in use now (cudaMemGetInfo on device 0, the one Context uses:
// step_bench never selects another).
std::int64_t device_used_bytes() {
  const DeviceMemory memory = device_memory(0);
  return static_cast<std::int64_t>(memory.total_bytes - memory.free_bytes);
}

nlohmann::json system_json(const std::string& name, const StepConfig& config, const ModeResult& r,
                           const ModeResult& eager) {
  const double median_s = r.step_us.median_us * 1e-6;
  const double tflops = tflops_per_s(step_flops(config.model, config.tokens), median_s);
  nlohmann::json out = {
      {"system", name},
      {"status", "ok"},
      {"reason", nullptr},
      {"step_us", to_json(r.step_us)},
      {"pipelined_step_us", r.pipelined_step_us},
      {"tokens_per_s", static_cast<double>(config.tokens) / median_s},
      {"tflops", tflops},
      {"mfu", mfu(tflops)},
      {"speedup_vs_stepgraph_eager", eager.step_us.median_us / r.step_us.median_us},
      {"peak_bytes", r.persistent_bytes + r.transient_peak_bytes},
      {"persistent_bytes", r.persistent_bytes},
      {"transient_peak_bytes", r.transient_peak_bytes},
      {"device_used_delta_bytes", r.device_used_delta_bytes ? nlohmann::json(*r.device_used_delta_bytes) : nullptr},
      {"final_loss", r.final_loss},
  };
  return out;
}

}  // namespace

void check_run_options(const StepRunOptions& options) {
  SG_CHECK(options.steps >= 1, "--steps must be >= 1, got ", options.steps);
  SG_CHECK(options.warmup >= 1, "--warmup must be >= 1 (the first steps check the losses), got ", options.warmup);
  SG_CHECK(options.loss_check_steps >= 1, "loss_check_steps must be >= 1, got ", options.loss_check_steps);
}

ModeResult run_mode(const StepConfig& config, StepMode mode, const StepRunOptions& options) {
  check_run_options(options);
  const bool cuda = options.device == Device::kCuda;
  const std::int64_t used_before = cuda ? device_used_bytes() : 0;
  ModeResult r;
  Context ctx(options.device);
  ResidualStack model(ctx, config.model);
  AdamW optimizer(ctx, model.parameters(), {.lr = options.lr, .weight_decay = options.weight_decay});
  TrainStep step(ctx, model, optimizer, config.tokens);
  load_batch(ctx, step, config, options.data_seed);

  std::shared_ptr<CapturedStep> captured;
  std::function<Tensor()> run_one = [&] { return step(ctx).at(0); };
  if (mode == StepMode::kGraph) {
    const Clock::time_point start = Clock::now();
    captured = CapturedStep::capture(ctx, [&] { return step(ctx); }, {.pool_report_policy = PoolReportPolicy::kError});
    r.capture_wall_ms = microseconds_since(start) / 1000.0;
    r.capture = captured->timings();
    r.pool_bytes = captured->plan().pool_bytes;
    r.pool_lower_bound_bytes = captured->plan().lower_bound_bytes;
    run_one = [&] {
      captured->replay();
      return captured->outputs().at(0);
    };
  }

  Tensor loss;
  const int checked = std::min(options.loss_check_steps, options.warmup);
  for (int i = 0; i < options.warmup; ++i) {
    loss = run_one();
    if (i < checked) r.first_losses.push_back(read_loss(ctx, loss));
  }
  ctx.synchronize();
  step.check_errors(ctx);

  std::vector<double> samples;
  samples.reserve(static_cast<std::size_t>(options.steps));
  for (int i = 0; i < options.steps; ++i) {
    const Clock::time_point start = Clock::now();
    loss = run_one();
    ctx.synchronize();
    samples.push_back(microseconds_since(start));
  }
  r.step_us = summarize(std::move(samples));

  const Clock::time_point start = Clock::now();
  for (int i = 0; i < options.steps; ++i) loss = run_one();
  ctx.synchronize();
  r.pipelined_step_us = microseconds_since(start) / options.steps;

  r.final_loss = read_loss(ctx, loss);
  SG_CHECK_CODE(std::isfinite(r.final_loss), ErrorCode::kInternal, "config ", config.name, ": the loss after ",
                options.warmup + 2 * options.steps, " steps is not finite (", r.final_loss, ")");
  const MemoryStats stats = ctx.memory_stats();
  r.persistent_bytes = stats.persistent_bytes;
  r.transient_peak_bytes = stats.eager_peak_bytes + r.pool_bytes;
  if (cuda) r.device_used_delta_bytes = device_used_bytes() - used_before;
  return r;
}

nlohmann::json config_header_json(const StepConfig& config) {
  const ResidualStackConfig& m = config.model;
  nlohmann::json out = {
      {"name", config.name},
      {"hidden", m.hidden},
      {"ffn", m.ffn},
      {"layers", m.layers},
      {"vocab", m.vocab},
      {"tokens", config.tokens},
      {"experts", m.experts},
      {"topk", m.experts > 0 ? nlohmann::json(m.topk) : nullptr},
      {"moe_every", m.experts > 0 ? nlohmann::json(m.moe_every) : nullptr},
      {"dtype", std::string(dtype_name(m.dtype))},
  };
  try {
    out["matmul_params_per_token"] = matmul_params_per_token(m);
    out["flops_per_step"] = step_flops(m, config.tokens);
  } catch (const Error&) {
    // A config too broken to count: run_config reports why it failed.
    out["matmul_params_per_token"] = nullptr;
    out["flops_per_step"] = nullptr;
  }
  return out;
}

nlohmann::json config_json(const StepConfig& config, const ModeResult& eager, const ModeResult& graph) {
  nlohmann::json out = config_header_json(config);
  out["status"] = "ok";
  out["reason"] = nullptr;

  bool identical = eager.first_losses.size() == graph.first_losses.size();
  double max_diff = 0;
  for (std::size_t i = 0; identical && i < eager.first_losses.size(); ++i) {
    identical = identical && eager.first_losses[i] == graph.first_losses[i];
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(eager.first_losses[i] - graph.first_losses[i])));
  }
  out["loss_check"] = {{"steps", eager.first_losses.size()},
                       {"stepgraph_eager", eager.first_losses},
                       {"stepgraph_graph", graph.first_losses},
                       {"identical", identical},
                       {"max_abs_diff", max_diff}};

  nlohmann::json graph_json = system_json("stepgraph_graph", config, graph, eager);
  graph_json["pool_bytes"] = graph.pool_bytes;
  graph_json["pool_lower_bound_bytes"] = graph.pool_lower_bound_bytes;
  graph_json["pool_ratio"] = graph.pool_lower_bound_bytes == 0 ? 1.0
                                                               : static_cast<double>(graph.pool_bytes) /
                                                                     static_cast<double>(graph.pool_lower_bound_bytes);
  const CaptureTimings& t = graph.capture;
  graph_json["capture_ms"] = {{"trace", t.trace_ms},
                              {"plan", t.plan_ms},
                              {"prepare", t.prepare_ms},
                              {"capture", t.capture_ms},
                              {"instantiate", t.instantiate_ms},
                              {"capture_plus_instantiate", t.capture_ms + t.instantiate_ms},
                              {"wall", graph.capture_wall_ms}};
  out["systems"] = {system_json("stepgraph_eager", config, eager, eager), graph_json};
  return out;
}

nlohmann::json run_config(const StepConfig& config, const StepRunOptions& options) {
  try {
    if (options.prime && options.device == Device::kCuda) {
      StepRunOptions once = options;
      once.steps = 1;
      once.warmup = 1;
      // The first blocks up to the first MoE block have every shape of the
      // config (blocks repeat), at a fraction of the parameter set-up time.
      StepConfig first_blocks = config;
      const std::int64_t needed = config.model.experts > 0 ? config.model.moe_every : 1;
      first_blocks.model.layers = std::min(config.model.layers, std::max<std::int64_t>(needed, 1));
      (void)run_mode(first_blocks, StepMode::kEager, once);
    }
    const ModeResult eager = run_mode(config, StepMode::kEager, options);
    const ModeResult graph = run_mode(config, StepMode::kGraph, options);
    return config_json(config, eager, graph);
  } catch (const std::exception& error) {
    const auto* engine_error = dynamic_cast<const Error*>(&error);
    nlohmann::json out = config_header_json(config);
    out["status"] = engine_error && engine_error->code() == ErrorCode::kUnsupported ? "not_run" : "failed";
    out["reason"] = error.what();
    out["systems"] = nlohmann::json::array();
    return out;
  }
}

}  // namespace stepgraph::bench
