// step_bench --pp: the GPT's training step in pipeline stages across the
// ranks of a launch (LanguageModelStages + PipelineTrainStep: the schedule's
// passes, then AdamW), eager and graphed, against one GPU training the whole
// model on the same microbatches; the measured bubble against the
// schedule's.
//
// Note [Pipeline-parallel rows]
// step_bench --pp P [--virtual-stages V] [--microbatches M] runs each config
// on the P ranks of a launch (one process per GPU), every mode:
//   stepgraph_<mode>_pp1  the baseline: every rank trains the whole GPT alone
//                         on its GPU over the same M microbatches, all ranks
//                         at the same time (LanguageModelStages over a
//                         pipeline communicator of one rank: one stage, 1F1B,
//                         no transfers);
//   stepgraph_<mode>_ppP  the pipeline: rank s holds stage s (its L / (P V)
//                         blocks a chunk, the embedding on stage 0, the final
//                         norm and head on stage P - 1; Note [The GPT in
//                         pipeline stages]), 1F1B at V = 1, Megatron's
//                         interleaved 1F1B at V > 1.
// The model is each config's GPT (hidden, heads, layers, vocab, dtype) as a
// LanguageModelConfig of context seq_len; the global batch is M microbatches
// of one sequence of seq_len tokens each (the config's own `sequences` are
// not used), so every row trains M x seq_len tokens a step. Tokens and
// labels are uniform from data_seed, the same global batch on every rank,
// written as the trainer writes them (load_microbatches): stage 0 the
// tokens, the last stage the labels. Both rows start from the same
// parameters, so the pipeline's first loss is the baseline's (pipelining
// changes no sum's order: bit for bit on the host).
//
// Timing as for the data-parallel rows (Note [Data-parallel rows]): the
// ranks meet before each timed sample, a sample is the largest over the
// ranks of their step + synchronize; pipelined_step_us: `steps` steps back
// to back and one synchronize, the largest over the ranks, / steps. Both
// rows use the trainer's stream layout (2 side streams, the transfers and
// the loss broadcast on stream 2). Derived, per mode:
//   measured_bubble_fraction    = 1 - T(pp1) / (P T(ppP)), medians: the share
//                                 of the pipeline's GPU time not doing the
//                                 one GPU's work. It holds the schedule's
//                                 bubble and all else the pipeline adds: the
//                                 transfers not hidden, the loss broadcast,
//                                 and the stages' imbalance (the embedding
//                                 on the first, the head on the last).
//   theoretical_bubble_fraction = (P - 1) / (V M + P - 1) (equal stages, free
//                                 transfers), and bubble_ratio = measured /
//                                 theoretical;
//   graph_speedup_vs_eager      = T(eager) / T(graph) of the same row (the
//                                 issue's goal: >= 1.2 at ppP).
// Graphed rows report every rank's pool against its lower bound (each rank
// plans its own stage's schedule: CapturedStep::plan()), capture time and
// device memory delta. The loss is on every rank; the eager and graphed
// ppP rows' first losses must be identical, and the ppP first loss must be
// the pp1 one (the same global batch and parameters).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "benchmarks/step_configs.h"
#include "benchmarks/step_runner.h"
#include "engine/communicator.h"

namespace stepgraph::bench {

struct PipelineRunOptions {
  int virtual_stages = 1;         // model chunks a rank (V); > 1 needs P >= 2 and M a multiple of P
  std::int64_t microbatches = 8;  // M, one sequence of seq_len tokens each
};

// "1F1B" at V = 1, "interleaved 1F1B" otherwise.
std::string pipeline_schedule_name(int virtual_stages);

// (P - 1) / (V M + P - 1): the idle share of 1F1B (interleaved: V chunks a
// rank) over P equal stages with free transfers.
double theoretical_bubble_fraction(int stages, int virtual_stages, std::int64_t microbatches);

// The config whose step the pipeline rows train: M sequences of seq_len
// (tokens M x seq_len), the model as the config's.
StepConfig pipeline_step_config(const StepConfig& config, std::int64_t microbatches);

// Error(kInvalidArgument) naming the flags and the config where `config`
// cannot run at --pp `stages`: not a dense GPT, layers not a multiple of
// P x V, M not a multiple of P where V > 1.
void check_pipeline_config(const StepConfig& config, int stages, const PipelineRunOptions& pipeline);

// One mode of one row on this rank: its stage of `pipeline` (a communicator
// of one rank: the whole model), timed with the ranks of options.timed_with.
ModeResult run_pipeline_mode(const StepConfig& config, StepMode mode, const StepRunOptions& options,
                             Communicator& pipeline, const PipelineRunOptions& pipeline_options);

// One row's results: every rank's, in rank order, and combined.
struct PipelineRowResult {
  std::vector<ModeResult> ranks;
  RankedResult combined;
};

struct PipelineResults {
  int world_size = 1;
  PipelineRunOptions pipeline;
  PipelineRowResult alone_eager, alone_graph;                       // pp1
  std::optional<PipelineRowResult> pipeline_eager, pipeline_graph;  // ppP, world_size > 1 only
};

// The config's JSON from measured results (also for tests).
nlohmann::json pipeline_config_json(const StepConfig& config, const PipelineResults& results);

// Runs the config's pp1 rows and, when `world` has P > 1 ranks, its ppP rows
// over `world` (null: a world of one) and returns the config's JSON, the
// same on every rank. `options.device` picks the one-rank communicator of
// the pp1 rows (host: a thread world of one; cuda: NCCL of one rank on the
// current GPU). Progress lines go to stderr from rank 0. As run_dp_config:
// at P > 1 an exception propagates.
nlohmann::json run_pipeline_config(const StepConfig& config, const StepRunOptions& options, Communicator* world,
                                   const PipelineRunOptions& pipeline);

// The "pipeline_parallel" header of step_bench's JSON.
nlohmann::json pipeline_parallel_header(int world_size, const PipelineRunOptions& pipeline, const Communicator* world);

// One config's summary line (no newline).
std::string pipeline_config_line(const nlohmann::json& config);

// Whether the config's losses disagree: eager against graph at ppP, or the
// pipeline's first loss against the baseline's.
bool pipeline_losses_disagree(const nlohmann::json& config);

}  // namespace stepgraph::bench
