#include "benchmarks/step_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <string_view>

#include "benchmarks/model_flops.h"
#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "graphs/planner.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "train/context_parallel_batch.h"
#include "train/train_step.h"

namespace stepgraph::bench {
namespace {

using Clock = std::chrono::steady_clock;

double microseconds_since(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// The fixed batch every step of both modes trains on: the global batch's
// rows from `seed`; context-parallel, this rank's zig-zag chunks of them.
void load_batch(Context& ctx, const TrainStep& step, const StepConfig& config, std::uint32_t seed, int cp,
                int cp_rank) {
  const std::int64_t tokens = step.labels().shape().dim(0) * cp;  // the global batch's rows
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> x(static_cast<std::size_t>(tokens * config.model.hidden));
  for (auto& v : x) v = float_to_bf16(uniform(rng));
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(config.model.vocab - 1));
  std::vector<std::int32_t> labels(static_cast<std::size_t>(tokens));
  for (auto& v : labels) v = label(rng);
  if (cp > 1) {
    x = context_parallel_rows<std::uint16_t>(x, config.model.hidden, cp, cp_rank);
    labels = context_parallel_rows<std::int32_t>(labels, 1, cp, cp_rank);
  }
  ctx.copy_from_host(step.inputs(), x.data(), x.size() * sizeof(std::uint16_t));
  ctx.copy_from_host(step.labels(), labels.data(), labels.size() * sizeof(std::int32_t));
}

// Context-parallel: the CP group's packing, the config's `sequences` of
// seq_len, then empty sequences up to the packing's length (TrainStep sized
// it for whole sequences per rank, which one long sequence over the ranks
// is not).
void load_cp_packing(Context& ctx, const TrainStep& step, const StepConfig& config) {
  const std::int64_t entries = step.packing().shape().dim(0);
  SG_CHECK_CODE(entries >= config.sequences + 1, ErrorCode::kInternal, "config ", config.name, ": a packing of ",
                entries - 1, " sequences cannot hold its ", config.sequences);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(entries));
  for (std::int64_t s = 0; s < entries; ++s) {
    cu[s] = static_cast<std::int32_t>(std::min(s, config.sequences) * config.seq_len);
  }
  ctx.copy_from_host(step.packing(), cu.data(), cu.size() * sizeof(std::int32_t));
}

float read_loss(Context& ctx, const Tensor& loss) { return ctx.to_vector<float>(loss).at(0); }

}  // namespace

// See Note [How a step is timed].
void time_step(Context& ctx, StepMode mode, const StepRunOptions& options, const CapturedStep::StepFunction& step,
               const std::vector<Communicator*>& communicators, const std::function<void()>& check_errors,
               std::string_view what, ModeResult& r) {
  std::shared_ptr<CapturedStep> captured;
  std::function<Tensor()> run_one = [&] { return step().at(0); };
  if (mode == StepMode::kGraph) {
    const Clock::time_point start = Clock::now();
    captured = CapturedStep::capture(ctx, step,
                                     {.pool_report_policy = PoolReportPolicy::kError, .communicators = communicators});
    r.capture_wall_ms = microseconds_since(start) / 1000.0;
    r.capture = captured->timings();
    r.pool_peak_by_op = pool_by_producer(captured->program(), captured->plan());
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
  check_errors();

  std::vector<double>& samples = r.samples_us;
  samples.reserve(static_cast<std::size_t>(options.steps));
  for (int i = 0; i < options.steps; ++i) {
    meet(options.timed_with, "timed step");
    const Clock::time_point start = Clock::now();
    loss = run_one();
    ctx.synchronize();
    samples.push_back(microseconds_since(start));
  }
  r.step_us = summarize(samples);

  meet(options.timed_with, "pipelined steps");
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < options.steps; ++i) loss = run_one();
  ctx.synchronize();
  r.pipelined_step_us = microseconds_since(start) / options.steps;

  if (options.profile && captured) {
    const StepProfile profile = captured->profile();
    r.profile = profile.to_string();
    r.profile_exposed_comm_us = profile.exposed_communication_us;
    r.profile_total_us = profile.total_us;
  }
  if (options.cuda_profiler_range && captured) {
    cuda_profiler_start();
    loss = run_one();
    ctx.synchronize();
    cuda_profiler_stop();
  }
  r.final_loss = read_loss(ctx, loss);
  SG_CHECK_CODE(std::isfinite(r.final_loss), ErrorCode::kInternal, what, ": the loss after ",
                options.warmup + 2 * options.steps, " steps is not finite (", r.final_loss, ")");
}

// Device bytes in use now (cudaMemGetInfo on the current device, the one a
// Context uses: step_bench selects the rank's GPU before anything else).
std::int64_t device_used_bytes() {
  int current = 0;
  SG_CUDA_CHECK(cudaGetDevice(&current));
  const DeviceMemory memory = device_memory(current);
  return static_cast<std::int64_t>(memory.total_bytes - memory.free_bytes);
}

// Every rank's bytes, in rank order (just `mine` in a world of one). The
// exchange carries `what`, so ranks that reach different exchanges (one of
// them failed on the way) get an Error naming both instead of mixing them up.
std::vector<std::string> gather(Communicator* world, const std::string& mine, std::string_view what) {
  if (world == nullptr || world->world_size() == 1) return {mine};
  const std::string tag = std::string(what) + '\n';
  std::vector<std::string> all = world->exchange(tag + mine, what);
  for (std::size_t r = 0; r < all.size(); ++r) {
    SG_CHECK_CODE(all[r].compare(0, tag.size(), tag) == 0, ErrorCode::kInvalidState, "step_bench: rank ", r,
                  " is at another exchange than this rank's '", what, "' (", all[r].substr(0, all[r].find('\n')),
                  "): the ranks are out of step");
    all[r].erase(0, tag.size());
  }
  return all;
}

// The ranks meet (nothing in a world of one).
void meet(Communicator* world, std::string_view what) { (void)gather(world, "", what); }

nlohmann::json system_json(const std::string& name, const StepConfig& config, const ModeResult& r,
                           const ModeResult& eager) {
  const double median_s = r.step_us.median_us * 1e-6;
  const double tflops = tflops_per_s(step_flops(config.model, config.tokens, config.sequences), median_s);
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
      {"persistent_breakdown_bytes", r.persistent_breakdown},
      {"pool_peak_by_op_bytes", r.pool_peak_by_op},
      {"transient_peak_bytes", r.transient_peak_bytes},
      {"device_used_delta_bytes", r.device_used_delta_bytes ? nlohmann::json(*r.device_used_delta_bytes) : nullptr},
      {"final_loss", r.final_loss},
  };
  return out;
}

namespace {

// ModeResult::persistent_breakdown of a model and its optimizer, `total` the
// context's persistent bytes, so a report can say what each GiB is.
std::map<std::string, std::int64_t> persistent_breakdown(const ResidualStack& model,
                                                         const std::vector<Parameter*>& params, const AdamW& optimizer,
                                                         std::int64_t total) {
  std::map<std::string, std::int64_t> out{
      {"masters", 0}, {"gradients", 0}, {"moments", 0}, {"copies", 0}, {"fp8_state", 0}};
  for (const Parameter* p : params) {
    if (p->grad.defined()) out["gradients"] += p->grad.bytes();  // none between steps where step-scoped
    if (!optimizer.sharded()) out["masters"] += p->master.bytes();
    if (p->has_copy()) out["copies"] += p->value.bytes();
  }
  if (optimizer.sharded()) {
    for (const AdamW::ShardState& shard : optimizer.shard_states()) {
      out["masters"] += shard.master.bytes();
      out["moments"] += shard.m.bytes() + shard.v.bytes();
    }
  } else {
    for (const AdamW::Moments& m : optimizer.moments()) out["moments"] += m.m.bytes() + m.v.bytes();
  }
  for (const StateTensor& t : model.state()) out["fp8_state"] += t.tensor.bytes();
  std::int64_t counted = 0;
  for (const auto& [kind, bytes] : out) counted += bytes;
  out["other"] = total - counted;
  return out;
}

}  // namespace

void check_run_options(const StepRunOptions& options) {
  SG_CHECK(options.steps >= 1, "--steps must be >= 1, got ", options.steps);
  SG_CHECK(options.warmup >= 1, "--warmup must be >= 1 (the first steps check the losses), got ", options.warmup);
  SG_CHECK(options.loss_check_steps >= 1, "loss_check_steps must be >= 1, got ", options.loss_check_steps);
  SG_CHECK(!options.step_scoped_gradients ||
               (options.data_parallel == nullptr && options.tensor_parallel == nullptr &&
                options.context_parallel == nullptr && options.expert_parallel == nullptr && !options.skip_nonfinite),
           "--step-scoped-gradients works without --dp, --tp, --cp, --ep and --skip-nonfinite (their steps read "
           "persistent gradients)");
}

ModeResult run_mode(const StepConfig& config, StepMode mode, const StepRunOptions& options) {
  check_run_options(options);
  SG_CHECK(config.sequences >= 1 && config.tokens == config.sequences * config.seq_len, "config ", config.name,
           ": tokens ", config.tokens, " must be sequences ", config.sequences, " x seq_len ", config.seq_len);
  const bool cuda = options.device == Device::kCuda;
  const std::int64_t used_before = cuda ? device_used_bytes() : 0;
  ModeResult r;
  Context ctx(options.device, options.dp_layout ? 2 : 1);
  if (options.dp_layout) ctx.set_communication_stream(2);
  ctx.set_algorithm_choice(options.gemm_algorithms);
  ResidualStackConfig model_config = config.model;
  model_config.overlap = options.overlap;
  model_config.recompute_activation = options.recompute_activation;
  model_config.dropout = options.dropout;
  ResidualStack model(ctx, model_config, options.tensor_parallel, options.context_parallel, options.expert_parallel);
  AdamW optimizer(ctx, model.parameters(), {.lr = options.lr, .weight_decay = options.weight_decay});
  optimizer.set_skip_nonfinite(ctx, options.skip_nonfinite);
  optimizer.set_summed_update_stream(options.summed_update_stream);
  const int tp = options.tensor_parallel != nullptr ? options.tensor_parallel->world_size() : 1;
  const int cp = options.context_parallel != nullptr ? options.context_parallel->world_size() : 1;
  SG_CHECK(config.tokens % tp == 0, "config ", config.name, ": tokens ", config.tokens, " must divide by --tp ", tp);
  // With attention, TrainStep packs `sequences` sequences of seq_len over the tensor-parallel group's tokens, each
  // rank's rows holding sequences / tp of them whole.
  SG_CHECK(config.model.heads == 0 || config.sequences % tp == 0, "config ", config.name, ": its ", config.sequences,
           " sequences of ", config.seq_len, " tokens do not split over --tp ", tp,
           " ranks (each rank's rows are whole sequences); give --tp a divisor of ", config.sequences,
           " or leave the config out of --configs");
  SG_CHECK(cp == 1 || (tp == 1 && options.data_parallel == nullptr), "config ", config.name,
           ": --cp together with --tp or --dp is not benchmarked yet");
  SG_CHECK(options.expert_parallel == nullptr || (tp == 1 && cp == 1 && options.data_parallel == nullptr), "config ",
           config.name, ": --ep together with --tp, --cp or --dp is not benchmarked yet");
  SG_CHECK(config.tokens % (2 * cp) == 0, "config ", config.name, ": its ", config.tokens,
           " tokens do not cut into 2 x ", cp,
           " context-parallel chunks (Note [Context-parallel token layout]); "
           "give --cp a value whose double divides them");
  // Context-parallel, the CP group is the step's gradient group (DP x CP with DP = 1), and each rank's rows are
  // tokens / cp; the packing, the group's, is written below (a sequence may span the ranks).
  // Expert-parallel, the EP group is the step's gradient group (Note [Expert-parallel ResidualStack]).
  Communicator* gradient_group = cp > 1                               ? options.context_parallel
                                 : options.expert_parallel != nullptr ? options.expert_parallel
                                                                      : options.data_parallel;
  TrainStep step(ctx, model, optimizer, config.tokens / tp / cp, gradient_group, options.dp_mode,
                 cp > 1 ? (config.sequences + cp - 1) / cp : config.sequences / (config.model.heads > 0 ? tp : 1));
  if (options.step_scoped_gradients) optimizer.use_step_scoped_gradients(ctx);
  load_batch(ctx, step, config, options.data_seed, cp, cp > 1 ? options.context_parallel->rank() : 0);
  if (cp > 1) load_cp_packing(ctx, step, config);

  time_step(
      ctx, mode, options, [&] { return step(ctx); }, step.communicators(), [&] { step.check_errors(ctx); },
      detail::concat("config ", config.name), r);
  const MemoryStats stats = ctx.memory_stats();
  r.persistent_bytes = stats.persistent_bytes;
  r.persistent_breakdown = persistent_breakdown(model, model.parameters(), optimizer, stats.persistent_bytes);
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
      {"heads", m.heads},
      {"kv_heads", m.heads > 0 ? nlohmann::json(m.kv_heads != 0 ? m.kv_heads : m.heads) : nullptr},
      {"head_dim", m.heads > 0 ? nlohmann::json(m.hidden / m.heads) : nullptr},
      {"sequences", config.sequences},
      {"seq_len", config.seq_len},
      {"experts", m.experts},
      {"topk", m.experts > 0 ? nlohmann::json(m.topk) : nullptr},
      {"moe_every", m.experts > 0 ? nlohmann::json(m.moe_every) : nullptr},
      {"dtype", std::string(dtype_name(m.dtype))},
  };
  try {
    out["matmul_params_per_token"] = matmul_params_per_token(m);
    out["attention_core_flops_per_step"] = attention_core_flops(m, config.tokens, config.sequences);
    out["flops_per_step"] = step_flops(m, config.tokens, config.sequences);
  } catch (const Error&) {
    // A config too broken to count: run_config reports why it failed.
    out["matmul_params_per_token"] = nullptr;
    out["attention_core_flops_per_step"] = nullptr;
    out["flops_per_step"] = nullptr;
  }
  return out;
}

// The graph mode's own fields: pool against its lower bound, capture times.
void add_graph_fields(nlohmann::json& out, const ModeResult& graph) {
  out["pool_bytes"] = graph.pool_bytes;
  out["pool_lower_bound_bytes"] = graph.pool_lower_bound_bytes;
  out["pool_ratio"] = graph.pool_lower_bound_bytes == 0
                          ? 1.0
                          : static_cast<double>(graph.pool_bytes) / static_cast<double>(graph.pool_lower_bound_bytes);
  const CaptureTimings& t = graph.capture;
  out["capture_ms"] = {{"trace", t.trace_ms},
                       {"plan", t.plan_ms},
                       {"prepare", t.prepare_ms},
                       {"capture", t.capture_ms},
                       {"instantiate", t.instantiate_ms},
                       {"capture_plus_instantiate", t.capture_ms + t.instantiate_ms},
                       {"wall", graph.capture_wall_ms}};
  if (!graph.profile.empty()) out["profile"] = graph.profile;
}

// Whether two runs' first losses are the same bits, and their largest difference.
std::pair<bool, double> compare_losses(const std::vector<float>& a, const std::vector<float>& b) {
  bool identical = a.size() == b.size();
  double max_diff = 0;
  for (std::size_t i = 0; identical && i < a.size(); ++i) {
    identical = identical && a[i] == b[i];
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
  }
  return {identical, max_diff};
}

namespace {

// Before measuring (see StepRunOptions::prime): one eager step of the first
// blocks up to the first MoE block, which have every shape of the config
// (blocks repeat), at a fraction of the parameter set-up time. With a
// communicator it also lets NCCL connect its ranks before the timed modes.
void prime(const StepConfig& config, const StepRunOptions& options) {
  if (!options.prime || options.device != Device::kCuda) return;
  StepRunOptions once = options;
  once.steps = 1;
  once.warmup = 1;
  StepConfig first_blocks = config;
  const std::int64_t needed = config.model.experts > 0 ? config.model.moe_every : 1;
  first_blocks.model.layers = std::min(config.model.layers, std::max<std::int64_t>(needed, 1));
  (void)run_mode(first_blocks, StepMode::kEager, once);
}

// A config that threw: "not_run" for an Error of kUnsupported, else "failed".
nlohmann::json failed_config_json(const StepConfig& config, const std::exception& error) {
  const auto* engine_error = dynamic_cast<const Error*>(&error);
  nlohmann::json out = config_header_json(config);
  out["status"] = engine_error && engine_error->code() == ErrorCode::kUnsupported ? "not_run" : "failed";
  out["reason"] = error.what();
  out["systems"] = nlohmann::json::array();
  return out;
}

}  // namespace

nlohmann::json config_json(const StepConfig& config, const ModeResult& eager, const ModeResult& graph) {
  nlohmann::json out = config_header_json(config);
  out["status"] = "ok";
  out["reason"] = nullptr;

  const auto [identical, max_diff] = compare_losses(eager.first_losses, graph.first_losses);
  out["loss_check"] = {{"steps", eager.first_losses.size()},
                       {"stepgraph_eager", eager.first_losses},
                       {"stepgraph_graph", graph.first_losses},
                       {"identical", identical},
                       {"max_abs_diff", max_diff}};

  nlohmann::json graph_json = system_json("stepgraph_graph", config, graph, eager);
  add_graph_fields(graph_json, graph);
  out["systems"] = {system_json("stepgraph_eager", config, eager, eager), graph_json};
  return out;
}

nlohmann::json run_config(const StepConfig& config, const StepRunOptions& options) {
  try {
    prime(config, options);
    const ModeResult eager = run_mode(config, StepMode::kEager, options);
    const ModeResult graph = run_mode(config, StepMode::kGraph, options);
    return config_json(config, eager, graph);
  } catch (const std::exception& error) {
    return failed_config_json(config, error);
  }
}

// ---------------------------------------------------------------- data parallelism

void check_dp_flag(int dp, int world_size) {
  SG_CHECK(dp >= 0, "--dp must be the number of ranks (>= 1), got ", dp);
  SG_CHECK(dp != 0 || world_size == 1, "this process is one of ", world_size,
           " ranks (the launcher's variables say so) but --dp was not given: pass --dp ", world_size,
           " for the data-parallel rows (without --dp step_bench is one process on one GPU)");
  SG_CHECK(dp == 0 || dp == world_size, "--dp ", dp, " needs ", dp, " ranks, one process per GPU (e.g. torchrun ",
           "--no-python --nproc-per-node ", dp, " bin/step_bench --dp ", dp, "), but this run has ", world_size,
           world_size == 1 ? " (no launcher variables: one process); --dp 1 runs the baseline alone" : "");
}

nlohmann::json mode_result_to_json(const ModeResult& r) {
  return {
      {"samples_us", r.samples_us},
      {"pipelined_step_us", r.pipelined_step_us},
      {"first_losses", r.first_losses},
      {"final_loss", r.final_loss},
      {"persistent_bytes", r.persistent_bytes},
      {"persistent_breakdown", r.persistent_breakdown},
      {"pool_peak_by_op", r.pool_peak_by_op},
      {"transient_peak_bytes", r.transient_peak_bytes},
      {"device_used_delta_bytes", r.device_used_delta_bytes ? nlohmann::json(*r.device_used_delta_bytes) : nullptr},
      {"pool_bytes", r.pool_bytes},
      {"pool_lower_bound_bytes", r.pool_lower_bound_bytes},
      {"capture",
       {r.capture.trace_ms, r.capture.plan_ms, r.capture.prepare_ms, r.capture.capture_ms, r.capture.instantiate_ms}},
      {"capture_wall_ms", r.capture_wall_ms},
      {"profile", r.profile},
      {"profile_exposed_comm_us", r.profile_exposed_comm_us},
      {"profile_total_us", r.profile_total_us}};
}

ModeResult mode_result_from_json(const nlohmann::json& j) {
  ModeResult r;
  r.samples_us = j.at("samples_us").get<std::vector<double>>();
  if (!r.samples_us.empty()) r.step_us = summarize(r.samples_us);
  r.pipelined_step_us = j.at("pipelined_step_us");
  r.first_losses = j.at("first_losses").get<std::vector<float>>();
  r.final_loss = j.at("final_loss");
  r.persistent_bytes = j.at("persistent_bytes");
  r.persistent_breakdown = j.at("persistent_breakdown").get<std::map<std::string, std::int64_t>>();
  r.pool_peak_by_op = j.at("pool_peak_by_op").get<std::vector<std::pair<std::string, std::int64_t>>>();
  r.transient_peak_bytes = j.at("transient_peak_bytes");
  if (!j.at("device_used_delta_bytes").is_null()) r.device_used_delta_bytes = j.at("device_used_delta_bytes");
  r.pool_bytes = j.at("pool_bytes");
  r.pool_lower_bound_bytes = j.at("pool_lower_bound_bytes");
  const std::vector<double> capture = j.at("capture").get<std::vector<double>>();
  SG_CHECK_CODE(capture.size() == 5, ErrorCode::kInternal, "a rank sent ", capture.size(), " capture times, not 5");
  r.capture = {capture[0], capture[1], capture[2], capture[3], capture[4]};
  r.capture_wall_ms = j.at("capture_wall_ms");
  r.profile = j.value("profile", std::string());
  r.profile_exposed_comm_us = j.value("profile_exposed_comm_us", 0.0);
  r.profile_total_us = j.value("profile_total_us", 0.0);
  return r;
}

RankedResult combine_ranks(const std::vector<ModeResult>& ranks) {
  SG_CHECK_CODE(!ranks.empty(), ErrorCode::kInternal, "combine_ranks: no ranks");
  RankedResult out;
  out.combined = ranks[0];
  ModeResult& c = out.combined;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const ModeResult& m = ranks[r];
    SG_CHECK_CODE(m.samples_us.size() == c.samples_us.size() && !m.samples_us.empty(), ErrorCode::kInternal, "rank ", r,
                  " timed ", m.samples_us.size(), " steps, rank 0 ", c.samples_us.size());
    for (std::size_t i = 0; i < c.samples_us.size(); ++i) c.samples_us[i] = std::max(c.samples_us[i], m.samples_us[i]);
    c.pipelined_step_us = std::max(c.pipelined_step_us, m.pipelined_step_us);
    c.persistent_bytes = std::max(c.persistent_bytes, m.persistent_bytes);
    c.transient_peak_bytes = std::max(c.transient_peak_bytes, m.transient_peak_bytes);
    if (c.device_used_delta_bytes && m.device_used_delta_bytes) {
      c.device_used_delta_bytes = std::max(*c.device_used_delta_bytes, *m.device_used_delta_bytes);
    }
    out.rank_median_us.push_back(summarize(m.samples_us).median_us);
    if (m.profile_total_us > 0 && (c.profile_total_us <= 0 || m.profile_exposed_comm_us * c.profile_total_us >
                                                                  c.profile_exposed_comm_us * m.profile_total_us)) {
      c.profile_exposed_comm_us = m.profile_exposed_comm_us;  // the rank with the largest exposed share
      c.profile_total_us = m.profile_total_us;
    }
    out.rank_first_loss.push_back(m.first_losses.empty() ? NAN : m.first_losses.front());
  }
  c.step_us = summarize(c.samples_us);
  return out;
}

// A parallel row's profile (--profile, graphed rows): its text and the
// exposed communication's share of the profiled step.
void add_profile_fields(nlohmann::json& out, const ModeResult& r) {
  if (r.profile.empty()) return;
  out["profile"] = r.profile;
  out["profile_exposed_comm_us"] = r.profile_exposed_comm_us;
  out["profile_exposed_comm_fraction"] = r.profile_total_us > 0 ? r.profile_exposed_comm_us / r.profile_total_us : 0.0;
}

// A parallel row's name: stepgraph_<eager|graph>_<kind><world size>.
std::string parallel_system_name(StepMode mode, std::string_view kind, int world_size) {
  return detail::concat(mode == StepMode::kEager ? "stepgraph_eager" : "stepgraph_graph", "_", kind, world_size);
}

bool is_leader(const Communicator* world) { return world == nullptr || world->rank() == 0; }

std::vector<ModeResult> gather_results(Communicator* world, const ModeResult& mine, std::string_view what) {
  std::vector<ModeResult> all;
  for (const std::string& text : gather(world, mode_result_to_json(mine).dump(), detail::concat("results of ", what))) {
    all.push_back(mode_result_from_json(nlohmann::json::parse(text)));
  }
  return all;
}

void log_row_start(std::string_view flag, const Communicator* world, std::string_view what) {
  if (is_leader(world)) std::cerr << flag << ": " << what << " ..." << std::endl;
}

void log_row_done(std::string_view flag, const Communicator* world, std::string_view what, const ModeResult& row) {
  if (!is_leader(world)) return;
  std::cerr << flag << ": " << what << ": median " << row.step_us.median_us / 1000.0 << " ms, first loss "
            << (row.first_losses.empty() ? NAN : row.first_losses.front()) << std::endl;
}

void add_scaling_fields(nlohmann::json& out, const RankedResult& r, const RankedResult* baseline,
                        const std::string& baseline_name) {
  const double median = r.combined.step_us.median_us;
  const double pipelined = r.combined.pipelined_step_us;
  if (baseline != nullptr) {
    const double base = baseline->combined.step_us.median_us;
    const double base_pipelined = baseline->combined.pipelined_step_us;
    out["baseline_system"] = baseline_name;
    out["scaling_efficiency"] = base / median;
    out["pipelined_scaling_efficiency"] = base_pipelined / pipelined;
    out["exposed_comm_us"] = median - base;
    out["exposed_comm_fraction"] = (median - base) / median;
    out["pipelined_exposed_comm_us"] = pipelined - base_pipelined;
    out["pipelined_exposed_comm_fraction"] = (pipelined - base_pipelined) / pipelined;
  } else {
    for (const char* key : {"baseline_system", "scaling_efficiency", "pipelined_scaling_efficiency", "exposed_comm_us",
                            "exposed_comm_fraction", "pipelined_exposed_comm_us", "pipelined_exposed_comm_fraction"}) {
      out[key] = nullptr;
    }
  }
}

nlohmann::json mean_first_loss_check(const RankedResult& alone, const RankedResult& parallel, std::string_view kind) {
  double mean = 0;
  for (const float loss : alone.rank_first_loss) mean += loss;
  mean /= static_cast<double>(std::max<std::size_t>(alone.rank_first_loss.size(), 1));
  const double got = parallel.combined.first_losses.empty() ? NAN : parallel.combined.first_losses.front();
  const double diff = std::fabs(got - mean);
  return {{"baseline_rank_first_losses", alone.rank_first_loss},
          {"baseline_mean_first_loss", mean},
          {detail::concat(kind, "_first_loss"), got},
          {"abs_diff", diff},
          {"agrees", diff <= 1e-4 * std::max(1.0, std::fabs(mean))}};
}

bool ranks_agree(const RankedResult& row) {
  const std::vector<float>& losses = row.rank_first_loss;
  return std::all_of(losses.begin(), losses.end(), [&](float l) { return l == losses.front(); });
}

namespace {

std::string dp_system_name(StepMode mode, int world_size) { return parallel_system_name(mode, "dp", world_size); }

// One row: the common fields of system_json per GPU, the rank spread, and
// with a baseline the scaling against it (Note [Data-parallel rows]).
nlohmann::json dp_system_json(const StepConfig& config, StepMode mode, int world_size,
                              std::optional<DataParallelMode> dp_mode, const RankedResult& r, const RankedResult& eager,
                              const RankedResult* baseline, int baseline_world) {
  const std::string name = dp_system_name(mode, world_size);
  nlohmann::json out = system_json(name, config, r.combined, eager.combined);
  out["world_size"] = world_size;
  out["dp_mode"] = dp_mode ? nlohmann::json(std::string(data_parallel_mode_name(*dp_mode))) : nullptr;
  out["rank_median_us"] = r.rank_median_us;
  out["global_tokens_per_s"] = world_size * out["tokens_per_s"].get<double>();
  add_scaling_fields(out, r, baseline, dp_system_name(mode, baseline_world));
  if (mode == StepMode::kGraph) add_graph_fields(out, r.combined);
  add_profile_fields(out, r.combined);
  return out;
}

}  // namespace

nlohmann::json dp_config_json(const StepConfig& config, const DataParallelResults& results) {
  const int n = results.world_size;
  SG_CHECK_CODE(n >= 1 && (n == 1) == !results.dp_eager.has_value() && (n == 1) == !results.dp_graph.has_value(),
                ErrorCode::kInternal, "dp_config_json: world size ", n, " with",
                results.dp_eager || results.dp_graph ? "" : "out", " data-parallel results");
  nlohmann::json out = config_header_json(config);
  out["status"] = "ok";
  out["reason"] = nullptr;
  out["world_size"] = n;
  out["global_tokens"] = n * config.tokens;
  out["dp_mode"] = n > 1 ? nlohmann::json(std::string(data_parallel_mode_name(results.mode))) : nullptr;

  const RankedResult& top_eager = n > 1 ? *results.dp_eager : results.baseline_eager;
  const RankedResult& top_graph = n > 1 ? *results.dp_graph : results.baseline_graph;
  const auto [identical, max_diff] = compare_losses(top_eager.combined.first_losses, top_graph.combined.first_losses);
  nlohmann::json loss_check = {{"steps", top_eager.combined.first_losses.size()},
                               {"compared", {dp_system_name(StepMode::kEager, n), dp_system_name(StepMode::kGraph, n)}},
                               {"identical", identical},
                               {"max_abs_diff", max_diff}};
  loss_check[dp_system_name(StepMode::kEager, 1)] = results.baseline_eager.combined.first_losses;
  loss_check[dp_system_name(StepMode::kGraph, 1)] = results.baseline_graph.combined.first_losses;
  if (n > 1) {
    loss_check[dp_system_name(StepMode::kEager, n)] = results.dp_eager->combined.first_losses;
    loss_check[dp_system_name(StepMode::kGraph, n)] = results.dp_graph->combined.first_losses;
    // The data-parallel step's first loss is the mean of the ranks' losses at the initial parameters.
    out["dp_loss_check"] = {{"eager", mean_first_loss_check(results.baseline_eager, *results.dp_eager, "dp")},
                            {"graph", mean_first_loss_check(results.baseline_graph, *results.dp_graph, "dp")}};
  }
  out["loss_check"] = loss_check;

  nlohmann::json systems = nlohmann::json::array();
  systems.push_back(dp_system_json(config, StepMode::kEager, 1, std::nullopt, results.baseline_eager,
                                   results.baseline_eager, nullptr, 1));
  systems.push_back(dp_system_json(config, StepMode::kGraph, 1, std::nullopt, results.baseline_graph,
                                   results.baseline_eager, nullptr, 1));
  if (n > 1) {
    systems.push_back(dp_system_json(config, StepMode::kEager, n, results.mode, *results.dp_eager, *results.dp_eager,
                                     &results.baseline_eager, 1));
    systems.push_back(dp_system_json(config, StepMode::kGraph, n, results.mode, *results.dp_graph, *results.dp_eager,
                                     &results.baseline_graph, 1));
  }
  out["systems"] = std::move(systems);
  return out;
}

namespace {

// Runs one mode on this rank and combines it with every rank's.
RankedResult run_everywhere(const StepConfig& config, StepMode mode, const StepRunOptions& options, Communicator* world,
                            std::string_view what) {
  return combine_ranks(gather_results(world, run_mode(config, mode, options), what));
}

}  // namespace

// One process: a config that fails becomes its failed row and the others
// still run. Several ranks: the error propagates and ends the launch (the
// other ranks are in the same collectives).
nlohmann::json run_or_failed_row(const StepConfig& config, int world_size,
                                 const std::function<nlohmann::json()>& body) {
  if (world_size > 1) return body();
  try {
    return body();
  } catch (const std::exception& error) {
    return failed_config_json(config, error);
  }
}

// The check that a parallel row's eager and graphed first losses are equal.
nlohmann::json parallel_loss_check(const RankedResult& eager, const RankedResult& graph, const std::string& eager_name,
                                   const std::string& graph_name) {
  const auto [identical, max_diff] = compare_losses(eager.combined.first_losses, graph.combined.first_losses);
  return {{"steps", eager.combined.first_losses.size()},
          {"compared", {eager_name, graph_name}},
          {"identical", identical},
          {"max_abs_diff", max_diff}};
}

namespace {

// A row over `world_size` ranks: its rank medians, and the throughput
// fields per GPU.
void add_rank_fields(nlohmann::json& out, int world_size, const RankedResult& r) {
  out["world_size"] = world_size;
  out["rank_median_us"] = r.rank_median_us;
  out["tflops"] = out["tflops"].get<double>() / world_size;
  out["mfu"] = out["mfu"].get<double>() / world_size;
}

}  // namespace

nlohmann::json run_dp_config(const StepConfig& config, const StepRunOptions& options, Communicator* world,
                             DataParallelMode mode) {
  const int n = world != nullptr ? world->world_size() : 1;
  const int rank = world != nullptr ? world->rank() : 0;
  auto body = [&] {
    StepRunOptions alone = options;
    alone.dp_layout = true;
    alone.dp_mode = mode;
    alone.data_parallel = nullptr;
    alone.timed_with = n > 1 ? world : nullptr;
    alone.data_seed = options.data_seed + static_cast<std::uint32_t>(rank);
    StepRunOptions together = alone;
    together.data_parallel = n > 1 ? world : nullptr;
    prime(config, together);
    meet(alone.timed_with, "primed " + config.name);
    DataParallelResults results;
    results.world_size = n;
    results.mode = mode;
    results.baseline_eager = run_everywhere(config, StepMode::kEager, alone, world, config.name + " dp1 eager");
    results.baseline_graph = run_everywhere(config, StepMode::kGraph, alone, world, config.name + " dp1 graph");
    if (n > 1) {
      results.dp_eager = run_everywhere(config, StepMode::kEager, together, world, config.name + " dpN eager");
      results.dp_graph = run_everywhere(config, StepMode::kGraph, together, world, config.name + " dpN graph");
    }
    return dp_config_json(config, results);
  };
  return run_or_failed_row(config, n, body);
}

// ---------------------------------------------------------------- tensor parallelism

namespace {

std::string tp_system_name(StepMode mode, int world_size) { return parallel_system_name(mode, "tp", world_size); }

// One row (Note [Tensor-parallel rows]): system_json's fields per GPU and,
// against a baseline, the strong scaling.
nlohmann::json tp_system_json(const StepConfig& config, StepMode mode, int world_size, const RankedResult& r,
                              const RankedResult& eager, const RankedResult* baseline) {
  nlohmann::json out = system_json(tp_system_name(mode, world_size), config, r.combined, eager.combined);
  add_rank_fields(out, world_size, r);
  if (baseline != nullptr) {
    const double speedup = baseline->combined.step_us.median_us / r.combined.step_us.median_us;
    out["baseline_system"] = tp_system_name(mode, 1);
    out["speedup_vs_tp1"] = speedup;
    out["strong_scaling_efficiency"] = speedup / world_size;
  } else {
    out["baseline_system"] = nullptr;
    out["speedup_vs_tp1"] = nullptr;
    out["strong_scaling_efficiency"] = nullptr;
  }
  if (mode == StepMode::kGraph) add_graph_fields(out, r.combined);
  add_profile_fields(out, r.combined);
  return out;
}

}  // namespace

nlohmann::json run_tp_config(const StepConfig& config, const StepRunOptions& options, Communicator* world) {
  const int n = world != nullptr ? world->world_size() : 1;
  auto body = [&] {
    StepRunOptions alone = options;
    alone.dp_layout = true;
    alone.data_parallel = nullptr;
    alone.tensor_parallel = nullptr;
    alone.timed_with = n > 1 ? world : nullptr;
    StepRunOptions together = alone;
    together.tensor_parallel = n > 1 ? world : nullptr;
    prime(config, alone);
    meet(alone.timed_with, "primed " + config.name);
    const RankedResult base_eager = run_everywhere(config, StepMode::kEager, alone, world, config.name + " tp1 eager");
    const RankedResult base_graph = run_everywhere(config, StepMode::kGraph, alone, world, config.name + " tp1 graph");
    nlohmann::json out = config_header_json(config);
    out["status"] = "ok";
    out["reason"] = nullptr;
    out["world_size"] = n;
    out["tp"] = n;
    out["overlap"] = options.overlap.to_string();
    nlohmann::json systems = nlohmann::json::array();
    systems.push_back(tp_system_json(config, StepMode::kEager, 1, base_eager, base_eager, nullptr));
    systems.push_back(tp_system_json(config, StepMode::kGraph, 1, base_graph, base_eager, nullptr));
    if (n > 1) {
      const RankedResult eager = run_everywhere(config, StepMode::kEager, together, world, config.name + " tpN eager");
      const RankedResult graph = run_everywhere(config, StepMode::kGraph, together, world, config.name + " tpN graph");
      out["loss_check"] =
          parallel_loss_check(eager, graph, tp_system_name(StepMode::kEager, n), tp_system_name(StepMode::kGraph, n));
      systems.push_back(tp_system_json(config, StepMode::kEager, n, eager, eager, &base_eager));
      systems.push_back(tp_system_json(config, StepMode::kGraph, n, graph, eager, &base_graph));
    }
    out["systems"] = std::move(systems);
    return out;
  };
  return run_or_failed_row(config, n, body);
}

// ---------------------------------------------------------------- context parallelism

namespace {

std::string cp_system_name(StepMode mode, int world_size) { return parallel_system_name(mode, "cp", world_size); }

// One row (Note [Context-parallel rows]): system_json's fields of the row's
// own config, per GPU, and against a baseline row the efficiency (per-GPU
// TFLOP/s over the baseline's) and the step time ratio.
nlohmann::json cp_system_json(const StepConfig& row_config, StepMode mode, int world_size, const RankedResult& r,
                              const RankedResult& eager, const nlohmann::json* baseline) {
  nlohmann::json out = system_json(cp_system_name(mode, world_size), row_config, r.combined, eager.combined);
  add_rank_fields(out, world_size, r);
  out["cp"] = world_size;
  out["seq_len"] = row_config.seq_len;
  out["sequences"] = row_config.sequences;
  out["tokens"] = row_config.tokens;
  out["tokens_per_s"] = out["tokens_per_s"].get<double>() / world_size;  // per GPU
  if (baseline != nullptr) {
    out["baseline_system"] = (*baseline)["system"];
    out["efficiency"] = out["tflops"].get<double>() / (*baseline)["tflops"].get<double>();
    out["step_time_ratio"] = (*baseline)["step_us"]["median_us"].get<double>() / r.combined.step_us.median_us;
  } else {
    out["baseline_system"] = nullptr;
    out["efficiency"] = nullptr;
    out["step_time_ratio"] = nullptr;
  }
  if (mode == StepMode::kGraph) add_graph_fields(out, r.combined);
  add_profile_fields(out, r.combined);
  return out;
}

}  // namespace

StepConfig context_parallel_config(const StepConfig& config, int cp) {
  SG_CHECK(cp >= 1, "--cp must be the number of ranks (>= 1), got ", cp);
  StepConfig wide = config;
  wide.seq_len *= cp;
  wide.tokens *= cp;
  return wide;
}

nlohmann::json run_cp_config(const StepConfig& config, const StepRunOptions& options, Communicator* world) {
  const int n = world != nullptr ? world->world_size() : 1;
  auto body = [&] {
    StepRunOptions alone = options;
    alone.dp_layout = true;
    alone.data_parallel = nullptr;
    alone.tensor_parallel = nullptr;
    alone.context_parallel = nullptr;
    alone.timed_with = n > 1 ? world : nullptr;
    StepRunOptions together = alone;
    together.context_parallel = n > 1 ? world : nullptr;
    const StepConfig wide = context_parallel_config(config, n);
    prime(config, alone);
    if (n > 1) prime(wide, together);  // also connects the ranks before the timed modes
    meet(alone.timed_with, "primed " + config.name);
    const RankedResult base_eager = run_everywhere(config, StepMode::kEager, alone, world, config.name + " cp1 eager");
    const RankedResult base_graph = run_everywhere(config, StepMode::kGraph, alone, world, config.name + " cp1 graph");
    nlohmann::json out = config_header_json(config);
    out["status"] = "ok";
    out["reason"] = nullptr;
    out["world_size"] = n;
    out["cp"] = n;
    out["cp_seq_len"] = wide.seq_len;
    nlohmann::json systems = nlohmann::json::array();
    systems.push_back(cp_system_json(config, StepMode::kEager, 1, base_eager, base_eager, nullptr));
    systems.push_back(cp_system_json(config, StepMode::kGraph, 1, base_graph, base_eager, nullptr));
    if (n > 1) {
      const RankedResult eager = run_everywhere(wide, StepMode::kEager, together, world, config.name + " cpN eager");
      const RankedResult graph = run_everywhere(wide, StepMode::kGraph, together, world, config.name + " cpN graph");
      out["loss_check"] =
          parallel_loss_check(eager, graph, cp_system_name(StepMode::kEager, n), cp_system_name(StepMode::kGraph, n));
      out["loss_check"][cp_system_name(StepMode::kEager, n)] = eager.combined.first_losses;
      out["loss_check"][cp_system_name(StepMode::kGraph, n)] = graph.combined.first_losses;
      const nlohmann::json eager_baseline = systems[0];
      const nlohmann::json graph_baseline = systems[1];
      systems.push_back(cp_system_json(wide, StepMode::kEager, n, eager, eager, &eager_baseline));
      systems.push_back(cp_system_json(wide, StepMode::kGraph, n, graph, eager, &graph_baseline));
    }
    out["systems"] = std::move(systems);
    return out;
  };
  return run_or_failed_row(config, n, body);
}

}  // namespace stepgraph::bench
