#include "benchmarks/pipeline_step_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>

#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "graphs/planner.h"
#include "optim/adamw.h"
#include "train/language_model_stages.h"
#include "train/pipeline_train_step.h"

namespace stepgraph::bench {
namespace {

LanguageModelConfig language_model_config(const StepConfig& config, const StepRunOptions& options) {
  LanguageModelConfig out;
  out.model = config.model;
  out.model.recompute_activation = options.recompute_activation;
  out.model.dropout = options.dropout;
  out.context = config.seq_len;
  return out;
}

// The global batch of M microbatches of one sequence each: tokens and labels
// uniform in [0, vocab) from `seed`, the same on every rank.
struct GlobalBatch {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> labels;
};

GlobalBatch draw_batch(const StepConfig& config, std::int64_t microbatches, std::uint32_t seed) {
  const auto count = static_cast<std::size_t>(microbatches * config.seq_len);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(config.model.vocab - 1));
  GlobalBatch batch{std::vector<std::int32_t>(count), std::vector<std::int32_t>(count)};
  for (auto& t : batch.tokens) t = token(rng);
  for (auto& l : batch.labels) l = token(rng);
  return batch;
}

// As the trainer's load_microbatches: microbatch m is the m-th sequence;
// stage 0 takes its tokens, the last stage its labels, the others nothing.
void load_microbatches(Context& ctx, const LanguageModelStages& stages, const GlobalBatch& batch,
                       std::int64_t microbatches, std::int64_t seq_len) {
  const auto len = static_cast<std::size_t>(seq_len);
  for (std::int64_t m = 0; m < microbatches; ++m) {
    const std::size_t first = static_cast<std::size_t>(m) * len;
    if (stages.is_first()) {
      ctx.copy_from_host(stages.tokens(m), batch.tokens.data() + first, len * sizeof(std::int32_t));
    }
    if (stages.is_last()) {
      ctx.copy_from_host(stages.labels(m), batch.labels.data() + first, len * sizeof(std::int32_t));
    }
  }
}

// ModeResult::persistent_breakdown of a stage and its optimizer.
std::map<std::string, std::int64_t> persistent_breakdown(const LanguageModelStages& stages, const AdamW& optimizer,
                                                         std::int64_t total) {
  std::map<std::string, std::int64_t> out{
      {"masters", 0}, {"gradients", 0}, {"gradient_sums", 0}, {"moments", 0}, {"copies", 0}};
  for (const Parameter* p : stages.parameters()) {
    if (p->grad.defined()) out["gradients"] += p->grad.bytes();
    out["masters"] += p->master.bytes();
    if (p->has_copy()) out["copies"] += p->value.bytes();
  }
  for (const Tensor& sum : stages.gradient_sums()) out["gradient_sums"] += sum.bytes();
  for (const AdamW::Moments& m : optimizer.moments()) out["moments"] += m.m.bytes() + m.v.bytes();
  std::int64_t counted = 0;
  for (const auto& [kind, bytes] : out) counted += bytes;
  out["other"] = total - counted;
  return out;
}

// The pp1 rows' pipeline: a communicator of this process alone.
struct OneRankPipeline {
  std::unique_ptr<HostWorld> host;  // host only; outlives `comm`
  std::unique_ptr<Communicator> comm;
};

OneRankPipeline one_rank_pipeline(Device device) {
  OneRankPipeline out;
  if (device == Device::kHost) {
    out.host = std::make_unique<HostWorld>(1);
    out.comm = out.host->communicator(0, "pp1");
    return out;
  }
  int current = 0;
  SG_CUDA_CHECK(cudaGetDevice(&current));
  NcclCommunicatorOptions options;
  options.name = "pp1";
  options.device = current;
  out.comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1, options);
  return out;
}

constexpr std::string_view kFlag = "step_bench --pp";

// Runs one row's mode on this rank and gathers every rank's result.
PipelineRowResult run_row(const StepConfig& config, StepMode mode, const StepRunOptions& options,
                          Communicator& pipeline, const PipelineRunOptions& pipeline_options, Communicator* world,
                          const std::string& what) {
  log_row_start(kFlag, world, what);
  PipelineRowResult row;
  row.ranks = gather_results(world, run_pipeline_mode(config, mode, options, pipeline, pipeline_options), what);
  row.combined = combine_ranks(row.ranks);
  log_row_done(kFlag, world, what, row.combined.combined);
  return row;
}

// Before measuring (cuda only, as StepRunOptions::prime): one untimed eager
// step of one block alone, then, with several ranks, of P blocks over the
// pipeline: kernel modules load, cuBLASLt times its algorithms and NCCL
// connects the stages before any mode's memory delta or capture is measured.
void prime(const StepConfig& config, const StepRunOptions& options, Communicator& alone, Communicator* world) {
  if (!options.prime || options.device != Device::kCuda) return;
  StepRunOptions once = options;
  once.steps = 1;
  once.warmup = 1;
  once.profile = false;
  once.cuda_profiler_range = false;
  StepConfig blocks = config;
  blocks.model.layers = 1;
  (void)run_pipeline_mode(blocks, StepMode::kEager, once, alone, {.virtual_stages = 1, .microbatches = 1});
  if (world != nullptr && world->world_size() > 1) {
    blocks.model.layers = world->world_size();
    (void)run_pipeline_mode(blocks, StepMode::kEager, once, *world,
                            {.virtual_stages = 1, .microbatches = world->world_size()});
  }
}

std::string pp_system_name(StepMode mode, int stages) { return parallel_system_name(mode, "pp", stages); }

template <typename T, typename F>
std::vector<T> per_rank(const PipelineRowResult& row, F field) {
  std::vector<T> out;
  for (const ModeResult& r : row.ranks) out.push_back(field(r));
  return out;
}

// One row (Note [Pipeline-parallel rows]): system_json's fields of the
// pipeline's step, per GPU where the model spans several, every rank's
// memory (and pool, graphed), and against the pp1 row the bubble.
nlohmann::json pipeline_row_json(const StepConfig& step, StepMode mode, int stages, int virtual_stages,
                                 std::int64_t microbatches, const PipelineRowResult& row,
                                 const PipelineRowResult& eager, const PipelineRowResult* baseline) {
  const ModeResult& r = row.combined.combined;
  nlohmann::json out = system_json(pp_system_name(mode, stages), step, r, eager.combined.combined);
  out["pp"] = stages;
  out["world_size"] = stages;  // the GPUs the model spans
  out["virtual_stages"] = virtual_stages;
  out["rank_median_us"] = row.combined.rank_median_us;
  out["rank_first_loss"] = row.combined.rank_first_loss;
  // tokens_per_s stays the row's (the pipeline's, or one GPU's alone); TFLOP/s and MFU are per GPU.
  out["tokens_per_s_per_gpu"] = out["tokens_per_s"].get<double>() / stages;
  out["tflops"] = out["tflops"].get<double>() / stages;
  out["mfu"] = out["mfu"].get<double>() / stages;
  out["rank_persistent_bytes"] = per_rank<std::int64_t>(row, [](const ModeResult& m) { return m.persistent_bytes; });
  out["rank_device_used_delta_bytes"] = per_rank<nlohmann::json>(row, [](const ModeResult& m) {
    return m.device_used_delta_bytes ? nlohmann::json(*m.device_used_delta_bytes) : nlohmann::json(nullptr);
  });
  const double median = r.step_us.median_us;
  if (mode == StepMode::kGraph) {
    add_graph_fields(out, r);  // rank 0's; every rank's below
    out["graph_speedup_vs_eager"] = eager.combined.combined.step_us.median_us / median;
    out["rank_pool_bytes"] = per_rank<std::int64_t>(row, [](const ModeResult& m) { return m.pool_bytes; });
    out["rank_pool_lower_bound_bytes"] =
        per_rank<std::int64_t>(row, [](const ModeResult& m) { return m.pool_lower_bound_bytes; });
    out["rank_pool_ratio"] = per_rank<double>(row, [](const ModeResult& m) {
      return m.pool_lower_bound_bytes == 0
                 ? 1.0
                 : static_cast<double>(m.pool_bytes) / static_cast<double>(m.pool_lower_bound_bytes);
    });
    out["rank_capture_plus_instantiate_ms"] =
        per_rank<double>(row, [](const ModeResult& m) { return m.capture.capture_ms + m.capture.instantiate_ms; });
    out["rank_capture_wall_ms"] = per_rank<double>(row, [](const ModeResult& m) { return m.capture_wall_ms; });
  }
  const double theoretical = theoretical_bubble_fraction(stages, virtual_stages, microbatches);
  if (baseline != nullptr) {
    const ModeResult& base = baseline->combined.combined;
    const double measured = 1.0 - base.step_us.median_us / (stages * median);
    out["baseline_system"] = pp_system_name(mode, 1);
    out["speedup_vs_pp1"] = base.step_us.median_us / median;
    out["measured_bubble_fraction"] = measured;
    out["pipelined_measured_bubble_fraction"] = 1.0 - base.pipelined_step_us / (stages * r.pipelined_step_us);
    out["theoretical_bubble_fraction"] = theoretical;
    out["bubble_ratio"] = theoretical > 0 ? nlohmann::json(measured / theoretical) : nlohmann::json(nullptr);
  } else {
    for (const char* key : {"baseline_system", "speedup_vs_pp1", "measured_bubble_fraction",
                            "pipelined_measured_bubble_fraction", "bubble_ratio"}) {
      out[key] = nullptr;
    }
    out["theoretical_bubble_fraction"] = theoretical;  // 0: one stage has no bubble
  }
  add_profile_fields(out, r);
  return out;
}

// The pipeline's first loss against one GPU's on the same global batch.
nlohmann::json first_loss_check(const PipelineRowResult& alone, const PipelineRowResult& pipeline) {
  const std::vector<float>& a = alone.combined.combined.first_losses;
  const std::vector<float>& p = pipeline.combined.combined.first_losses;
  const double base = a.empty() ? NAN : a.front();
  const double got = p.empty() ? NAN : p.front();
  const double diff = std::fabs(got - base);
  return {{"pp1_first_loss", base},
          {"pp_first_loss", got},
          {"abs_diff", diff},
          {"identical", !a.empty() && !p.empty() && a.front() == p.front()},
          {"agrees", diff <= 1e-4 * std::max(1.0, std::fabs(base))}};
}

}  // namespace

std::string pipeline_schedule_name(int virtual_stages) { return virtual_stages > 1 ? "interleaved 1F1B" : "1F1B"; }

double theoretical_bubble_fraction(int stages, int virtual_stages, std::int64_t microbatches) {
  SG_CHECK(stages >= 1 && virtual_stages >= 1 && microbatches >= 1,
           "theoretical_bubble_fraction: stages, virtual stages and microbatches must be >= 1, got ", stages, ", ",
           virtual_stages, " and ", microbatches);
  const double idle = stages - 1;
  return idle / (static_cast<double>(virtual_stages) * static_cast<double>(microbatches) + idle);
}

StepConfig pipeline_step_config(const StepConfig& config, std::int64_t microbatches) {
  SG_CHECK(microbatches >= 1, "--microbatches must be >= 1, got ", microbatches);
  StepConfig out = config;
  out.sequences = microbatches;
  out.tokens = microbatches * config.seq_len;
  return out;
}

void check_pipeline_config(const StepConfig& config, int stages, const PipelineRunOptions& pipeline) {
  const int v = pipeline.virtual_stages;
  const std::int64_t m = pipeline.microbatches;
  SG_CHECK(stages >= 1, "--pp must be the number of ranks (>= 1), got ", stages);
  SG_CHECK(v >= 1, "--virtual-stages must be >= 1, got ", v);
  SG_CHECK(m >= 1, "--microbatches must be >= 1, got ", m);
  SG_CHECK(v == 1 || stages >= 2, "--virtual-stages ", v,
           " needs --pp 2 or more (interleaved chunks pass their activations from rank to rank); pass "
           "--virtual-stages 1 at --pp ",
           stages);
  SG_CHECK(v == 1 || m % stages == 0, "--virtual-stages ", v, " with --pp ", stages, ": --microbatches ", m,
           " must be a multiple of --pp (interleaved 1F1B runs the microbatches in groups of the stages)");
  SG_CHECK(config.model.heads > 0 && config.model.experts == 0, "--pp ", stages, ": config ", config.name,
           " is not a dense GPT (pipeline stages need attention and no MoE blocks yet); leave it out of --configs "
           "(medium, large and tiny run)");
  SG_CHECK(config.model.layers % (static_cast<std::int64_t>(stages) * v) == 0, "--pp ", stages, " --virtual-stages ", v,
           ": config ", config.name, " has ", config.model.layers,
           " layers, which do not divide by --pp x --virtual-stages = ", stages * v,
           " (every chunk runs the same number of blocks); leave ", config.name,
           " out of --configs or give a --pp and --virtual-stages whose product divides its layers");
}

ModeResult run_pipeline_mode(const StepConfig& config, StepMode mode, const StepRunOptions& options,
                             Communicator& pipeline, const PipelineRunOptions& pipeline_options) {
  check_run_options(options);
  check_pipeline_config(config, pipeline.world_size(), pipeline_options);
  SG_CHECK(!options.skip_nonfinite && !options.step_scoped_gradients && options.data_parallel == nullptr &&
               options.tensor_parallel == nullptr && options.context_parallel == nullptr,
           "--pp: --skip-nonfinite, --step-scoped-gradients, --dp, --tp and --cp are not supported with pipeline "
           "stages yet; leave them out");
  const bool cuda = options.device == Device::kCuda;
  const std::int64_t used_before = cuda ? device_used_bytes() : 0;
  const std::int64_t microbatches = pipeline_options.microbatches;
  ModeResult r;
  // The trainer's layout with several ranks: the transfers and the loss broadcast on stream 2.
  Context ctx(options.device, 2);
  ctx.set_communication_stream(2);
  ctx.set_algorithm_choice(options.gemm_algorithms);
  LanguageModelStagesOptions stage_options;
  stage_options.virtual_stages = pipeline_options.virtual_stages;
  LanguageModelStages stages(ctx, pipeline, language_model_config(config, options), /*batch=*/1, microbatches,
                             stage_options);
  AdamW optimizer(ctx, stages.parameters(), {.lr = options.lr, .weight_decay = options.weight_decay});
  PipelineTrainStep step(stages, optimizer);
  load_microbatches(ctx, stages, draw_batch(config, microbatches, options.data_seed), microbatches, config.seq_len);

  time_step(
      ctx, mode, options, [&] { return step(ctx); }, stages.communicators(), [&] { stages.check_errors(ctx); },
      detail::concat("config ", config.name, " at --pp ", pipeline.world_size()), r);
  const MemoryStats stats = ctx.memory_stats();
  r.persistent_bytes = stats.persistent_bytes;
  r.persistent_breakdown = persistent_breakdown(stages, optimizer, stats.persistent_bytes);
  r.transient_peak_bytes = stats.eager_peak_bytes + r.pool_bytes;
  if (cuda) r.device_used_delta_bytes = device_used_bytes() - used_before;
  return r;
}

nlohmann::json pipeline_config_json(const StepConfig& config, const PipelineResults& results) {
  const int n = results.world_size;
  const int v = results.pipeline.virtual_stages;
  const std::int64_t m = results.pipeline.microbatches;
  SG_CHECK_CODE(
      n >= 1 && (n == 1) == !results.pipeline_eager.has_value() && (n == 1) == !results.pipeline_graph.has_value(),
      ErrorCode::kInternal, "pipeline_config_json: world size ", n, " with",
      results.pipeline_eager || results.pipeline_graph ? "" : "out", " pipeline results");
  const StepConfig step = pipeline_step_config(config, m);
  nlohmann::json out = config_header_json(step);
  out["status"] = "ok";
  out["reason"] = nullptr;
  out["world_size"] = n;
  out["pp"] = n;
  out["virtual_stages"] = v;
  out["microbatches"] = m;
  out["microbatch_sequences"] = 1;
  out["global_batch"] =
      detail::concat(m, " microbatches of one sequence of ", config.seq_len, " tokens each: ", step.tokens,
                     " tokens a step (the config's own `sequences` are not used)");
  out["schedule"] = pipeline_schedule_name(v);
  out["blocks_per_chunk"] = config.model.layers / (static_cast<std::int64_t>(n) * v);
  out["theoretical_bubble_fraction"] = theoretical_bubble_fraction(n, v, m);

  const PipelineRowResult& top_eager = n > 1 ? *results.pipeline_eager : results.alone_eager;
  const PipelineRowResult& top_graph = n > 1 ? *results.pipeline_graph : results.alone_graph;
  nlohmann::json loss_check = parallel_loss_check(
      top_eager.combined, top_graph.combined, pp_system_name(StepMode::kEager, n), pp_system_name(StepMode::kGraph, n));
  loss_check[pp_system_name(StepMode::kEager, 1)] = results.alone_eager.combined.combined.first_losses;
  loss_check[pp_system_name(StepMode::kGraph, 1)] = results.alone_graph.combined.combined.first_losses;
  if (n > 1) {
    loss_check[pp_system_name(StepMode::kEager, n)] = results.pipeline_eager->combined.combined.first_losses;
    loss_check[pp_system_name(StepMode::kGraph, n)] = results.pipeline_graph->combined.combined.first_losses;
    out["pp_loss_check"] = {{"eager", first_loss_check(results.alone_eager, *results.pipeline_eager)},
                            {"graph", first_loss_check(results.alone_graph, *results.pipeline_graph)}};
  }
  // The pipeline broadcasts its loss to every stage (the pp1 ranks train alone: nothing to agree on).
  loss_check["ranks_agree"] = ranks_agree(top_eager.combined) && ranks_agree(top_graph.combined);
  out["loss_check"] = loss_check;

  nlohmann::json systems = nlohmann::json::array();
  systems.push_back(
      pipeline_row_json(step, StepMode::kEager, 1, 1, m, results.alone_eager, results.alone_eager, nullptr));
  systems.push_back(
      pipeline_row_json(step, StepMode::kGraph, 1, 1, m, results.alone_graph, results.alone_eager, nullptr));
  if (n > 1) {
    systems.push_back(pipeline_row_json(step, StepMode::kEager, n, v, m, *results.pipeline_eager,
                                        *results.pipeline_eager, &results.alone_eager));
    systems.push_back(pipeline_row_json(step, StepMode::kGraph, n, v, m, *results.pipeline_graph,
                                        *results.pipeline_eager, &results.alone_graph));
  }
  out["systems"] = std::move(systems);
  return out;
}

nlohmann::json run_pipeline_config(const StepConfig& config, const StepRunOptions& options, Communicator* world,
                                   const PipelineRunOptions& pipeline) {
  const int n = world != nullptr ? world->world_size() : 1;
  auto body = [&] {
    check_pipeline_config(config, n, pipeline);
    StepRunOptions timed = options;
    timed.data_parallel = nullptr;
    timed.tensor_parallel = nullptr;
    timed.context_parallel = nullptr;
    timed.timed_with = n > 1 ? world : nullptr;
    OneRankPipeline alone = one_rank_pipeline(options.device);
    const PipelineRunOptions one_stage{.virtual_stages = 1, .microbatches = pipeline.microbatches};
    prime(config, timed, *alone.comm, n > 1 ? world : nullptr);
    meet(timed.timed_with, "primed " + config.name);
    PipelineResults results;
    results.world_size = n;
    results.pipeline = pipeline;
    const std::string pp = detail::concat(" pp", n);
    results.alone_eager =
        run_row(config, StepMode::kEager, timed, *alone.comm, one_stage, world, config.name + " pp1 eager");
    results.alone_graph =
        run_row(config, StepMode::kGraph, timed, *alone.comm, one_stage, world, config.name + " pp1 graph");
    if (n > 1) {
      results.pipeline_eager =
          run_row(config, StepMode::kEager, timed, *world, pipeline, world, config.name + pp + " eager");
      results.pipeline_graph =
          run_row(config, StepMode::kGraph, timed, *world, pipeline, world, config.name + pp + " graph");
    }
    return pipeline_config_json(config, results);
  };
  return run_or_failed_row(config, n, body);
}

nlohmann::json pipeline_parallel_header(int world_size, const PipelineRunOptions& pipeline, const Communicator* world) {
  const int n = world_size;
  return {
      {"world_size", n},
      {"virtual_stages", pipeline.virtual_stages},
      {"microbatches", pipeline.microbatches},
      {"schedule", pipeline_schedule_name(pipeline.virtual_stages)},
      {"communicator", world != nullptr ? world->describe() : "none (world size 1)"},
      {"baseline_communicator",
       "each rank's own pipeline of one stage: NCCL of one rank on its GPU (cuda), a thread world of one (host)"},
      {"global_batch",
       "M microbatches of one sequence of the config's seq_len tokens each (M x seq_len tokens a step, the same on "
       "every rank; stage 0 loads the tokens, the last stage the labels)"},
      {"baseline",
       "stepgraph_<mode>_pp1: every rank trains the whole GPT alone on its GPU over the same M microbatches (one "
       "stage, no transfers), all ranks at the same time"},
      {"timing", kParallelTimingText},
      {"formulas",
       {{"measured_bubble_fraction",
         "1 - median(pp1) / (P x median(ppP)), same mode: the schedule's bubble plus the transfers not hidden, the "
         "loss broadcast and the stages' imbalance (embedding on the first, head on the last)"},
        {"theoretical_bubble_fraction", "(P - 1) / (V x M + P - 1)"},
        {"bubble_ratio", "measured_bubble_fraction / theoretical_bubble_fraction"},
        {"graph_speedup_vs_eager", "median(eager) / median(graph) of the same row"},
        {"tokens_per_s", "the row's tokens (M x seq_len) / median step time; tokens_per_s_per_gpu: / P"},
        {"tflops", "per GPU: the step's model FLOPs / P / median step time"}}},
      {"goal", "graphed ppP step >= 1.2x the eager ppP step (graph_speedup_vs_eager)"},
      {"rows", "Note [Pipeline-parallel rows] in benchmarks/pipeline_step_runner.h"},
      {"note", n == 1 ? "world size 1: the pp1 rows alone; nothing is pipelined" : ""},
  };
}

std::string pipeline_config_line(const nlohmann::json& c) {
  const std::string name = c["name"];
  char buffer[512];
  if (c["status"] != "ok") {
    std::snprintf(buffer, sizeof(buffer), "%-7s %s: %s", name.c_str(), c["status"].get<std::string>().c_str(),
                  c["reason"].get<std::string>().c_str());
    return buffer;
  }
  std::string line;
  std::snprintf(buffer, sizeof(buffer), "%-7s", name.c_str());
  line += buffer;
  for (const nlohmann::json& s : c["systems"]) {
    const auto ms = [&](const char* key) { return s["step_us"][key].get<double>() / 1000.0; };
    std::snprintf(buffer, sizeof(buffer), "  %s %.3f ms [%.3f-%.3f]", s["system"].get<std::string>().c_str(),
                  ms("median_us"), ms("min_us"), ms("max_us"));
    line += buffer;
    if (s.contains("graph_speedup_vs_eager")) {
      std::snprintf(buffer, sizeof(buffer), " (graph %.2fx eager, pool %.2fx lower bound)",
                    s["graph_speedup_vs_eager"].get<double>(), s["pool_ratio"].get<double>());
      line += buffer;
    }
    if (!s["measured_bubble_fraction"].is_null()) {
      std::snprintf(buffer, sizeof(buffer), " (bubble %.3f measured, %.3f theoretical)",
                    s["measured_bubble_fraction"].get<double>(), s["theoretical_bubble_fraction"].get<double>());
      line += buffer;
    }
  }
  const nlohmann::json& check = c["loss_check"];
  line += detail::concat("  first ", check["steps"].get<int>(), " losses ", check["compared"][0].get<std::string>(),
                         " vs ", check["compared"][1].get<std::string>(), ": ",
                         check["identical"].get<bool>() ? "identical" : "DIFFER");
  if (c.contains("pp_loss_check")) {
    for (const char* mode : {"eager", "graph"}) {
      const nlohmann::json& d = c["pp_loss_check"][mode];
      line += detail::concat("; ", mode, " first loss vs pp1: ", d["agrees"].get<bool>() ? "agrees" : "DIFFERS", " (",
                             d["abs_diff"].get<double>(), ")");
    }
  }
  return line;
}

bool pipeline_losses_disagree(const nlohmann::json& c) {
  if (!c.contains("loss_check")) return false;
  const nlohmann::json& check = c["loss_check"];
  if (!check["identical"].get<bool>() || !check["ranks_agree"].get<bool>()) return true;
  if (!c.contains("pp_loss_check")) return false;
  return !c["pp_loss_check"]["eager"]["agrees"].get<bool>() || !c["pp_loss_check"]["graph"]["agrees"].get<bool>();
}

}  // namespace stepgraph::bench
