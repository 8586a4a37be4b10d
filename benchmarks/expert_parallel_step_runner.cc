#include "benchmarks/expert_parallel_step_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "engine/error.h"
#include "engine/peer_window.h"

namespace stepgraph::bench {
namespace {

std::string ep_system_name(StepMode mode, int world_size) { return parallel_system_name(mode, "ep", world_size); }

constexpr std::string_view kFlag = "step_bench --ep";

// Runs one mode on this rank and combines it with every rank's.
RankedResult run_row(const StepConfig& config, StepMode mode, const StepRunOptions& options, Communicator* world,
                     const std::string& what) {
  log_row_start(kFlag, world, what);
  RankedResult out = combine_ranks(gather_results(world, run_mode(config, mode, options), what));
  log_row_done(kFlag, world, what, out.combined);
  return out;
}

// Before measuring (StepRunOptions::prime): one untimed eager step of the
// config's first MoE block alone and, over several ranks, expert parallel:
// on a GPU kernel modules load, cuBLASLt times its algorithms and NCCL
// connects the ranks before any mode's memory delta or capture is measured
// (on the host it is one short step more, asked of no device in particular).
void prime(const StepConfig& config, const StepRunOptions& alone, const StepRunOptions& together) {
  if (!alone.prime) return;
  StepConfig first = config;
  first.model.layers = std::min(config.model.layers, std::max<std::int64_t>(config.model.moe_every, 1));
  for (const StepRunOptions* options : {&alone, &together}) {
    if (options == &together && together.expert_parallel == nullptr) break;
    StepRunOptions once = *options;
    once.steps = 1;
    once.warmup = 1;
    once.profile = false;
    once.cuda_profiler_range = false;
    (void)run_mode(first, StepMode::kEager, once);
  }
}

// One row (Note [Expert-parallel rows]): system_json's fields per GPU, the
// rank spread, the experts a rank holds, and against the ep1 row the scaling.
nlohmann::json ep_row_json(const StepConfig& config, StepMode mode, int world_size, const RankedResult& r,
                           const RankedResult& eager, const RankedResult* baseline) {
  nlohmann::json out = system_json(ep_system_name(mode, world_size), config, r.combined, eager.combined);
  out["world_size"] = world_size;
  out["ep"] = world_size;
  out["experts_per_rank"] = config.model.experts / world_size;
  out["rank_median_us"] = r.rank_median_us;
  out["rank_first_loss"] = r.rank_first_loss;
  out["global_tokens_per_s"] = world_size * out["tokens_per_s"].get<double>();
  add_scaling_fields(out, r, baseline, ep_system_name(mode, 1));
  if (mode == StepMode::kGraph) add_graph_fields(out, r.combined);
  add_profile_fields(out, r.combined);
  return out;
}

}  // namespace

void check_expert_parallel_config(const StepConfig& config, int ranks) {
  SG_CHECK(ranks >= 1, "--ep must be the number of ranks (>= 1), got ", ranks);
  SG_CHECK(config.model.experts > 0, "--ep ", ranks, ": config ", config.name,
           " has no experts (a dense GPT; expert parallelism spreads MoE blocks' experts over the ranks); leave it "
           "out of --configs (moe runs; on --device host, moe_tiny)");
  SG_CHECK(config.model.experts % ranks == 0, "--ep ", ranks, ": config ", config.name, "'s ", config.model.experts,
           " experts do not divide by --ep ", ranks,
           " (each rank holds experts / --ep whole experts); give --ep a "
           "divisor of ",
           config.model.experts);
}

nlohmann::json ep_config_json(const StepConfig& config, const ExpertParallelResults& results) {
  const int n = results.world_size;
  SG_CHECK_CODE(
      n >= 1 && (n == 1) == !results.parallel_eager.has_value() && (n == 1) == !results.parallel_graph.has_value(),
      ErrorCode::kInternal, "ep_config_json: world size ", n, " with",
      results.parallel_eager || results.parallel_graph ? "" : "out", " expert-parallel results");
  nlohmann::json out = config_header_json(config);
  out["status"] = "ok";
  out["reason"] = nullptr;
  out["world_size"] = n;
  out["ep"] = n;
  out["experts_per_rank"] = config.model.experts / n;
  out["global_tokens"] = n * config.tokens;

  const RankedResult& top_eager = n > 1 ? *results.parallel_eager : results.alone_eager;
  const RankedResult& top_graph = n > 1 ? *results.parallel_graph : results.alone_graph;
  nlohmann::json loss_check = parallel_loss_check(top_eager, top_graph, ep_system_name(StepMode::kEager, n),
                                                  ep_system_name(StepMode::kGraph, n));
  loss_check[ep_system_name(StepMode::kEager, 1)] = results.alone_eager.combined.first_losses;
  loss_check[ep_system_name(StepMode::kGraph, 1)] = results.alone_graph.combined.first_losses;
  if (n > 1) {
    loss_check[ep_system_name(StepMode::kEager, n)] = results.parallel_eager->combined.first_losses;
    loss_check[ep_system_name(StepMode::kGraph, n)] = results.parallel_graph->combined.first_losses;
    // The group's loss is on every rank (the ep1 ranks train alone: nothing to agree on).
    loss_check["ranks_agree"] = ranks_agree(*results.parallel_eager) && ranks_agree(*results.parallel_graph);
    // The expert-parallel step's first loss is the mean of the ranks' losses on their own batches at the initial
    // parameters; each rank alone computed its own.
    out["ep_loss_check"] = {{"eager", mean_first_loss_check(results.alone_eager, *results.parallel_eager, "ep")},
                            {"graph", mean_first_loss_check(results.alone_graph, *results.parallel_graph, "ep")}};
  } else {
    loss_check["ranks_agree"] = true;
  }
  out["loss_check"] = loss_check;

  nlohmann::json systems = nlohmann::json::array();
  systems.push_back(ep_row_json(config, StepMode::kEager, 1, results.alone_eager, results.alone_eager, nullptr));
  systems.push_back(ep_row_json(config, StepMode::kGraph, 1, results.alone_graph, results.alone_eager, nullptr));
  if (n > 1) {
    systems.push_back(ep_row_json(config, StepMode::kEager, n, *results.parallel_eager, *results.parallel_eager,
                                  &results.alone_eager));
    systems.push_back(ep_row_json(config, StepMode::kGraph, n, *results.parallel_graph, *results.parallel_eager,
                                  &results.alone_graph));
  }
  out["systems"] = std::move(systems);
  return out;
}

nlohmann::json run_ep_config(const StepConfig& config, const StepRunOptions& options, Communicator* world) {
  const int n = world != nullptr ? world->world_size() : 1;
  const int rank = world != nullptr ? world->rank() : 0;
  auto body = [&] {
    check_expert_parallel_config(config, n);
    StepRunOptions alone = options;
    alone.dp_layout = true;
    alone.data_parallel = nullptr;
    alone.tensor_parallel = nullptr;
    alone.context_parallel = nullptr;
    alone.expert_parallel = nullptr;
    alone.timed_with = n > 1 ? world : nullptr;
    alone.data_seed = options.data_seed + static_cast<std::uint32_t>(rank);  // each rank its own batch
    StepRunOptions together = alone;
    together.expert_parallel = n > 1 ? world : nullptr;
    prime(config, alone, together);
    meet(alone.timed_with, "primed " + config.name);
    ExpertParallelResults results;
    results.world_size = n;
    results.alone_eager = run_row(config, StepMode::kEager, alone, world, config.name + " ep1 eager");
    results.alone_graph = run_row(config, StepMode::kGraph, alone, world, config.name + " ep1 graph");
    if (n > 1) {
      const std::string ep = detail::concat(" ep", n);
      results.parallel_eager = run_row(config, StepMode::kEager, together, world, config.name + ep + " eager");
      results.parallel_graph = run_row(config, StepMode::kGraph, together, world, config.name + ep + " graph");
    }
    return ep_config_json(config, results);
  };
  return run_or_failed_row(config, n, body);
}

nlohmann::json expert_parallel_header(int world_size, const Communicator* world) {
  const int n = world_size;
  const bool several = world != nullptr && n > 1;
  return {
      {"world_size", n},
      {"communicator", world != nullptr ? world->describe() : "none (world size 1)"},
      // What the exchange's captured transfers ride on (Note [The pool as symmetric memory]); eager steps use NCCL.
      {"exchange_transport",
       several ? nlohmann::json(std::string(peer_transport_name(world->peer_transport()))) : nullptr},
      {"exchange_transport_reason", several ? nlohmann::json(world->peer_transport_reason()) : nullptr},
      {"weak_scaling",
       "every rank trains the config's `tokens` per step in both rows (global batch N x tokens); the epN rows hold "
       "experts / N experts of every MoE block a rank and exchange the routed rows"},
      {"baseline",
       "stepgraph_<mode>_ep1: every rank trains the whole config (every expert) alone on its own GPU and its own "
       "batch (no communicator), all ranks at the same time, on the same Context layout as the expert-parallel step"},
      {"timing", kParallelTimingText},
      {"formulas",
       {{"tokens_per_s", "per GPU: tokens / median step time"},
        {"global_tokens_per_s", "world_size x tokens_per_s"},
        {"scaling_efficiency", "median step time(ep1) / median step time(epN), same mode"},
        {"exposed_comm_us",
         "median step time(epN) - median step time(ep1), same mode (net of the expert updates "
         "EP saves: may be negative)"},
        {"exposed_comm_fraction", "exposed_comm_us / median step time(epN) = 1 - scaling_efficiency"}}},
      {"goal", "graphed epN scaling_efficiency >= 0.9"},
      {"rows", "Note [Expert-parallel rows] in benchmarks/expert_parallel_step_runner.h"},
      {"note", n == 1 ? "world size 1: the ep1 rows alone; no experts are spread" : ""},
  };
}

std::string ep_config_line(const nlohmann::json& c) {
  const std::string name = c["name"];
  char buffer[512];
  if (c["status"] != "ok") {
    std::snprintf(buffer, sizeof(buffer), "%-8s %s: %s", name.c_str(), c["status"].get<std::string>().c_str(),
                  c["reason"].get<std::string>().c_str());
    return buffer;
  }
  std::string line;
  std::snprintf(buffer, sizeof(buffer), "%-8s", name.c_str());
  line += buffer;
  for (const nlohmann::json& s : c["systems"]) {
    const auto ms = [&](const char* key) { return s["step_us"][key].get<double>() / 1000.0; };
    std::snprintf(buffer, sizeof(buffer), "  %s %.3f ms [%.3f-%.3f] %.0f tok/s/GPU",
                  s["system"].get<std::string>().c_str(), ms("median_us"), ms("min_us"), ms("max_us"),
                  s["tokens_per_s"].get<double>());
    line += buffer;
    if (!s["scaling_efficiency"].is_null()) {
      std::snprintf(buffer, sizeof(buffer), " (efficiency %.3f, exposed comm %.3f ms = %.1f%%)",
                    s["scaling_efficiency"].get<double>(), s["exposed_comm_us"].get<double>() / 1000.0,
                    100.0 * s["exposed_comm_fraction"].get<double>());
      line += buffer;
    }
    if (s.contains("profile_exposed_comm_fraction")) {
      std::snprintf(buffer, sizeof(buffer), " (profiled exposed comm %.3f ms = %.1f%%)",
                    s["profile_exposed_comm_us"].get<double>() / 1000.0,
                    100.0 * s["profile_exposed_comm_fraction"].get<double>());
      line += buffer;
    }
  }
  const nlohmann::json& check = c["loss_check"];
  line += detail::concat("  first ", check["steps"].get<int>(), " losses ", check["compared"][0].get<std::string>(),
                         " vs ", check["compared"][1].get<std::string>(), ": ",
                         check["identical"].get<bool>() ? "identical" : "DIFFER");
  if (c.contains("ep_loss_check")) {
    for (const char* mode : {"eager", "graph"}) {
      const nlohmann::json& d = c["ep_loss_check"][mode];
      line += detail::concat("; ", mode,
                             " first loss vs the ranks' mean alone: ", d["agrees"].get<bool>() ? "agrees" : "DIFFERS",
                             " (", d["abs_diff"].get<double>(), ")");
    }
  }
  return line;
}

bool ep_losses_disagree(const nlohmann::json& c) {
  if (!c.contains("loss_check")) return false;
  const nlohmann::json& check = c["loss_check"];
  if (!check["identical"].get<bool>() || !check["ranks_agree"].get<bool>()) return true;
  if (!c.contains("ep_loss_check")) return false;
  return !c["ep_loss_check"]["eager"]["agrees"].get<bool>() || !c["ep_loss_check"]["graph"]["agrees"].get<bool>();
}

}  // namespace stepgraph::bench
