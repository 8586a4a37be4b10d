// Runs one StepConfig's whole training step (TrainStep: forward, softmax
// cross-entropy, backward, AdamW) eager or graphed and measures it; builds
// the per-config JSON that step_bench writes (schema: docs/step_performance.md,
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
//
// Note [Data-parallel rows]
// step_bench --dp N (run_dp_config) runs each config on the N ranks of a
// launch (one process per GPU) and reports, for each mode (eager, graph):
//   stepgraph_<mode>_dp1  the baseline: every rank trains the config alone on
//                         its own GPU, with no communicator (the step makes no
//                         collective), all ranks at the same time;
//   stepgraph_<mode>_dpN  the same step data-parallel (TrainStep with the
//                         world's communicator): each parameter group's
//                         gradients are all-reduced (--dp-mode zero1:
//                         reduce-scattered, the updated weights all-gathered)
//                         on the communication stream while the backward goes
//                         on; the loss is the global mean.
// Weak scaling: every rank trains the config's `tokens` per step in both, so
// the global batch at N is N x tokens. Both use one Context layout (2 side
// streams, collectives on stream 2, as the trainer's), the same parameters,
// and rank r's batch from data_seed + r: the dpN step differs from the dp1
// step by its collectives (and the loss scale 1/N) alone.
//
// Timing: before every timed sample the ranks meet (a barrier through the
// communicator's exchange), then each times its own step plus synchronize
// (Note [How a step is timed]); a sample's time is the largest over the
// ranks (a global step is done when its last rank is); step_us summarizes
// those. pipelined_step_us: after a barrier, `steps` steps back to back and
// one synchronize on every rank; the largest over the ranks, / steps.
// Per GPU (every GPU trains `tokens` per step):
//   tokens_per_s          = tokens / median step time; global_tokens_per_s = N x that
//   scaling_efficiency    = tokens_per_s(dpN) / tokens_per_s(dp1), same mode = median(dp1) / median(dpN)
//   exposed_comm_us       = median(dpN) - median(dp1)
//   exposed_comm_fraction = exposed_comm_us / median(dpN) = 1 - scaling_efficiency
// (pipelined_ variants: the same from pipelined_step_us). Exposed
// communication is thus measured, not derived from bandwidth: the time the
// step with its collectives takes beyond the same step without them, on the
// same GPUs at the same time. It holds the collectives the backward did not
// hide, their kernels' slowdown of the compute they overlap (SMs and memory
// shared), and waiting for the slowest rank. At N = 1 only the dp1 rows
// exist: the baseline of a later run at N, no scaling measured.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/step_configs.h"
#include "engine/algorithm_choice.h"
#include "engine/communicator.h"
#include "engine/tensor.h"
#include "graphs/captured_step.h"
#include "layers/comm_gemm_overlap.h"
#include "train/train_step.h"

namespace stepgraph::bench {

struct StepRunOptions {
  Device device = Device::kCuda;
  int steps = 50;            // timed samples (>= 1)
  int warmup = 10;           // untimed steps first (>= 1)
  int loss_check_steps = 5;  // the first steps (within warm-up) whose loss is kept
  std::uint32_t data_seed = 1;
  float lr = 1e-4f;
  float weight_decay = 0.01f;
  // Skip non-finite steps on the device (Note [Non-finite steps] in
  // optim/adamw.h): the updates wait for the backward, inside an IF node.
  bool skip_nonfinite = false;
  // Dense blocks recompute GeLU in the backward (Note [Recomputed activation]).
  bool recompute_activation = false;
  // Gradients live from their backward to their group's update only (Note
  // [Step-scoped gradients] in layers/parameter.h), not persistent.
  bool step_scoped_gradients = false;
  // How cuBLASLt's algorithms are picked (Note [Deterministic algorithm choice]).
  AlgorithmChoice gemm_algorithms = AlgorithmChoice::kHeuristic;
  // Dropout on the stack's input and every attention and MLP output.
  float dropout = 0.0f;
  // Before measuring, one untimed eager step of the config's first blocks
  // (every shape it has) in a throwaway Context (cuda only): kernel modules
  // load lazily and cuBLASLt's algorithms are timed on first use, so neither
  // mode's memory delta or capture time carries those one-time costs.
  bool prime = true;

  // Data parallelism (Note [Data-parallel rows]). The step all-reduces its
  // gradients and loss over `data_parallel` (null: this rank trains alone).
  Communicator* data_parallel = nullptr;
  DataParallelMode dp_mode = DataParallelMode::kAllReduce;
  // Where each summed group's update runs (Note [Where summed updates run] in optim/adamw.h).
  AdamW::SummedUpdateStream summed_update_stream = AdamW::SummedUpdateStream::kCommunicationWhenCaptured;
  // The ranks timed together: they meet before each timed sample and before
  // the pipelined steps (null: this rank is timed alone).
  Communicator* timed_with = nullptr;
  // The data-parallel stream layout: a Context with 2 side streams and the
  // collectives on stream 2 (the trainer's), with or without a communicator.
  bool dp_layout = false;
  // Tensor parallelism (Note [Tensor-parallel rows]): the model is sharded
  // over `tensor_parallel` (null: whole) and each rank trains tokens / N of
  // the config's; `overlap` is how its collectives meet their GEMMs.
  Communicator* tensor_parallel = nullptr;
  MLPOverlap overlap;
  // Context parallelism (Note [Context-parallel rows]): the model's
  // attention runs over `context_parallel` (null: none), each rank holding
  // its zig-zag chunks of the config's tokens, and the CP group is the
  // step's gradient group (data_parallel must be null).
  Communicator* context_parallel = nullptr;
  // Expert parallelism (Note [Expert-parallel rows] in
  // expert_parallel_step_runner.h): every MoE block's experts are spread over
  // `expert_parallel` (null: none), each rank trains the config's tokens, and
  // the EP group is the step's gradient group (data_parallel must be null).
  Communicator* expert_parallel = nullptr;
  // Graph mode: after the timed steps, one profiled step (CapturedStep::profile;
  // every rank, since it holds the collectives); its text in ModeResult::profile.
  bool profile = false;
  // Graph mode: after the timed steps, one replay inside cudaProfilerStart/Stop,
  // for `ncu --profile-from-start off` (step_bench --cuda-profiler-range).
  bool cuda_profiler_range = false;
};

enum class StepMode { kEager, kGraph };

struct ModeResult {
  std::vector<double> samples_us;  // every timed step, in order
  Summary step_us;
  double pipelined_step_us = 0;
  std::vector<float> first_losses;
  float final_loss = 0;
  std::int64_t persistent_bytes = 0;  // parameters, gradients, AdamW state, step inputs
  // What persistent_bytes holds, by kind: fp32 masters, gradients, AdamW
  // moments (or, sharded, the optimizer's shards), the model-dtype copies of
  // the parameters, FP8 delayed-scaling state, and the rest (step inputs and
  // labels, AdamW's launch tables, FP8 weight caches, error words).
  std::map<std::string, std::int64_t> persistent_breakdown;
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
  // What the pool holds at its fullest, by the op that made each value
  // (pool_by_producer in graphs/planner.h), largest first.
  std::vector<std::pair<std::string, std::int64_t>> pool_peak_by_op;
  std::int64_t pool_lower_bound_bytes = 0;
  CaptureTimings capture;
  double capture_wall_ms = 0;  // the whole CapturedStep::capture call
  std::string profile;         // StepRunOptions::profile: StepProfile::to_string() (rank 0's when combined)
  // The profiled step's communication no compute overlapped and its length
  // (StepProfile::exposed_communication_us, total_us; combined: the rank
  // with the largest exposed share); 0 when not profiled.
  double profile_exposed_comm_us = 0;
  double profile_total_us = 0;
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

// ---- Data parallelism (step_bench --dp; Note [Data-parallel rows]) ----

// step_bench's --dp against the launch: `dp` 0 (not given) runs the
// single-GPU benchmark and needs a world of 1; otherwise `dp` must be the
// world size. Error(kInvalidArgument) saying how to launch otherwise.
void check_dp_flag(int dp, int world_size);

// One mode on every rank of the world.
struct RankedResult {
  // step_us and pipelined_step_us: the largest over the ranks, sample by
  // sample; memory: the largest over the ranks; losses, pool and capture
  // times: rank 0's.
  ModeResult combined;
  std::vector<double> rank_median_us;  // each rank's own median step time
  std::vector<float> rank_first_loss;  // each rank's first loss
};

// Combines the results of one mode, one per rank in rank order (equal sample
// counts; Error otherwise).
RankedResult combine_ranks(const std::vector<ModeResult>& ranks);

// A ModeResult as JSON and back: how ranks send theirs to the others.
nlohmann::json mode_result_to_json(const ModeResult& r);
ModeResult mode_result_from_json(const nlohmann::json& j);

struct DataParallelResults {
  int world_size = 1;
  DataParallelMode mode = DataParallelMode::kAllReduce;
  RankedResult baseline_eager, baseline_graph;     // dp1
  std::optional<RankedResult> dp_eager, dp_graph;  // dpN, world_size > 1 only
};

// The config's JSON from measured results (also for tests): rows
// stepgraph_{eager,graph}_dp1, and at N > 1 stepgraph_{eager,graph}_dpN with
// the scaling fields.
nlohmann::json dp_config_json(const StepConfig& config, const DataParallelResults& results);

// Runs the config's dp1 rows and, when `world` has N > 1 ranks, its dpN rows
// on every rank of `world` (null: a world of one; `options.data_parallel`,
// `timed_with` and `dp_layout` are set here) and returns the config's JSON,
// the same on every rank. At world size 1 an exception becomes a not_run or
// failed config as in run_config; at N > 1 it propagates (the ranks could be
// in different collectives: step_bench ends the process, the launcher the
// others).
nlohmann::json run_dp_config(const StepConfig& config, const StepRunOptions& options, Communicator* world,
                             DataParallelMode mode);

// ---- Tensor parallelism (step_bench --tp) ----
//
// Note [Tensor-parallel rows]
// step_bench --tp N runs each config on the N ranks of a launch, every mode:
//   stepgraph_<mode>_tp1  the baseline: every rank trains the whole config
//                         (all `tokens`) alone on its GPU, all at the same time;
//   stepgraph_<mode>_tpN  the same global step tensor- and sequence-parallel
//                         over the N ranks (ResidualStack over the world:
//                         each rank holds 1/N of every block's heads (its
//                         q, k and v heads and the output projection's
//                         columns, Note [Tensor-parallel attention]), of
//                         every ffn, of the experts and of the vocabulary,
//                         and tokens / N rows outside the blocks), its
//                         collectives meeting their GEMMs as --overlap says.
// Both rows run the config itself (the GPT: attention and MLP blocks); the
// tpN row's packing is the config's `sequences` of seq_len over the group's
// tokens, so sequences must divide by N (each rank's rows are whole
// sequences). The config's JSON says heads, kv_heads and tp.
// Strong scaling: both rows train the same `tokens` per step; per row
// tokens_per_s = tokens / median step time, speedup_vs_tp1 = median(tp1) /
// median(tpN), strong_scaling_efficiency = speedup / N; tflops and mfu are
// per GPU (the step's FLOPs / N for the tpN row). Timing as for the
// data-parallel rows (barrier before each sample, the slowest rank).
// Exposed communication: a tpN row has no step time without its collectives
// to subtract (tp1 does N times the work), so with --profile a graphed row
// reports its profiled step's profile_exposed_comm_us (communication no
// compute overlapped) and profile_exposed_comm_fraction (of the profiled
// step), the rank with the largest share; data-parallel rows report them too.

// Runs the config's tp1 rows and, at N > 1 ranks, its tpN rows on every rank
// of `world` and returns the config's JSON (the same on every rank). As
// run_dp_config: at N > 1 an exception propagates.
nlohmann::json run_tp_config(const StepConfig& config, const StepRunOptions& options, Communicator* world);

// ---- Context parallelism (step_bench --cp) ----
//
// Note [Context-parallel rows]
// step_bench --cp N runs each config on the N ranks of a launch, every mode:
//   stepgraph_<mode>_cp1  the baseline: every rank trains the config (its
//                         `sequences` of seq_len L) alone on its GPU, all
//                         at the same time;
//   stepgraph_<mode>_cpN  the config's sequences N times as long (N x L)
//                         over the N ranks (Note [Context-parallel
//                         ResidualStack]): each rank holds its zig-zag
//                         chunks, the same tokens per GPU as the baseline,
//                         and the CP group sums the gradients.
// Weak scaling in sequence length, same mode:
//   efficiency      = per-GPU model TFLOP/s(cpN) / per-GPU TFLOP/s(cp1)
//   step_time_ratio = median(cp1) / median(cpN)
// The step time ratio is not an efficiency: a sequence N times as long has
// N times the causal attention work per token, so each GPU's attention core
// does N times the baseline's (the GEMMs the same), and the ratio's ceiling
// is work(cp1) / work(cpN) per GPU (0.70 for `long` at N = 2, with
// benchmarks/model_flops.h's counting) even with free communication. The
// efficiency divides each row's step by its own work (model_flops.h: the
// attention core at the row's sequence length), so 1.0 means CP runs the
// longer sequence's work as fast as one GPU runs the shorter one's. Each
// row's JSON says its cp, seq_len, sequences and tokens; tokens_per_s,
// tflops and mfu are per GPU. Timing as for the data-parallel rows; with
// --profile the graphed rows report their exposed communication.

// The config whose sequences are `cp` times as long (the cpN rows' config).
StepConfig context_parallel_config(const StepConfig& config, int cp);

// Runs the config's cp1 rows and, at N > 1 ranks, its cpN rows on every rank
// of `world` and returns the config's JSON (the same on every rank). As
// run_dp_config: at N > 1 an exception propagates.
nlohmann::json run_cp_config(const StepConfig& config, const StepRunOptions& options, Communicator* world);

// ---- Pieces the parallel runners share (also pipeline_step_runner.h) ----

// Runs `step` (its outputs' first: the loss) in `mode` and measures it (Note
// [How a step is timed]): graphed, captures it first with `communicators`;
// then the warm-up (the first losses kept), check_errors(), the timed
// samples and the pipelined steps (meeting options.timed_with), the profile
// and the profiler range where asked. Fills r's capture, pool, loss, sample
// and profile fields; Error naming `what` (e.g. "config tiny") when the final
// loss is not finite.
void time_step(Context& ctx, StepMode mode, const StepRunOptions& options, const CapturedStep::StepFunction& step,
               const std::vector<Communicator*>& communicators, const std::function<void()>& check_errors,
               std::string_view what, ModeResult& r);

// Every rank's bytes, in rank order (just `mine` in a world of one, `world`
// null). The exchange carries `what`: ranks at different exchanges get an
// Error naming both.
std::vector<std::string> gather(Communicator* world, const std::string& mine, std::string_view what);
// The ranks meet (nothing in a world of one).
void meet(Communicator* world, std::string_view what);
// Device bytes in use now on the current device (cudaMemGetInfo).
std::int64_t device_used_bytes();
// A row's common fields: step time, tokens/s, TFLOP/s and MFU of `config`'s
// step, speedup over `eager`, memory, final loss.
nlohmann::json system_json(const std::string& name, const StepConfig& config, const ModeResult& r,
                           const ModeResult& eager);
// A graphed row's pool against its lower bound and its capture times.
void add_graph_fields(nlohmann::json& out, const ModeResult& graph);
// A row's --profile fields, where it was profiled.
void add_profile_fields(nlohmann::json& out, const ModeResult& r);
// Whether two runs' first losses are the same bits, and their largest difference.
std::pair<bool, double> compare_losses(const std::vector<float>& a, const std::vector<float>& b);
// stepgraph_<eager|graph>_<kind><world size>.
std::string parallel_system_name(StepMode mode, std::string_view kind, int world_size);
// Whether this rank writes the progress lines and the summary: rank 0 of
// `world`, or the only rank (`world` null).
bool is_leader(const Communicator* world);
// Every rank's result of one mode, in rank order (each sent as JSON); the
// exchange carries "results of <what>".
std::vector<ModeResult> gather_results(Communicator* world, const ModeResult& mine, std::string_view what);
// Progress lines on stderr from the leader, `flag` their prefix (e.g.
// "step_bench --ep"): "<what> ..." before a row, its median and first loss
// after (`row` the combined result).
void log_row_start(std::string_view flag, const Communicator* world, std::string_view what);
void log_row_done(std::string_view flag, const Communicator* world, std::string_view what, const ModeResult& row);
// A weak-scaling row's fields against its baseline row of the same mode
// (Note [Data-parallel rows]): baseline_system (`baseline_name`),
// scaling_efficiency, exposed_comm_us, exposed_comm_fraction and their
// pipelined_ variants; every one null where `baseline` is null.
void add_scaling_fields(nlohmann::json& out, const RankedResult& r, const RankedResult* baseline,
                        const std::string& baseline_name);
// A weak-scaling row's first loss against the mean of the ranks' first
// losses alone (the same tokens, the same initial parameters):
// {baseline_rank_first_losses, baseline_mean_first_loss, <kind>_first_loss,
// abs_diff, agrees (within 1e-4 relative)}.
nlohmann::json mean_first_loss_check(const RankedResult& alone, const RankedResult& parallel, std::string_view kind);
// Whether every rank of a row logged the same first loss.
bool ranks_agree(const RankedResult& row);
// How the parallel rows are timed, in the words of step_bench's JSON header.
inline constexpr const char* kParallelTimingText =
    "the ranks meet before each timed sample; a sample is the largest over the ranks of their step + synchronize; "
    "pipelined: the largest over the ranks of `steps` steps and one synchronize, / steps";
// {steps, compared, identical, max_abs_diff} of two rows' first losses.
nlohmann::json parallel_loss_check(const RankedResult& eager, const RankedResult& graph, const std::string& eager_name,
                                   const std::string& graph_name);
// body() in a world of one catches an exception into the config's not_run
// or failed JSON; at `world_size` > 1 the exception propagates.
nlohmann::json run_or_failed_row(const StepConfig& config, int world_size, const std::function<nlohmann::json()>& body);

}  // namespace stepgraph::bench
