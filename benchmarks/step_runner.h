// Runs one StepConfig's whole training step (TrainStep: forward, softmax
// cross-entropy, backward, AdamW) eager or graphed and measures it; builds
// the per-config JSON that step_bench writes (schema: benchmarks/README.md,
// "Training step: graph vs eager, and PyTorch").
//
// Note [How a step is timed]
// Host wall clock (steady_clock) around one step followed by a synchronize
// of every stream: eager, the host's launches of the step; graphed, one
// replay. So both modes pay one synchronize per sample and the time covers
// launch overhead and device work alike. pipelined_step_us is the other
// view: `steps` steps back to back and one synchronize, divided by `steps`
// (the host may run ahead of the device, as a training loop does).
//
// Each mode runs in its own Context from the same initial parameters on the
// same fixed batch (uniform bf16 inputs, uniform labels from data_seed), so
// the losses of the first steps of the two modes can be compared.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/step_configs.h"
#include "engine/tensor.h"
#include "graphs/captured_step.h"

namespace stepgraph::bench {

struct StepRunOptions {
  Device device = Device::kCuda;
  int steps = 50;            // timed samples (>= 1)
  int warmup = 10;           // untimed steps first (>= 1)
  int loss_check_steps = 5;  // the first steps (within warm-up) whose loss is kept
  std::uint32_t data_seed = 1;
  float lr = 1e-4f;
  float weight_decay = 0.01f;
  // Before measuring, one untimed eager step of the config's first blocks
  // (every shape it has) in a throwaway Context (cuda only): kernel modules
  // load lazily and cuBLASLt's algorithms are timed on first use, so neither
  // mode's memory delta or capture time carries those one-time costs.
  bool prime = true;
};

enum class StepMode { kEager, kGraph };

struct ModeResult {
  Summary step_us;
  double pipelined_step_us = 0;
  std::vector<float> first_losses;
  float final_loss = 0;
  std::int64_t persistent_bytes = 0;  // parameters, gradients, AdamW state, step inputs
  // Transient bytes at their peak: eager, the caching allocator's peak of
  // live tensors (Context::memory_stats); graph, the pool plus any eager
  // tensor (the same statistic, expected 0).
  std::int64_t transient_peak_bytes = 0;
  // cudaMemGetInfo: used bytes after the timed steps minus before the
  // Context was made (cuda only): what the mode holds on the device,
  // including allocator rounding, the caching pool's reserve and graph execs.
  std::optional<std::int64_t> device_used_delta_bytes;
  // Graph mode only.
  std::int64_t pool_bytes = 0;
  std::int64_t pool_lower_bound_bytes = 0;
  CaptureTimings capture;
  double capture_wall_ms = 0;  // the whole CapturedStep::capture call
};

// Error (kInvalidArgument) naming the flag when `options` are out of range.
void check_run_options(const StepRunOptions& options);

// Throws stepgraph::Error on bad options or when the config cannot run
// (e.g. kUnsupported where a kernel has no path for its shape or dtype).
ModeResult run_mode(const StepConfig& config, StepMode mode, const StepRunOptions& options);

// Primes (see StepRunOptions::prime), runs both modes and returns the
// config's JSON object; an exception becomes "status": "not_run" (an Error
// of kUnsupported) or "failed", with its message as "reason", so one config
// cannot stop the others.
nlohmann::json run_config(const StepConfig& config, const StepRunOptions& options);

// The JSON of one config from measured results (also for tests).
nlohmann::json config_json(const StepConfig& config, const ModeResult& eager, const ModeResult& graph);

// The config's shape and FLOP count, without results.
nlohmann::json config_header_json(const StepConfig& config);

}  // namespace stepgraph::bench
