// step_bench --ep: the training step of a config with MoE blocks, its experts
// spread over the ranks of a launch (ResidualStack over an expert-parallel
// communicator, TrainStep's gradient group the same), eager and graphed,
// against every rank training the whole config alone on the same tokens.
//
// Note [Expert-parallel rows]
// step_bench --ep N runs each config with experts on the N ranks of a launch
// (one process per GPU), every mode:
//   stepgraph_<mode>_ep1  the baseline: every rank trains the whole config
//                         (all E experts of every MoE block) alone on its
//                         GPU, its own batch (data_seed + rank), with no
//                         communicator, all ranks at the same time;
//   stepgraph_<mode>_epN  the same config expert-parallel (Note
//                         [Expert-parallel ResidualStack]): rank r holds
//                         E / N experts of every MoE block, trains the same
//                         batch as in its ep1 row, and the exchange
//                         (ops/moe_exchange_ops.h) sends every routed row to
//                         its expert's rank and back; the replicated
//                         parameters' gradients are summed over the ranks on
//                         the communication stream, the loss is the mean.
// Weak scaling: every GPU trains the config's `tokens` in both rows (the
// global batch at N is N x tokens), and on average its experts see as many
// rows in both (N times the tokens over 1/N of the experts). Both rows use
// the data-parallel Context layout (2 side streams, collectives on stream 2)
// and the same parameters. Timing as for the data-parallel rows (Note
// [Data-parallel rows] in step_runner.h): the ranks meet before each sample,
// a sample is the slowest rank's. Per mode:
//   scaling_efficiency    = median(ep1) / median(epN) (tokens/s per GPU, epN over ep1)
//   exposed_comm_us       = median(epN) - median(ep1)
//   exposed_comm_fraction = exposed_comm_us / median(epN) = 1 - scaling_efficiency
// Exposed communication so measured holds the exchange (counts, dispatch,
// combine, forward and backward), the replicated gradients' all-reduce not
// hidden by the backward, the skew of the routing (a rank whose experts
// receive more rows waits for no one but is waited for), and the grouped
// products over the receive buffer's bound; it is net of what EP saves (an
// epN rank updates 1/N of the experts' weights), so it can be negative.
// Memory: an epN rank holds 1/N of the experts' parameters, gradients and
// moments but receive buffers of N x tokens x topk rows (the bound no
// routing exceeds). Losses: the eager and graphed epN first losses must be
// identical, every rank's epN loss the same (the mean over the group), and
// the epN first loss the mean of the ranks' ep1 first losses (the same
// experts and tokens; within 1e-4 relative: the sums' order differs).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "benchmarks/step_configs.h"
#include "benchmarks/step_runner.h"
#include "engine/communicator.h"

namespace stepgraph::bench {

// Error(kInvalidArgument) naming --ep and the config where `config` cannot
// run at --ep `ranks`: no experts (a dense config), or experts not a
// multiple of the ranks.
void check_expert_parallel_config(const StepConfig& config, int ranks);

struct ExpertParallelResults {
  int world_size = 1;
  RankedResult alone_eager, alone_graph;                     // ep1
  std::optional<RankedResult> parallel_eager, parallel_graph;  // epN, world_size > 1 only
};

// The config's JSON from measured results (also for tests).
nlohmann::json ep_config_json(const StepConfig& config, const ExpertParallelResults& results);

// Runs the config's ep1 rows and, when `world` has N > 1 ranks, its epN rows
// over `world` (null: a world of one) and returns the config's JSON, the
// same on every rank. Progress lines go to stderr from rank 0. As
// run_dp_config: at N > 1 an exception propagates.
nlohmann::json run_ep_config(const StepConfig& config, const StepRunOptions& options, Communicator* world);

// The "expert_parallel" header of step_bench's JSON: the layout, the
// exchange's transport (read from `world`), formulas and the goal.
nlohmann::json expert_parallel_header(int world_size, const Communicator* world);

// One config's summary line (no newline).
std::string ep_config_line(const nlohmann::json& config);

// Whether the config's losses disagree: eager against graph at epN, the
// ranks' epN losses, or the epN first loss against the ranks' mean alone.
bool ep_losses_disagree(const nlohmann::json& config);

}  // namespace stepgraph::bench
