// The whole training step (forward, softmax cross-entropy, backward, AdamW)
// of named GPT-style model configs (step_configs.h: attention + MLP blocks
// over packed equal-length sequences), eager and graphed, on the same engine:
//
//   step_bench --configs small,medium,large,moe --steps 50 --warmup 10 --out step_bench.json
//   step_bench --device host --configs tiny --steps 3 --warmup 2   # host smoke run
//   torchrun --no-python --nproc-per-node 8 bin/step_bench --dp 8 --out step_bench_dp8.json
//   step_bench --dp 1 --out step_bench_dp1.json                     # one process: the baseline rows only
//   torchrun --no-python --nproc-per-node 2 bin/step_bench --cp 2 --configs long --out step_bench_cp2.json
//   torchrun --no-python --nproc-per-node 2 bin/step_bench --pp 2 --configs medium,large --out step_bench_pp2.json
//   torchrun --no-python --nproc-per-node 2 bin/step_bench --ep 2 --configs moe --out step_bench_ep2.json
//
// Per config and mode: step time (median, min, max; see Note [How a step is
// timed] in step_runner.h), tokens/s, model TFLOP/s and MFU (model_flops.h),
// graph/eager speedup, pool bytes against the plan's lower bound,
// capture+instantiate time, peak memory, and whether the first losses of the
// two modes agree. A config that cannot run yet (MoE blocks before they
// exist) is reported as not run with the reason; the others still run.
//
// --dp N: data parallelism over the N ranks of a launch (torchrun, Slurm
// srun, Open MPI mpirun: launch_info_from_env; one process per GPU, rank r on
// GPU local_rank). Per config, the step alone on every rank's GPU (dp1, the
// baseline) and data-parallel over all of them (dpN), eager and graphed:
// per-GPU tokens/s, scaling efficiency and exposed communication (Note
// [Data-parallel rows] in step_runner.h). --dp-mode allreduce|zero1. --tp N:
// tensor and sequence parallelism of each config's GPT (attention and MLP
// sharded by heads and ffn; Note [Tensor-parallel rows]); with --profile the
// graphed rows report their profiled exposed communication. --cp N: context
// parallelism of each config's GPT, its sequences N times as long over the
// N ranks against one GPU training the config's own (the same tokens per
// GPU; Note [Context-parallel rows]): efficiency = per-GPU TFLOP/s of cpN
// over cp1's, and the step time ratio beside it;
// not with --tp or --dp yet. --pp P [--virtual-stages V] [--microbatches M]:
// each config's GPT in P pipeline stages (1F1B, interleaved at V > 1) over M
// microbatches of one sequence, against each GPU training the whole model on
// them alone: graph/eager speedup and the measured bubble against the
// schedule's (Note [Pipeline-parallel rows] in pipeline_step_runner.h); --pp
// alone, not with --dp, --tp or --cp yet. --ep N: each config's MoE experts
// spread over the N ranks (E / N a rank, the routed rows exchanged), every
// rank training the config's tokens, against every rank training the whole
// config alone (weak scaling; Note [Expert-parallel rows] in
// expert_parallel_step_runner.h): efficiency = ep1 / epN step time, the
// exchange's transport named; configs with experts only (moe; host:
// moe_tiny), --ep alone. Rank 0
// prints and writes the JSON. In one process --dp 1 runs the dp1 rows alone
// (the baseline; no all-reduce exists at N = 1). Under a launcher of N > 1
// ranks an error on any rank ends that rank (its communicator aborted) and
// the launcher ends the others: the ranks may be inside different
// collectives; rank 0 has written the configs finished before. NVLink
// multicast stays off (DESIGN.md): NCCL_NVLS_ENABLE=0,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set
// before NCCL starts.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "benchmarks/bench_support.h"
#include "benchmarks/expert_parallel_step_runner.h"
#include "benchmarks/model_flops.h"
#include "benchmarks/pipeline_step_runner.h"
#include "benchmarks/step_configs.h"
#include "benchmarks/step_runner.h"
#include "engine/algorithm_choice.h"
#include "engine/communicator.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "launch/join.h"
#include "engine/fp8_recipe.h"
#include "launch/launch_env.h"
#include "engine/nccl_communicator.h"

namespace stepgraph::bench {
namespace {

// The flags as values: main() converts each choice once, where CLI11 read it.
struct Options {
  std::string configs = "small,medium,large,moe";
  Device device = Device::kCuda;
  int steps = 50;
  int warmup = 10;
  int dp = 0;  // 0: the single-GPU benchmark; N: data-parallel rows over N ranks
  int tp = 0;  // N: tensor-parallel rows over N ranks (Note [Tensor-parallel rows])
  int cp = 0;  // N: context-parallel rows over N ranks (Note [Context-parallel rows])
  int pp = 0;  // P: pipeline-parallel rows over P ranks (Note [Pipeline-parallel rows])
  int ep = 0;  // N: expert-parallel rows over N ranks (Note [Expert-parallel rows])
  std::optional<int> virtual_stages;         // with --pp (not given: 1)
  std::optional<std::int64_t> microbatches;  // with --pp (not given: 8)
  MLPOverlap overlap;  // bulk
  bool profile = false;  // one profiled step per graphed row
  bool cuda_profiler_range = false;  // one graphed replay between cudaProfilerStart and Stop
  DataParallelMode dp_mode = DataParallelMode::kAllReduce;
  // Where each summed group's update runs (Note [Where summed updates run] in optim/adamw.h).
  AdamW::SummedUpdateStream dp_update_stream = AdamW::SummedUpdateStream::kCommunicationWhenCaptured;
  int timeout_s = 300;
  std::optional<Fp8Recipe> fp8;   // FP8 GEMMs in every config's blocks (--fp8-weight-cache: its cache_weights)
  bool skip_nonfinite = false;    // AdamW::set_skip_nonfinite
  bool recompute_activation = false;  // ResidualStackConfig::recompute_activation
  bool step_scoped_gradients = false;  // AdamW::use_step_scoped_gradients
  AlgorithmChoice gemm_algorithms = AlgorithmChoice::kHeuristic;  // Note [Deterministic algorithm choice]
  float dropout = 0.0f;               // ResidualStackConfig::dropout
  std::string out;
};

// --virtual-stages and --microbatches, or their defaults (check_pipeline_config checks them).
PipelineRunOptions pipeline_run_options(const Options& options) {
  PipelineRunOptions out;
  out.virtual_stages = options.virtual_stages.value_or(out.virtual_stages);
  out.microbatches = options.microbatches.value_or(out.microbatches);
  return out;
}

std::string describe_device(Device device, int index = 0) {
  if (device == Device::kHost) return "host (reference kernels)";
  const DeviceCount found = cuda_device_count();
  SG_CHECK_CODE(found.count > 0, ErrorCode::kNoDevice, found.no_device_reason,
                "; step_bench --device host --configs tiny runs the host smoke config");
  return describe(device_properties(index));
}

// --profile: each profiled row's summary and its largest ops by summed time
// (the JSON holds the whole profile, every op in schedule order).
void print_profile_summaries(const nlohmann::json& c) {
  constexpr int kTopOps = 15;
  for (const nlohmann::json& s : c["systems"]) {
    if (!s.contains("profile")) continue;
    std::istringstream text(s["profile"].get<std::string>());
    std::string row;
    std::printf("  %s ", s["system"].get<std::string>().c_str());
    int op_rows = -1;  // counts from the by-op header
    while (std::getline(text, row) && row != "  in schedule order:" && op_rows < kTopOps) {
      std::printf("%s\n", row.c_str());
      if (op_rows >= 0 || row.rfind("  by op", 0) == 0) ++op_rows;
    }
  }
  std::fflush(stdout);
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
  print_profile_summaries(c);
}

// The top of the JSON, shared by the single-GPU and the data-parallel runs.
nlohmann::json result_header(const std::string& device, const Options& options, const StepRunOptions& run_options) {
  return {
      {"benchmark", "training_step"},
      {"source", "stepgraph"},
      {"device", device},
      {"peak_tflops", kH100PeakTflops},
      {"fp8", options.fp8 ? std::string(fp8_scaling_name(options.fp8->scaling)) : std::string("none")},
      {"fp8_weight_cache", options.fp8 && options.fp8->cache_weights},
      {"skip_nonfinite", options.skip_nonfinite},
      {"recompute_activation", options.recompute_activation},
      {"step_scoped_gradients", options.step_scoped_gradients},
      {"gemm_algorithms", algorithm_choice_name(options.gemm_algorithms)},
      {"dropout", options.dropout},
      {"steps", options.steps},
      {"warmup", options.warmup},
      {"timing",
       "host wall clock around one step followed by a synchronize (median, min, max over `steps` samples after "
       "`warmup` steps); pipelined_step_us: `steps` steps back to back, one synchronize, divided by `steps`"},
      {"flops",
       "6 * tokens * matmul parameters a token passes through (QKV, output projection, MLP or router + top-k experts, "
       "head) + the attention core: per layer and sequence of L, forward 2 * 2 * (L^2 / 2) * heads * head_dim "
       "(QK^T and PV, causal half), backward 2.5x forward (model_flops.h); nothing else counted"},
      {"memory",
       "peak_bytes: tensor bytes, persistent (parameters, fp32 grads, AdamW state, inputs) + transient peak "
       "(eager: the caching allocator's peak of live tensors; graph: the static pool); device_used_delta_bytes: "
       "cudaMemGetInfo used after the timed steps minus before the mode's Context existed"},
      {"optimizer", {{"name", "AdamW"}, {"lr", run_options.lr}, {"weight_decay", run_options.weight_decay}}},
      {"configs", nlohmann::json::array()},
  };
}

int run_single(const Options& options, Device device, const std::vector<StepConfig>& configs,
               const StepRunOptions& run_options) {
  nlohmann::json result = result_header(describe_device(device), options, run_options);
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

// ---------------------------------------------------------------- --dp

// One config's line of --dp or --tp: each row's step time, and against its
// baseline the data-parallel efficiency or the tensor-parallel speedup.
void print_parallel_line(const nlohmann::json& c) {
  const std::string name = c["name"];
  if (c["status"] != "ok") {
    std::printf("%-7s %s: %s\n", name.c_str(), c["status"].get<std::string>().c_str(),
                c["reason"].get<std::string>().c_str());
    std::fflush(stdout);
    return;
  }
  std::ostringstream line;
  char buffer[256];
  std::snprintf(buffer, sizeof(buffer), "%-7s", name.c_str());
  line << buffer;
  for (const nlohmann::json& s : c["systems"]) {
    const std::string system = s["system"];
    std::snprintf(buffer, sizeof(buffer), "  %s %.3f ms [%.3f-%.3f] %.0f tok/s/GPU", system.c_str(),
                  s["step_us"]["median_us"].get<double>() / 1000.0, s["step_us"]["min_us"].get<double>() / 1000.0,
                  s["step_us"]["max_us"].get<double>() / 1000.0, s["tokens_per_s"].get<double>());
    line << buffer;
    if (s.contains("speedup_vs_tp1") && !s["speedup_vs_tp1"].is_null()) {
      std::snprintf(buffer, sizeof(buffer), " (speedup %.3fx, strong-scaling efficiency %.3f, per-GPU MFU %.1f%%)",
                    s["speedup_vs_tp1"].get<double>(), s["strong_scaling_efficiency"].get<double>(),
                    100.0 * s["mfu"].get<double>());
      line << buffer;
    }
    if (s.contains("cp")) {
      std::snprintf(buffer, sizeof(buffer), " (seq_len %lld", static_cast<long long>(s["seq_len"].get<std::int64_t>()));
      line << buffer;
      if (!s["efficiency"].is_null()) {
        std::snprintf(buffer, sizeof(buffer), ", efficiency %.3f, step time ratio %.3f", s["efficiency"].get<double>(),
                      s["step_time_ratio"].get<double>());
        line << buffer;
      }
      line << ")";
    }
    if (s.contains("profile_exposed_comm_fraction")) {
      std::snprintf(buffer, sizeof(buffer), " (profiled exposed comm %.3f ms = %.1f%%)",
                    s["profile_exposed_comm_us"].get<double>() / 1000.0,
                    100.0 * s["profile_exposed_comm_fraction"].get<double>());
      line << buffer;
    }
    if (s.contains("scaling_efficiency") && !s["scaling_efficiency"].is_null()) {
      std::snprintf(buffer, sizeof(buffer), " (efficiency %.3f, exposed comm %.3f ms = %.1f%%)",
                    s["scaling_efficiency"].get<double>(), s["exposed_comm_us"].get<double>() / 1000.0,
                    100.0 * s["exposed_comm_fraction"].get<double>());
      line << buffer;
    }
  }
  if (!c.contains("loss_check")) {
    std::printf("%s\n", line.str().c_str());
    std::fflush(stdout);
    return;
  }
  const nlohmann::json& check = c["loss_check"];
  line << "  first " << check["steps"].get<int>() << " losses " << check["compared"][0].get<std::string>() << " vs "
       << check["compared"][1].get<std::string>() << ": " << (check["identical"].get<bool>() ? "identical" : "DIFFER");
  if (c.contains("dp_loss_check")) {
    for (const char* mode : {"eager", "graph"}) {
      const nlohmann::json& d = c["dp_loss_check"][mode];
      line << "; " << mode
           << " first loss vs the ranks' mean alone: " << (d["agrees"].get<bool>() ? "agrees" : "DIFFERS") << " ("
           << d["abs_diff"].get<double>() << ")";
    }
  }
  std::printf("%s\n", line.str().c_str());
  print_profile_summaries(c);
}

// Whether the parallel rows' first losses disagree: the data-parallel loss
// with the ranks' own (a wrong gradient or loss reduction), the
// tensor- or context-parallel eager with its graph.
bool parallel_losses_disagree(const nlohmann::json& c) {
  if ((c.contains("tensor_parallel_rows") || c.contains("context_parallel_rows")) && c.contains("loss_check")) {
    return !c["loss_check"]["identical"].get<bool>();
  }
  if (!c.contains("dp_loss_check")) return false;
  return !c["dp_loss_check"]["eager"]["agrees"].get<bool>() || !c["dp_loss_check"]["graph"]["agrees"].get<bool>();
}

// The world's communicator (null in a world of one): NCCL on cuda, the
// rendezvous's host collectives on host. Selects the rank's GPU first.
std::unique_ptr<Communicator> join_world(const LaunchInfo& launch, Device device, std::string_view run_tag,
                                         std::chrono::milliseconds timeout) {
  if (device == Device::kCuda) {
    const DeviceCount found = cuda_device_count();
    SG_CHECK_CODE(found.count > 0, ErrorCode::kNoDevice, found.no_device_reason,
                  "; step_bench --device host --configs tiny runs the host smoke config");
    SG_CHECK(launch.local_rank < found.count, "local rank ", launch.local_rank, " but this host has ", found.count,
             " GPU(s): start at most one rank per GPU (--nproc-per-node <= ", found.count, ")");
    SG_CUDA_CHECK(cudaSetDevice(launch.local_rank));
  }
  return stepgraph::join_world(device, run_tag, timeout, launch).comm;
}

// --dp N, --tp N, --cp N, --pp P or --ep N over the launch's ranks.
int run_parallel(const Options& options, Device device, const std::vector<StepConfig>& configs,
                 const StepRunOptions& run_options, const LaunchInfo& launch, const nlohmann::json& env) {
  const bool tensor = options.tp > 0;
  const bool context = options.cp > 0;
  const bool pipeline = options.pp > 0;
  const bool expert = options.ep > 0;
  const PipelineRunOptions pipeline_options = pipeline_run_options(options);
  const DataParallelMode mode = options.dp_mode;
  SG_CHECK(options.timeout_s > 0, "--timeout-s must be positive, got ", options.timeout_s);
  const auto timeout = std::chrono::milliseconds(std::int64_t{1000} * options.timeout_s);
  std::ostringstream tag;  // what every rank must agree on
  if (tensor) {
    tag << "step_bench --tp " << options.tp << " --overlap " << options.overlap.to_string();
  } else if (context) {
    tag << "step_bench --cp " << options.cp;
  } else if (expert) {
    tag << "step_bench --ep " << options.ep;
  } else if (pipeline) {
    tag << "step_bench --pp " << options.pp << " --virtual-stages " << pipeline_options.virtual_stages
        << " --microbatches " << pipeline_options.microbatches;
  } else {
    tag << "step_bench --dp " << options.dp << " --dp-mode " << data_parallel_mode_name(mode)
        << " --dp-update-stream " << summed_update_stream_name(options.dp_update_stream);
  }
  tag << " --configs " << options.configs << " --steps " << options.steps << " --warmup " << options.warmup
      << " --device " << device_name(device);
  std::unique_ptr<Communicator> world = join_world(launch, device, tag.str(), timeout);
  const bool leader = launch.rank == 0;
  const int n = launch.world_size;

  nlohmann::json result = result_header(describe_device(device, launch.local_rank), options, run_options);
  if (tensor) {
    result["tensor_parallel"] = {
        {"world_size", n},
        {"local_world_size", launch.local_world_size},
        {"launcher", launch.launcher},
        {"overlap", run_options.overlap.to_string()},
        {"communicator", world != nullptr ? world->describe() : "none (world size 1)"},
        {"nccl_version", device == Device::kCuda && n > 1 ? nlohmann::json(nccl_version()) : nullptr},
        {"multicast_env", env},
        {"strong_scaling", "both rows train the config's `tokens` per step; the tpN row shards the model over N GPUs"},
        {"sharding", "Megatron tensor + sequence parallel: each rank holds 1/N of every block's q, k and v heads, "
                     "the output projection's and fc2's input columns, fc1's ffn rows, the experts and the "
                     "vocabulary; tokens / N rows outside the blocks"},
        {"exposed_comm",
         "with --profile, graphed rows: profile_exposed_comm_us (the profiled step's communication no compute "
         "overlapped) and profile_exposed_comm_fraction (of the profiled step), the rank with the largest share"},
        {"rows", "Note [Tensor-parallel rows] in benchmarks/step_runner.h"},
        {"note", n == 1 ? "world size 1: the tp1 rows alone; nothing is sharded" : ""},
    };
  } else if (context) {
    result["context_parallel"] = {
        {"world_size", n},
        {"local_world_size", launch.local_world_size},
        {"launcher", launch.launcher},
        {"communicator", world != nullptr ? world->describe() : "none (world size 1)"},
        {"nccl_version", device == Device::kCuda && n > 1 ? nlohmann::json(nccl_version()) : nullptr},
        {"multicast_env", env},
        {"weak_scaling",
         "the cp1 rows train the config's sequences of seq_len L on each GPU alone; the cpN rows sequences of N x L "
         "over the N GPUs, each holding its zig-zag chunks: the same tokens per GPU, N times the attention work per "
         "token"},
        {"formulas",
         {{"efficiency", "per-GPU model TFLOP/s(cpN) / per-GPU model TFLOP/s(cp1), same mode (the attention core "
                         "counted at each row's sequence length)"},
          {"step_time_ratio", "median step time(cp1) / median step time(cpN), same mode"},
          {"tokens_per_s", "per GPU: the row's tokens / N / median step time"}}},
        {"rows", "Note [Context-parallel rows] in benchmarks/step_runner.h"},
        {"note", n == 1 ? "world size 1: the cp1 rows alone; nothing is context-parallel" : ""},
    };
  } else if (expert) {
    nlohmann::json header = expert_parallel_header(n, world.get());
    header["local_world_size"] = launch.local_world_size;
    header["launcher"] = launch.launcher;
    header["nccl_version"] = device == Device::kCuda && n > 1 ? nlohmann::json(nccl_version()) : nullptr;
    header["multicast_env"] = env;
    result["expert_parallel"] = std::move(header);
  } else if (pipeline) {
    nlohmann::json header = pipeline_parallel_header(n, pipeline_options, world.get());
    header["local_world_size"] = launch.local_world_size;
    header["launcher"] = launch.launcher;
    header["nccl_version"] = device == Device::kCuda ? nlohmann::json(nccl_version()) : nullptr;
    header["multicast_env"] = env;
    result["pipeline_parallel"] = std::move(header);
  } else {
  result["data_parallel"] = {
      {"world_size", n},
      {"local_world_size", launch.local_world_size},
      {"launcher", launch.launcher},
      {"dp_mode", n > 1 ? nlohmann::json(std::string(data_parallel_mode_name(mode))) : nullptr},
      {"dp_update_stream", summed_update_stream_name(options.dp_update_stream)},
      {"communicator", world != nullptr ? world->describe() : "none (world size 1)"},
      {"nccl_version", device == Device::kCuda && n > 1 ? nlohmann::json(nccl_version()) : nullptr},
      {"multicast_env", env},
      {"weak_scaling", "every rank trains the config's `tokens` per step at every world size: global batch N x tokens"},
      {"baseline",
       "stepgraph_<mode>_dp1: every rank trains the config alone on its own GPU (no communicator, no collective), "
       "all ranks at the same time, on the same Context layout as the data-parallel step"},
      {"timing", kParallelTimingText},
      {"formulas",
       {{"tokens_per_s", "per GPU: tokens / median step time"},
        {"global_tokens_per_s", "world_size x tokens_per_s"},
        {"scaling_efficiency", "tokens_per_s(dpN) / tokens_per_s(dp1), same mode"},
        {"exposed_comm_us", "median step time(dpN) - median step time(dp1), same mode"},
        {"exposed_comm_fraction", "exposed_comm_us / median step time(dpN) = 1 - scaling_efficiency"}}},
      {"note", n == 1 ? "world size 1: the dp1 rows alone, the baseline of a run at N > 1; nothing scales here" : ""},
  };
  }
  const nlohmann::json& parallel = result[tensor    ? "tensor_parallel"
                                          : context ? "context_parallel"
                                          : pipeline ? "pipeline_parallel"
                                          : expert   ? "expert_parallel"
                                                     : "data_parallel"];
  if (leader) {
    std::printf("device: %s; %s; %s\n", result["device"].get<std::string>().c_str(), describe(launch).c_str(),
                parallel["communicator"].get<std::string>().c_str());
    if (n == 1) std::printf("NOTE: %s\n", parallel["note"].get<std::string>().c_str());
    std::fflush(stdout);
  }
  bool failed = false;
  try {
    for (const StepConfig& config : configs) {
      nlohmann::json c = tensor     ? run_tp_config(config, run_options, world.get())
                         : context  ? run_cp_config(config, run_options, world.get())
                         : pipeline ? run_pipeline_config(config, run_options, world.get(), pipeline_options)
                         : expert   ? run_ep_config(config, run_options, world.get())
                                    : run_dp_config(config, run_options, world.get(), mode);
      if (tensor) c["tensor_parallel_rows"] = true;
      if (context) c["context_parallel_rows"] = true;
      if (expert) c["expert_parallel_rows"] = true;
      failed = failed || c["status"] == "failed" ||
               (pipeline ? pipeline_losses_disagree(c) : expert ? ep_losses_disagree(c) : parallel_losses_disagree(c));
      if (leader) {
        if (pipeline || expert) {
          std::printf("%s\n", (pipeline ? pipeline_config_line(c) : ep_config_line(c)).c_str());
          std::fflush(stdout);
          if (expert) print_profile_summaries(c);  // --profile: each graphed row's largest ops
        } else {
          print_parallel_line(c);
        }
        result["configs"].push_back(std::move(c));
        write_json(options.out, result);  // after every config: a later failure keeps the earlier results
      }
    }
    if (world != nullptr) {
      world->check_health();
      (void)world->exchange("done", "step_bench done");
    }
  } catch (const std::exception& error) {
    // The other ranks may wait inside a collective for this one: abort, so
    // that this process ends (the launcher then ends the others).
    if (world != nullptr) world->abort(error.what());
    throw;
  }
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

int run(const Options& options) {
  const nlohmann::json env = bench::keep_multicast_off("step_bench");  // before anything starts NCCL
  const Device device = options.device;
  std::vector<StepConfig> configs = parse_config_list(options.configs);
  if (options.fp8) {
    for (StepConfig& config : configs) config.model.fp8 = options.fp8;
  }
  for (const StepConfig& config : configs) {
    SG_CHECK(device == Device::kCuda || config.name == "tiny" || config.name == "moe_tiny",
             "--device host runs only the smoke config 'tiny' (or 'moe_tiny', its MoE form) (the host reference "
             "kernels would take hours on '", config.name, "'); pass --configs tiny");
  }
  StepRunOptions run_options;
  run_options.device = device;
  run_options.steps = options.steps;
  run_options.warmup = options.warmup;
  run_options.profile = options.profile;
  run_options.cuda_profiler_range = options.cuda_profiler_range;
  run_options.skip_nonfinite = options.skip_nonfinite;
  run_options.recompute_activation = options.recompute_activation;
  run_options.step_scoped_gradients = options.step_scoped_gradients;
  run_options.gemm_algorithms = options.gemm_algorithms;
  run_options.dropout = options.dropout;
  run_options.summed_update_stream = options.dp_update_stream;
  check_run_options(run_options);
  const LaunchInfo launch = launch_info_from_env();
  SG_CHECK(options.tp >= 0, "--tp must be the number of ranks (>= 1), got ", options.tp);
  SG_CHECK(options.tp == 0 || options.dp == 0, "--tp and --dp together are not benchmarked yet: give one of them");
  SG_CHECK(options.cp >= 0, "--cp must be the number of ranks (>= 1), got ", options.cp);
  SG_CHECK(options.cp == 0 || (options.tp == 0 && options.dp == 0),
           "--cp together with --tp or --dp is not benchmarked yet: give --cp alone");
  SG_CHECK(options.pp >= 0, "--pp must be the number of ranks (>= 1), got ", options.pp);
  SG_CHECK(options.pp == 0 || (options.tp == 0 && options.dp == 0 && options.cp == 0),
           "--pp together with --dp, --tp or --cp is not benchmarked yet: give --pp alone");
  SG_CHECK(options.ep >= 0, "--ep must be the number of ranks (>= 1), got ", options.ep);
  SG_CHECK(options.ep == 0 || (options.tp == 0 && options.dp == 0 && options.cp == 0 && options.pp == 0),
           "--ep together with --dp, --tp, --cp or --pp is not benchmarked yet: give --ep alone");
  SG_CHECK(options.pp > 0 || (!options.virtual_stages && !options.microbatches),
           "--virtual-stages and --microbatches are the pipeline's: they need --pp P (e.g. --pp 2 --virtual-stages 2 "
           "--microbatches 8)");
  if (options.ep > 0) {
    SG_CHECK(options.ep == launch.world_size, "--ep ", options.ep, " needs ", options.ep,
             " ranks, one process per GPU (e.g. torchrun --no-python --nproc-per-node ", options.ep,
             " bin/step_bench --ep ", options.ep, " --configs moe), but this run has ", launch.world_size,
             launch.world_size == 1 ? " (no launcher variables: one process); --ep 1 runs the ep1 baseline alone" : "");
    SG_CHECK(!options.fp8, "--ep: --fp8 is not supported with expert-parallel experts (each rank's scales would "
             "cover only its own experts); leave --fp8 out");
    SG_CHECK(!options.step_scoped_gradients, "--step-scoped-gradients is not supported with --ep (its step reads "
             "persistent gradients to sum them over the ranks); leave it out");
    for (const StepConfig& config : configs) {
      // Checked before the world starts: at N > 1 ranks a config's error ends the run.
      check_expert_parallel_config(config, options.ep);
    }
  } else if (options.pp > 0) {
    SG_CHECK(options.pp == launch.world_size, "--pp ", options.pp, " needs ", options.pp,
             " ranks, one process per GPU (e.g. torchrun --no-python --nproc-per-node ", options.pp,
             " bin/step_bench --pp ", options.pp, " --configs medium,large), but this run has ", launch.world_size,
             launch.world_size == 1 ? " (no launcher variables: one process); --pp 1 runs the pp1 baseline alone"
                                    : "");
    SG_CHECK(!options.fp8 && options.dropout == 0.0f && !options.skip_nonfinite && !options.step_scoped_gradients,
             "--pp: --fp8, --dropout, --skip-nonfinite and --step-scoped-gradients are not supported with pipeline "
             "stages yet; leave them out");
    const PipelineRunOptions pipeline = pipeline_run_options(options);
    for (const StepConfig& config : configs) {
      // Checked before the world starts: at P > 1 ranks a config's error ends the run.
      check_pipeline_config(config, options.pp, pipeline);
    }
  } else if (options.cp > 0) {
    SG_CHECK(options.cp == launch.world_size, "--cp ", options.cp, " needs ", options.cp,
             " ranks, one process per GPU (e.g. torchrun --no-python --nproc-per-node ", options.cp,
             " bin/step_bench --cp ", options.cp, " --configs long), but this run has ", launch.world_size);
    SG_CHECK(!options.step_scoped_gradients, "--step-scoped-gradients is not supported with --cp (its step reads "
             "persistent gradients to sum them over the ranks); leave it out");
    SG_CHECK(options.dropout == 0.0f, "--dropout is not supported with --cp yet (the context-parallel stack "
             "refuses it); leave --dropout out");
    for (const StepConfig& config : configs) {
      // Checked before the world starts: at N > 1 ranks a config's error ends the run.
      SG_CHECK(config.model.heads > 0 && config.model.experts == 0, "--cp ", options.cp, ": config ", config.name,
               " is not a dense GPT (context parallelism needs attention and no MoE blocks yet); leave it out of "
               "--configs (long, medium, large and tiny run)");
      const StepConfig wide = context_parallel_config(config, options.cp);
      SG_CHECK(wide.tokens % (2 * options.cp) == 0, "--cp ", options.cp, ": config ", config.name, "'s ",
               wide.tokens, " tokens at --cp ", options.cp, " do not cut into 2 x ", options.cp,
               " equal chunks; give a --cp whose double divides them");
    }
  } else if (options.tp > 0) {
    SG_CHECK(options.tp == launch.world_size, "--tp ", options.tp, " needs ", options.tp,
             " ranks, one process per GPU (e.g. torchrun --no-python --nproc-per-node ", options.tp,
             " bin/step_bench --tp ", options.tp, "), but this run has ", launch.world_size);
    for (const StepConfig& config : configs) {
      // Checked before the world starts: at N > 1 ranks a config's error ends the run.
      SG_CHECK(config.model.heads == 0 || config.sequences % options.tp == 0, "--tp ", options.tp, ": config ",
               config.name, " has ", config.sequences, " sequence(s) of ", config.seq_len,
               " tokens, which do not split over the ranks (each rank's rows are whole sequences); leave ",
               config.name, " out of --configs (medium and large have 2)");
    }
    run_options.overlap = options.overlap;
  } else {
    check_dp_flag(options.dp, launch.world_size);
    if (options.dp == 0) return run_single(options, device, configs, run_options);
  }
  try {
    return run_parallel(options, device, configs, run_options, launch, env);
  } catch (const std::exception& error) {
    if (launch.world_size == 1) throw;
    const auto* engine_error = dynamic_cast<const Error*>(&error);
    std::cerr << "step_bench rank " << launch.rank << " of " << launch.world_size << ": "
              << (engine_error != nullptr ? engine_error->message() : std::string(error.what()))
              << "\n  (this rank ends here; the launcher ends the others)\n";
    return EXIT_FAILURE;
  }
}

}  // namespace
}  // namespace stepgraph::bench

int main(int argc, char** argv) {
  CLI::App app{"Training step, eager and graphed: step time, tokens/s, MFU, pool, capture time, memory"};
  stepgraph::bench::Options options;
  // The choices' texts, converted once after parsing (CLI11 checked the names).
  std::string device = "cuda";
  std::string overlap = "bulk";
  std::string dp_mode = "allreduce";
  std::string fp8 = "none";
  std::string gemm_algorithms = "heuristic";
  bool fp8_weight_cache = false;
  app.add_option("--configs", options.configs,
                 "comma-separated: small, medium, large, moe, long (--cp's; tiny, moe_tiny: host smoke)")
      ->capture_default_str();
  app.add_option("--steps", options.steps, "timed steps per mode (>= 50 for the report)")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed steps first; the first 5 compare eager and graph losses")
      ->capture_default_str();
  app.add_option("--device", device, "cuda, or host (only with --configs tiny or moe_tiny)")
      ->check(CLI::IsMember({"cuda", "host"}))
      ->capture_default_str();
  app.add_option("--dp", options.dp,
                 "data parallel over the launch's N ranks (torchrun/srun/mpirun; one process: 1): per-GPU tokens/s "
                 "at N against each GPU alone");
  app.add_option("--tp", options.tp,
                 "tensor parallel over the launch's N ranks: the same global step sharded over N GPUs against one GPU "
                 "training it alone");
  app.add_option("--cp", options.cp,
                 "context parallel over the launch's N ranks: each config's sequences N times as long over N GPUs "
                 "against one GPU training the config's (the same tokens per GPU); efficiency = cp1 / cpN step time");
  app.add_option("--pp", options.pp,
                 "pipeline parallel over the launch's P ranks: each config's GPT in P stages against each GPU "
                 "training it alone on the same microbatches; graph/eager speedup and the bubble");
  app.add_option("--ep", options.ep,
                 "expert parallel over the launch's N ranks: each config's MoE experts spread over N GPUs (each "
                 "training the config's tokens) against each GPU training the whole config alone; efficiency = ep1 / "
                 "epN step time (configs with experts: moe; host: moe_tiny)");
  int virtual_stages = stepgraph::bench::PipelineRunOptions{}.virtual_stages;
  std::int64_t microbatches = stepgraph::bench::PipelineRunOptions{}.microbatches;
  CLI::Option* virtual_stages_flag =
      app.add_option("--virtual-stages", virtual_stages,
                     "with --pp: model chunks a rank (V > 1: interleaved 1F1B; a config's layers must divide by P x V)")
          ->capture_default_str();
  CLI::Option* microbatches_flag =
      app.add_option("--microbatches", microbatches,
                     "with --pp: microbatches a step (M), one sequence of the config's seq_len each")
          ->capture_default_str();
  app.add_option("--overlap", overlap, "with --tp: none, bulk, overlap, or four modes (trainer/README.md)")
      ->capture_default_str();
  app.add_flag("--profile", options.profile,
               "after each graphed row, one profiled step: each stream's busy time, the exposed communication, the "
               "largest ops by summed time with their share of the step (every op in the JSON)");
  app.add_flag("--cuda-profiler-range", options.cuda_profiler_range,
               "after each graphed row's timed steps, one replay between cudaProfilerStart and cudaProfilerStop: "
               "ncu --profile-from-start off (or nsys --capture-range=cudaProfilerApi) then sees that step alone");
  app.add_option("--dp-mode", dp_mode, "with --dp: allreduce, or zero1 (sharded optimizer)")
      ->check(CLI::IsMember({"allreduce", "zero1"}))
      ->capture_default_str();
  std::string dp_update_stream = "captured";
  app.add_option("--dp-update-stream", dp_update_stream,
                 "with --dp allreduce: where each group's update runs after its all-reduce: comm (the communication "
                 "stream), wgrad (the weight-gradient stream) or captured (comm in a captured step, wgrad eager); "
                 "Note [Where summed updates run] in optim/adamw.h")
      ->check(CLI::IsMember({"captured", "comm", "wgrad"}))
      ->capture_default_str();
  app.add_option("--timeout-s", options.timeout_s, "with --dp: a rank that does not answer within this is an error")
      ->capture_default_str();
  app.add_option("--fp8", fp8,
                 "FP8 GEMMs in the attention projections, MLPs and experts: none, current, delayed or block (block: "
                 "not in MoE configs); MFU stays counted against the bf16 peak")
      ->check(CLI::IsMember({"none", "current", "delayed", "block"}))
      ->capture_default_str();
  app.add_flag("--skip-nonfinite", options.skip_nonfinite,
               "skip a step whose loss or gradients are not finite, on the device (the trainer's default): the "
               "updates wait for the backward and run inside a CUDA conditional node");
  app.add_option("--dropout", options.dropout, "dropout on the blocks' input and attention and MLP outputs")
      ->check(CLI::Range(0.0, 0.99));
  app.add_flag("--recompute-activation", options.recompute_activation,
               "dense blocks keep fc1's pre-activation only and compute GeLU again in the backward");
  app.add_flag("--step-scoped-gradients", options.step_scoped_gradients,
               "gradients live from their backward to their group's update, in the step's memory, not persistent "
               "(not with --dp, --tp, --skip-nonfinite)");
  app.add_flag("--fp8-weight-cache", fp8_weight_cache,
               "with --fp8 current or delayed: each weight quantized once per optimizer step into persistent copies");
  app.add_option("--gemm-algorithms", gemm_algorithms,
                 "heuristic (cuBLASLt's choice, the same bits every run) or timed (the fastest in this process)")
      ->check(CLI::IsMember({"heuristic", "timed"}))
      ->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here (with --dp: rank 0)");
  CLI11_PARSE(app, argc, argv);
  try {
    namespace sg = stepgraph;
    options.device = device == "cuda" ? sg::Device::kCuda : sg::Device::kHost;
    if (virtual_stages_flag->count() > 0) options.virtual_stages = virtual_stages;
    if (microbatches_flag->count() > 0) options.microbatches = microbatches;
    options.dp_mode = dp_mode == "zero1" ? sg::DataParallelMode::kZero1 : sg::DataParallelMode::kAllReduce;
    options.dp_update_stream = dp_update_stream == "wgrad"  ? sg::AdamW::SummedUpdateStream::kWeightGradient
                               : dp_update_stream == "comm" ? sg::AdamW::SummedUpdateStream::kCommunication
                                                            : sg::AdamW::SummedUpdateStream::kCommunicationWhenCaptured;
    options.gemm_algorithms = *sg::parse_algorithm_choice(gemm_algorithms);
    if (fp8 != "none") {
      options.fp8 = sg::Fp8Recipe::of(sg::parse_fp8_scaling(fp8));
      options.fp8->cache_weights = fp8_weight_cache;
    }
    try {
      options.overlap = sg::MLPOverlap::parse(overlap);
    } catch (const sg::Error& error) {
      std::cerr << "step_bench: --overlap: " << error.message() << "\n";
      return 2;
    }
    return stepgraph::bench::run(options);
  } catch (const stepgraph::Error& error) {
    std::cerr << "step_bench: " << error.message() << "\n";
    return EXIT_FAILURE;
  } catch (const std::exception& error) {
    std::cerr << "step_bench: " << error.what() << "\n";
    return EXIT_FAILURE;
  }
}
