// The trainer's flags: parsed with CLI11, then defaults that depend on the
// device filled in (resolve_defaults), then the combinations checked.
//
//   ParsedCommandLine parsed = parse_command_line(args);   // --help, flag errors
//   TrainerOptions options = resolve_defaults(*parsed.options, device);
//
// Note [Trainer defaults]
// The defaults are chosen so the default run's loss comes within 0.05 nats of
// the Markov source's entropy rate. Data on both devices: order 2 over 8
// tokens (64 states; entropy rate 1.2469 nats/token at seed 1). cuda: the
// sequence model (a GPT: TransformerLayers with causal attention over
// sequences of --seq-len tokens, every next token predicted), bf16 like the
// benchmarks, 4 layers of hidden 512 / 8 heads / ffn 2048, 32 sequences of
// 128 tokens, lr 1e-3, 1000 steps. Host: the window model (--heads 0: MLP
// blocks over a window of --context tokens), a small fp32 model (2 blocks,
// hidden 64, ffn 128, context 2 = the order, batch 256, lr 3e-3, 1000 steps)
// that gets there in a few hundred steps and well under two minutes on two
// cores. The host's GPT is slower to get there: the small GPTs tried (1-2
// layers of hidden 32-64, 256-512 tokens a step, lr 7e-4 to 3e-3, 600-1500
// steps) ended 0.054-0.076 nats above the entropy rate (0.03-0.05 above the
// best loss their sequences allow) at 45-120 ms a step on this machine's
// host kernels; --heads 4 --seq-len 32 --batch 8 trains it there.
// trainer/README.md records the measured runs.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "engine/algorithm_choice.h"
#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/fp8_recipe.h"
#include "kernels/lr_schedule.h"
#include "layers/comm_gemm_overlap.h"
#include "train/train_step.h"
#include "trainer/buckets.h"

namespace stepgraph::trainer {

// How each step runs: ops launched one by one, or captured once and replayed.
enum class StepMode : std::uint8_t { kEager, kGraph };
std::string_view step_mode_name(StepMode mode);  // "eager" | "graph"

// The values of the flags: every choice already an enum or a value
// (parse_command_line converts the text once); resolve_defaults fills what
// the device decides.
struct TrainerOptions {
  std::optional<Device> device;          // empty: auto (cuda where there is a GPU)
  StepMode mode = StepMode::kGraph;
  std::optional<DType> dtype;            // bf16 | fp16 | fp32; empty: the device's default
  // FP8 GEMMs in the blocks; empty: none. --fp8-weight-cache is its cache_weights.
  std::optional<Fp8Recipe> fp8;
  // Skip a step whose loss or gradients are not finite, on the device (Note
  // [Non-finite steps] in optim/adamw.h). Unset: on, but off with ZeRO-1
  // (whose sharded update cannot run inside the conditional node).
  std::optional<bool> skip_nonfinite;
  // Dropout on the stack's input and every attention and MLP output (Note
  // [Dropout in a captured step] in layers/residual_stack.h); 0: none.
  double dropout = 0;
  // With --dtype fp16: good steps in a row after which the loss scale doubles
  // (Note [Loss scaling] in kernels/step_guard.h).
  std::int64_t loss_scale_interval = 2000;
  // Shape buckets (Note [Shape buckets] in trainer/buckets.h): empty, or
  // token counts / powers of two; each sequence of a step then has a length
  // drawn in [min_seq_len, seq_len] (0: seq_len / 2).
  BucketSpec buckets;
  std::int64_t min_seq_len = 0;
  // 0 (or empty) below means "the device's default" until resolve_defaults.
  std::int64_t steps = 0;
  std::int64_t layers = -1;  // -1: default (0 blocks is a valid model)
  std::int64_t hidden = 0;
  std::int64_t ffn = 0;
  std::int64_t experts = 0;
  std::int64_t topk = 2;
  // With --experts, the MoE blocks' load balancing (Note [MoE load balancing]
  // in layers/moe_mlp.h), each 0 (off) by default: the Switch auxiliary
  // loss's coefficient (its gradient in the step, its value logged beside the
  // loss) and the expert bias's update rate (DeepSeek-V3's aux-loss-free
  // balancing: a per-expert router bias moved on the device after every step).
  double moe_aux_loss = 0;
  double moe_bias_rate = 0;
  std::int64_t batch = 0;    // sequences (sequence model) or examples (window model) per step, all ranks
  std::int64_t heads = -1;   // attention heads per block; 0: the window model (MLP blocks); -1: default
  std::int64_t kv_heads = 0;  // 0: heads; fewer: grouped-query attention
  std::int64_t seq_len = 0;   // sequence model: tokens per sequence
  std::int64_t context = 0;   // window model: tokens per example
  double lr = 0;
  // The rate of each step (kernels/lr_schedule.h): constant, cosine or
  // linear decay to --min-lr over --steps, after --warmup-steps of linear
  // warmup; computed on the device from the step counter.
  kernels::LrScheduleKind lr_schedule = kernels::LrScheduleKind::kConstant;
  std::int64_t warmup_steps = 0;
  double min_lr = 0;
  std::int64_t decay_steps = 0;  // where the decay ends; 0: --steps
  std::uint64_t seed = 1;
  std::int64_t log_every = 0;
  std::string data;        // empty: the synthetic Markov source
  std::int64_t vocab = 0;  // Markov source only
  std::int64_t order = 0;  // Markov source only
  std::string checkpoint;  // empty: no checkpoints
  bool resume = false;
  std::int64_t save_every = 0;  // 0: only at the end
  // Several ranks (trainer/distributed.h). --nproc-per-node N starts N worker
  // processes of this program on this host; without it the launcher's
  // variables (torchrun, srun, mpirun) decide the world.
  std::int64_t nproc_per_node = 0;    // 0: not the local launcher
  std::int64_t max_restarts = 0;      // --nproc-per-node starts every rank again this often (Note [Elastic restarts])
  std::int64_t dp = 0;                // data-parallel ranks; 0: the world size / tp
  std::int64_t tp = 1;                // tensor-parallel ranks (consecutive ranks form a group)
  std::int64_t cp = 1;                // context-parallel ranks (groups across the tp groups)
  // Pipeline stages (Note [Pipeline ranks in the trainer] in trainer/pipeline_ranks.h): groups of pp
  // ranks across the tp groups each hold 1/pp of the blocks; virtual_stages chunks a rank (interleaved
  // 1F1B above 1); each replica's batch runs as `microbatches` microbatches (0: 2 x pp until resolve_defaults).
  std::int64_t pp = 1;
  std::int64_t virtual_stages = 1;
  std::int64_t microbatches = 0;
  // Expert-parallel ranks (Note [Expert parallelism in the trainer] in trainer/expert_ranks.h): the world's
  // ranks spread every MoE block's experts and each trains its own rows; 1 (or 0 on the command line): none.
  std::int64_t ep = 1;
  MLPOverlap overlap;                 // tensor-parallel GEMM/collective overlap (layers/comm_gemm_overlap.h)
  DataParallelMode dp_mode = DataParallelMode::kAllReduce;
  double comm_timeout_s = 300;        // a collective or step longer than this ends every rank
  bool profile = false;               // graph mode: profile one more step after the run (graphs/step_profile.h)
  // How cuBLASLt's GEMM algorithms are picked (Note [Deterministic algorithm
  // choice] in engine/algorithm_choice.h): heuristic (the same bits on every
  // run) or timed (the fastest in this process; recorded in checkpoints).
  AlgorithmChoice gemm_algorithms = AlgorithmChoice::kHeuristic;
};

// The schedule of the options (the base rate --lr, decaying over --steps);
// none for a constant rate without warmup, which runs as before schedules.
std::optional<kernels::LrSchedule> lr_schedule_of(const TrainerOptions& o);

struct ParsedCommandLine {
  std::optional<TrainerOptions> options;  // empty after --help or an error
  int exit_code = 0;                      // for main() when options is empty
  std::string message;                    // help text or the error, for the user
};

// args without the program name. Never throws for user input.
ParsedCommandLine parse_command_line(std::span<const std::string> args);

// The device the options ask for: cuda for "auto" where there is a GPU. The
// note says why the host was chosen (empty otherwise).
struct DeviceChoice {
  Device device = Device::kHost;
  std::string note;
};
DeviceChoice choose_device(const TrainerOptions& options);

// Fills every default for `device` (Note [Trainer defaults]) and checks the
// combinations; Error(kInvalidArgument) naming the flag otherwise.
TrainerOptions resolve_defaults(const TrainerOptions& options, Device device);

// --max-restarts goes with --nproc-per-node and --checkpoint
// (Error(kInvalidArgument) naming the flag otherwise); resolve_defaults and
// the local launcher check it.
void check_restart_options(const TrainerOptions& options);

}  // namespace stepgraph::trainer
