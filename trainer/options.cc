#include "trainer/options.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "layers/comm_gemm_overlap.h"
#include "trainer/flag_values.h"

namespace stepgraph::trainer {
namespace {

// See Note [Trainer defaults]: measured values live in trainer/README.md.
struct Defaults {
  std::int64_t steps, layers, hidden, ffn, heads, sequences, seq_len, examples, context, log_every, vocab, order;
  double lr;
  DType dtype;
};
constexpr Defaults kHostDefaults{.steps = 1000,
                                 .layers = 2,
                                 .hidden = 64,
                                 .ffn = 128,
                                 .heads = 0,
                                 .sequences = 8,
                                 .seq_len = 32,
                                 .examples = 256,
                                 .context = 2,
                                 .log_every = 50,
                                 .vocab = 8,
                                 .order = 2,
                                 .lr = 3e-3,
                                 .dtype = DType::kFloat32};
constexpr Defaults kCudaDefaults{.steps = 1000,
                                 .layers = 4,
                                 .hidden = 512,
                                 .ffn = 2048,
                                 .heads = 8,
                                 .sequences = 32,
                                 .seq_len = 128,
                                 .examples = 1024,
                                 .context = 4,
                                 .log_every = 100,
                                 .vocab = 8,
                                 .order = 2,
                                 .lr = 1e-3,
                                 .dtype = DType::kBFloat16};

// Caps past which a value is a typo, not a run: they keep the products of
// flags (bytes, tokens, milliseconds) inside 64 bits. Sizes and steps:
// trainer/flag_values.h.
constexpr std::int64_t kMaxLayers = std::int64_t{1} << 16;
constexpr std::int64_t kMaxRanks = std::int64_t{1} << 16;
constexpr double kMaxLr = 1e6;               // fp32 on the device, with room for the update's products
constexpr double kMaxTimeoutSeconds = 1e6;  // 11.6 days, as int64 milliseconds and clock arithmetic
constexpr double kMaxMoeBalance = 1e6;      // --moe-aux-loss, --moe-bias-rate: fp32 on the device, as --lr

template <typename T>
void default_if(T& value, T unset, T fallback) {
  if (value == unset) value = fallback;
}

// The flag names of an enum's values, from the enum's own name function.
template <typename T, typename Name>
std::vector<std::pair<std::string, T>> named(std::initializer_list<T> values, Name name) {
  std::vector<std::pair<std::string, T>> out;
  for (T value : values) out.emplace_back(std::string(name(value)), value);
  return out;
}

// --fp8's choices: none, or the engine's recipe of each scaling.
std::vector<std::pair<std::string, std::optional<Fp8Recipe>>> fp8_choices() {
  std::vector<std::pair<std::string, std::optional<Fp8Recipe>>> out{{"none", std::nullopt}};
  for (Fp8Scaling scaling : {Fp8Scaling::kCurrent, Fp8Scaling::kDelayed, Fp8Scaling::kBlock}) {
    out.emplace_back(std::string(fp8_scaling_name(scaling)), Fp8Recipe::of(scaling));
  }
  return out;
}

std::string fp8_flag(const std::optional<Fp8Recipe>& fp8) {
  return fp8 ? std::string(fp8_scaling_name(fp8->scaling)) : std::string("none");
}

// --pp's combinations: what LanguageModelStages and PipelineTrainStep
// refuse, asked here to name the flags; the microbatches' default.
void check_pipeline_options(TrainerOptions& o) {
  const std::string pp = "--pp " + std::to_string(o.pp);
  SG_CHECK(o.experts == 0 && !o.fp8 && o.dropout == 0, pp, " does not support --experts (", o.experts, "), --fp8 (",
           fp8_flag(o.fp8), ") or --dropout (", o.dropout,
           ") yet: the pipeline stages leave them out; pass --experts 0, --fp8 none and --dropout 0, or leave --pp out");
  SG_CHECK(o.cp == 1, pp, " with --cp ", o.cp, ": context parallelism in pipeline stages is not supported yet; leave "
           "one of them out");
  SG_CHECK(o.buckets.empty(), pp, " with --buckets: the pipeline runs one shape; leave one of them out");
  SG_CHECK(o.dtype != DType::kFloat16, pp, " with --dtype fp16: the pipeline step has no loss scaling yet; pass "
           "--dtype bf16 or fp32");
  SG_CHECK(o.dp_mode != DataParallelMode::kZero1, pp, " with --dp-mode zero1: the pipeline step does not shard its "
           "optimizer yet; use --dp-mode allreduce");
  SG_CHECK(!o.skip_nonfinite.value_or(false), pp, " with --skip-nonfinite: the pipeline step cannot skip a "
           "non-finite step yet; leave --skip-nonfinite out (with --pp the default is off)");
  SG_CHECK(o.layers >= o.pp * o.virtual_stages && o.layers % (o.pp * o.virtual_stages) == 0, "--layers (", o.layers,
           ") must be a positive multiple of --pp (", o.pp, ") x --virtual-stages (", o.virtual_stages,
           "): every chunk of every stage runs the same number of blocks");
  if (o.microbatches == 0) o.microbatches = 2 * o.pp;
  SG_CHECK(o.virtual_stages == 1 || o.microbatches % o.pp == 0, "--microbatches (", o.microbatches,
           ") must be a multiple of --pp (", o.pp, ") with --virtual-stages ", o.virtual_stages,
           ": interleaved 1F1B runs the microbatches in groups of one per stage");
  // Each replica's rows must cut into the microbatches: checked in train(), which knows --dp.
  SG_CHECK(o.batch % o.microbatches == 0, "--batch (", o.batch, ") must divide by --microbatches (", o.microbatches,
           "): each microbatch holds the same number of ", o.heads > 0 ? "sequences" : "examples");
}

// --ep's combinations (Note [Expert parallelism in the trainer] in
// trainer/expert_ranks.h): what ResidualStack, MoEMLP and TrainStep refuse
// under expert parallelism, asked here to name the flags.
void check_expert_parallel_options(const TrainerOptions& o) {
  const std::string ep = "--ep " + std::to_string(o.ep);
  std::vector<std::string> beside;
  if (o.tp > 1) beside.push_back("--tp " + std::to_string(o.tp));
  if (o.cp > 1) beside.push_back("--cp " + std::to_string(o.cp));
  if (o.pp > 1) beside.push_back("--pp " + std::to_string(o.pp));
  if (o.dp_mode == DataParallelMode::kZero1) beside.push_back("--dp-mode zero1");
  if (!beside.empty()) {
    std::string given = beside.front();
    for (std::size_t i = 1; i < beside.size(); ++i) given += (i + 1 == beside.size() ? " and " : ", ") + beside[i];
    SG_THROW(ErrorCode::kInvalidArgument, ep, " with ", given,
             ": expert parallelism runs with data parallelism only for now (the world is --ep x --dp ranks, each "
             "training its own rows; no tensor, context or pipeline parallelism beside it, and no ZeRO-1, which "
             "would reduce-scatter the experts' gradients over ranks that hold other experts); leave ",
             beside.size() == 1 ? "it" : "them", " out, or leave out --ep");
  }
  SG_CHECK(o.experts > 0, ep, " spreads the MoE blocks' experts over ", o.ep,
           " ranks: it needs --experts N (a multiple of ", o.ep, ")");
  SG_CHECK(o.experts % o.ep == 0, "--experts (", o.experts, ") must divide by --ep (", o.ep,
           "): each rank holds --experts / --ep whole experts of every MoE block");
  SG_CHECK(!o.fp8, ep, " with --fp8 ", fp8_flag(o.fp8),
           ": FP8 experts under expert parallelism are not built (each rank's tensor-wise scales would cover only "
           "its own experts and tokens); pass --fp8 none, or leave out --ep");
  SG_CHECK(o.buckets.empty(), ep, " with --buckets: shape buckets run on one rank for now; leave one of them out");
  const std::int64_t ranks = o.ep * std::max<std::int64_t>(o.dp, 1);
  const std::string unit = o.heads > 0 ? "sequences" : "examples";
  if (o.dp > 1) {
    SG_CHECK(o.batch % ranks == 0, "--batch (", o.batch, ") must divide by --ep (", o.ep, ") x --dp (", o.dp,
             "): each of the ", ranks, " ranks trains its own --batch / ", ranks, " ", unit, " of the global batch");
  } else {
    SG_CHECK(o.batch % o.ep == 0, "--batch (", o.batch, ") must divide by --ep (", o.ep,
             "): each expert-parallel rank trains its own --batch / --ep ", unit, " of the global batch");
  }
}

}  // namespace

std::string_view step_mode_name(StepMode mode) { return mode == StepMode::kEager ? "eager" : "graph"; }

ParsedCommandLine parse_command_line(std::span<const std::string> args) {
  TrainerOptions o;
  CLI::App app{"StepGraph trainer: trains a token language model eager or as one replayed CUDA graph per step"};
  add_choice(app, "--device", o.device, {{"auto", std::nullopt}, {"cuda", Device::kCuda}, {"host", Device::kHost}},
             "cuda, host, or auto (cuda when there is a GPU)");
  add_choice(app, "--mode", o.mode, named({StepMode::kEager, StepMode::kGraph}, step_mode_name),
             "eager (ops launched one by one) or graph (the step captured once, replayed)");
  add_choice(app, "--dtype", o.dtype,
             named<std::optional<DType>>({DType::kBFloat16, DType::kFloat16, DType::kFloat32},
                                         [](const std::optional<DType>& d) { return dtype_name(*d); }),
             "model dtype: bf16, fp16 (with dynamic loss scaling on the device) or fp32 (default: bf16 on cuda, "
             "fp32 on the host)");
  add_choice(
      app, "--fp8", o.fp8, fp8_choices(),
      "FP8 GEMMs in the attention projections and MLPs: none, current, delayed (history 1024) or block "
      "(1 x 128 / 128 x 128 scales); features and tokens must divide by 16 (block: 128)");
  app.add_option("--dropout", o.dropout,
                 "the probability of dropping each element of the blocks' input and of every attention and MLP "
                 "output (0: none); the generator's state lives on the device and in checkpoints")
      ->check(real_number(0, 0.99));
  CLI::Option* loss_scale_option = app.add_option("--loss-scale-interval", o.loss_scale_interval,
                 "with --dtype fp16: good steps in a row after which the loss scale doubles (an overflowed step "
                 "halves it and is skipped)")
      ->capture_default_str()
      ->check(whole_number(1, std::int64_t{1} << 24));
  add_parsed(app, "--buckets", o.buckets, BucketSpec::parse,
             "sequences of varying length (each in [--min-seq-len, --seq-len]) trained in shape buckets: token "
             "counts like 256,512,1024, or pow2; one captured step per bucket, all in one shared pool, each "
             "batch padded (and the padding masked) to the smallest bucket that holds it")
      ->check(non_empty());
  CLI::Option* min_seq_len_option =
      app.add_option("--min-seq-len", o.min_seq_len, "with --buckets: the shortest sequence (default --seq-len / 2)")
          ->check(whole_number(1, kMaxSize));
  bool skip_nonfinite = true;  // o.skip_nonfinite stays unset unless a flag was given
  CLI::Option* skip_option = app.add_flag("--skip-nonfinite,!--no-skip-nonfinite", skip_nonfinite,
               "skip a step whose loss or any gradient is NaN or infinite: checked on the device, the update inside "
               "a CUDA conditional node, nothing read on the host (default on; off with --dp-mode zero1, which it "
               "does not support)");
  bool fp8_weight_cache = false;
  CLI::Option* cache_option = app.add_flag("--fp8-weight-cache", fp8_weight_cache,
               "with --fp8 current or delayed: quantize each weight once per optimizer step, right after its update, "
               "into persistent FP8 copies (2 bytes a weight element; the same results)");
  app.add_option("--steps", o.steps, "total training steps (a resumed run continues to this step)")
      ->check(whole_number(1, kMaxSteps));
  app.add_option("--layers", o.layers, "TransformerLayers (or, with --heads 0, LayerNormMLP blocks)")
      ->check(whole_number(0, kMaxLayers));
  app.add_option("--hidden", o.hidden, "hidden size (a multiple of --heads, or with --heads 0 of --context)")
      ->check(whole_number(1, kMaxSize));
  app.add_option("--heads", o.heads,
                 "attention heads per layer (default: 0 on the host, 8 on cuda); 0: the window model, MLP blocks "
                 "over a window of --context tokens")
      ->check(whole_number(0, kMaxSize));
  app.add_option("--kv-heads", o.kv_heads, "key/value heads (default: --heads; fewer: grouped-query attention)")
      ->check(whole_number(0, kMaxSize));
  app.add_option("--seq-len", o.seq_len, "tokens per training sequence (the sequence model's context)")
      ->check(whole_number(1, kMaxSize));
  app.add_option("--ffn", o.ffn, "MLP inner size")->check(whole_number(1, kMaxSize));
  app.add_option("--experts", o.experts, "experts per MoE block (0: dense blocks only)")
      ->check(whole_number(0, kMaxSize));
  CLI::Option* topk_option = app.add_option("--topk", o.topk, "with --experts: the experts each token is routed to")
                                  ->check(whole_number(1, kernels::kMaxTopk));
  CLI::Option* moe_aux_loss_option =
      app.add_option("--moe-aux-loss", o.moe_aux_loss,
                     "with --experts: the coefficient of the Switch auxiliary load-balancing loss of every MoE block "
                     "(0: off; Switch used 1e-2): its gradient trains the routers inside the step, its value is "
                     "logged as 'aux' beside the loss (which stays the language model's)")
          ->check(real_number(0, kMaxMoeBalance));
  CLI::Option* moe_bias_rate_option =
      app.add_option("--moe-bias-rate", o.moe_bias_rate,
                     "with --experts: aux-loss-free balancing (DeepSeek-V3; 0: off, it used 1e-3): every MoE block "
                     "keeps a per-expert bias on its router's top-k choice, moved by this rate toward the mean load "
                     "after every step, on the device; checkpoints hold it")
          ->check(real_number(0, kMaxMoeBalance));
  app.add_option("--batch", o.batch,
                 "sequences per step (each predicts its --seq-len next tokens); with --heads 0 examples per step")
      ->check(whole_number(1, kMaxSize));
  app.add_option("--context", o.context, "window model (--heads 0): tokens of context per example (the window W)")
      ->check(whole_number(1, kMaxSize));
  app.add_option("--lr", o.lr, "AdamW learning rate (the peak, with a schedule)")
      ->check(real_number(0, kMaxLr, Bound::kExclusive));
  add_choice(app, "--lr-schedule", o.lr_schedule,
             named({kernels::LrScheduleKind::kConstant, kernels::LrScheduleKind::kCosine,
                    kernels::LrScheduleKind::kLinear},
                   kernels::lr_schedule_kind_name),
             "constant (the default), cosine or linear: the rate decays from --lr to --min-lr over --steps, after "
             "--warmup-steps of linear warmup, computed on the device (no re-capture)");
  app.add_option("--warmup-steps", o.warmup_steps, "steps of linear warmup from 0 to --lr")
      ->check(whole_number(0, kMaxSteps));
  app.add_option("--min-lr", o.min_lr, "the rate cosine and linear decay to")
      ->check(real_number(0, kMaxLr));
  app.add_option("--decay-steps", o.decay_steps,
                 "the step where the decay reaches --min-lr (default --steps: a run stopped early and resumed with "
                 "a larger --steps keeps its schedule only if this is given)")
      ->check(whole_number(0, kMaxSteps));
  app.add_option("--seed", o.seed, "seed of the model, the Markov chain and the sampling (the model's initialization "
                 "takes 32 bits)")
      ->check(unsigned_number(0xffffffffu));
  app.add_option("--log-every", o.log_every, "print a step line every N steps")
      ->check(whole_number(1, kMaxSteps));
  app.add_option("--data", o.data, "a text or StepGraph token file (default: a synthetic Markov source)")
      ->check(non_empty());
  app.add_option("--vocab", o.vocab, "Markov source: vocabulary size")
      ->check(whole_number(2, 65536));
  app.add_option("--order", o.order, "Markov source: order (tokens of history that matter; vocab^(order + 1) <= 2^24)")
      ->check(whole_number(1, 23));
  app.add_option("--checkpoint", o.checkpoint, "checkpoint file, written at the end and every --save-every steps")
      ->check(non_empty());
  app.add_flag("--resume", o.resume, "continue from --checkpoint to --steps");
  app.add_option("--save-every", o.save_every, "also write the checkpoint every N steps (0: only at the end)")
      ->check(whole_number(0, kMaxSteps));

  app.add_option("--nproc-per-node", o.nproc_per_node,
                 "start this many ranks on this host (one process per GPU); under torchrun, srun or mpirun leave it "
                 "out: their variables set the world")
      ->check(whole_number(1, 64));
  app.add_option("--max-restarts", o.max_restarts,
                 "with --nproc-per-node and --checkpoint: when a rank dies, start every rank again, up to this many "
                 "times, each resuming from the newest complete checkpoint (torchrun: its own --max-restarts)")
      ->check(whole_number(0, 100));
  app.add_option("--dp", o.dp, "data-parallel ranks (default: the world size); the global --batch is split among them")
      ->check(whole_number(1, kMaxRanks));
  app.add_option("--tp", o.tp,
                 "tensor-parallel ranks: groups of this many consecutive ranks shard every block's attention heads, "
                 "ffn, the experts and the head's vocabulary, and each holds 1/tp of its group's tokens (sequence "
                 "parallelism); the "
                 "world is tp x dp")
      ->check(whole_number(1, kMaxRanks));
  app.add_option("--cp", o.cp,
                 "context-parallel ranks: groups of this many ranks (across the tp groups) split every sequence of "
                 "the sequence model (--heads > 0): each holds two of 2 cp chunks of its group's tokens, attention "
                 "gathers the keys and values, and the gradients are summed over dp x cp; the world is tp x cp x dp")
      ->check(whole_number(1, kMaxRanks));
  app.add_option("--pp", o.pp,
                 "pipeline stages: groups of this many ranks (across the tp groups) each hold 1/pp of the blocks, "
                 "the embedding on the first stage and the head on the last, activations and gradients sent between "
                 "them; the world is tp x pp x dp (tp innermost)")
      ->check(whole_number(1, kMaxRanks));
  CLI::Option* virtual_stages_option =
      app.add_option("--virtual-stages", o.virtual_stages,
                     "with --pp: model chunks each rank holds (interleaved 1F1B above 1); --layers must divide by "
                     "--pp x --virtual-stages")
          ->check(whole_number(1, kMaxLayers));
  CLI::Option* microbatches_option =
      app.add_option("--microbatches", o.microbatches,
                     "with --pp: microbatches each data-parallel replica's share of --batch is cut into (default "
                     "2 x --pp; interleaved, a multiple of --pp)")
          ->check(whole_number(1, kMaxSize));
  app.add_option("--ep", o.ep,
                 "expert-parallel ranks (0 or 1: none): the world's ranks spread every MoE block's --experts (each "
                 "holds --experts / ep of them), each trains its own 1/ep of the global --batch, and the tokens go "
                 "to their experts' rank and back inside the step; the world is ep x --dp ranks, ep innermost (each "
                 "replica's experts' gradients summed over the --dp ranks holding them; not with --tp, --cp, --pp or "
                 "--dp-mode zero1 yet)")
      ->check(whole_number(0, kMaxRanks));
  CLI::Option* overlap_option =
      add_parsed(app, "--overlap", o.overlap, MLPOverlap::parse,
                 "with --tp: how each all-gather / reduce-scatter meets its GEMM: none, bulk (the default), overlap "
                 "(ring_exchange for the all-gathers, pipelined for the reduce-scatters), or four modes fc1_fprop,"
                 "fc2_fprop,fc2_dgrad,fc1_dgrad")
          ->check(non_empty());
  add_choice(app, "--dp-mode", o.dp_mode,
             named({DataParallelMode::kAllReduce, DataParallelMode::kZero1}, data_parallel_mode_name),
             "allreduce (every rank updates every parameter) or zero1 (reduce-scatter, each rank updates its 1/N "
             "shard of the optimizer, all-gather the weights)");
  add_choice(app, "--gemm-algorithms", o.gemm_algorithms,
             named({AlgorithmChoice::kHeuristic, AlgorithmChoice::kTimed}, algorithm_choice_name),
             "how cuBLASLt's GEMM algorithms are picked: heuristic (the library's choice: the same bits on every "
             "run of one binary and GPU model) or timed (the fastest candidate in this process: can be faster, "
             "but another process may pick another and get other bits; the picks go into checkpoints so a "
             "resume repeats them)");
  app.add_option("--comm-timeout", o.comm_timeout_s,
                 "seconds a rank waits for the others (a collective, a step, the start) before it aborts them all")
      ->check(real_number(0, kMaxTimeoutSeconds, Bound::kExclusive));

  app.add_flag("--profile", o.profile,
               "graph mode: after the run, run one more step with a timing mark around every op and print each "
               "stream's busy time and the exposed communication (the step is not counted; checkpoints come before)");

  std::vector<const char*> argv{"trainer"};
  for (const std::string& arg : args) argv.push_back(arg.c_str());
  ParsedCommandLine parsed;
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::CallForHelp&) {
    parsed.message = app.help();
    return parsed;
  } catch (const CLI::ParseError& error) {
    parsed.exit_code = 2;  // a usage error, like every bad flag value (main's convention)
    std::string what = error.what();
    // CLI11 says "--steps: At Most 1 required but received 2" for a flag given twice.
    if (const std::size_t at = what.find(": At Most 1 required but received "); at != std::string::npos) {
      what = what.substr(0, at) + " was given " + what.substr(at + 34) + " times; give it once";
    }
    parsed.message = "trainer: " + what + "\nRun with --help for the flags.";
    return parsed;
  }
  if (skip_option->count() > 0) o.skip_nonfinite = skip_nonfinite;
  // Flags that would be silently ignored in the mode the others choose. Here,
  // where it is known whether they were given at all (their defaults are values).
  std::string ignored;
  if (topk_option->count() > 0 && o.experts == 0) {
    ignored = "--topk routes tokens to experts: it needs --experts N (N >= --topk)";
  } else if (moe_aux_loss_option->count() > 0 && o.experts == 0) {
    ignored = "--moe-aux-loss balances the MoE blocks' experts: it needs --experts N";
  } else if (moe_bias_rate_option->count() > 0 && o.experts == 0) {
    ignored = "--moe-bias-rate balances the MoE blocks' experts: it needs --experts N";
  } else if (loss_scale_option->count() > 0 && o.dtype != DType::kFloat16) {
    ignored = "--loss-scale-interval sets fp16's loss scaling: it needs --dtype fp16";
  } else if (overlap_option->count() > 0 && o.tp == 1) {
    ignored = "--overlap sets how tensor-parallel GEMMs meet their collectives: it needs --tp N (N > 1)";
  } else if (virtual_stages_option->count() > 0 && o.pp == 1) {
    ignored = "--virtual-stages sets the model chunks of each pipeline rank: it needs --pp N (N > 1)";
  } else if (microbatches_option->count() > 0 && o.pp == 1) {
    ignored = "--microbatches cuts each replica's batch for the pipeline schedule: it needs --pp N (N > 1)";
  } else if (min_seq_len_option->count() > 0 && o.buckets.empty()) {
    ignored = "--min-seq-len goes with --buckets";
  } else if (cache_option->count() > 0 && !o.fp8) {
    ignored = "--fp8-weight-cache keeps FP8 copies of the weights: it needs --fp8 current or delayed";
  }
  if (ignored.empty() && o.fp8 && fp8_weight_cache) {
    o.fp8->cache_weights = true;
    try {
      o.fp8->check();  // the recipe's own rules (block scaling has no weight cache)
    } catch (const Error& error) {
      ignored = "--fp8 " + fp8_flag(o.fp8) + " with --fp8-weight-cache: " + error.message();
    }
  }
  if (!ignored.empty()) {
    parsed.exit_code = 2;
    parsed.message = "trainer: " + ignored + "\nRun with --help for the flags.";
    return parsed;
  }
  parsed.options = o;
  return parsed;
}

DeviceChoice choose_device(const TrainerOptions& options) {
  if (options.device) return {*options.device, ""};
  const DeviceCount found = cuda_device_count();
  if (found.count > 0) return {Device::kCuda, ""};
  return {Device::kHost, found.no_device_reason + "; training on the host with a small model"};
}

void check_restart_options(const TrainerOptions& o) {
  SG_CHECK(o.max_restarts == 0 || o.nproc_per_node > 1,
           "--max-restarts restarts the ranks that --nproc-per-node starts; give --nproc-per-node N (N >= 2), or "
           "under torchrun its own --max-restarts");
  SG_CHECK(o.max_restarts == 0 || !o.checkpoint.empty(),
           "--max-restarts needs --checkpoint PATH (and --save-every N) for the restarted ranks to resume from");
}

TrainerOptions resolve_defaults(const TrainerOptions& options, Device device) {
  TrainerOptions o = options;
  const Defaults& d = device == Device::kCuda ? kCudaDefaults : kHostDefaults;
  default_if<std::int64_t>(o.steps, 0, d.steps);
  default_if<std::int64_t>(o.layers, -1, d.layers);
  default_if<std::int64_t>(o.hidden, 0, d.hidden);
  default_if<std::int64_t>(o.ffn, 0, d.ffn);
  default_if<std::int64_t>(o.heads, -1, d.heads);
  if (o.heads > 0) {
    SG_CHECK(o.context == 0, "--context is the window model's (--heads 0); the sequence model's context is --seq-len");
    default_if<std::int64_t>(o.seq_len, 0, d.seq_len);
    default_if<std::int64_t>(o.batch, 0, d.sequences);
    o.context = o.seq_len;  // the model's context: the sequence
  } else {
    SG_CHECK(o.seq_len == 0 && o.kv_heads == 0, "--seq-len and --kv-heads are the sequence model's; with --heads 0 "
             "use --context");
    default_if<std::int64_t>(o.batch, 0, d.examples);
    default_if<std::int64_t>(o.context, 0, d.context);
  }
  default_if<std::int64_t>(o.log_every, 0, d.log_every);
  default_if<double>(o.lr, 0, d.lr);
  if (o.fp8) {
    // FP8 GEMMs take bf16 operands and give bf16 results (Note [FP8 Linear] in layers/linear.h).
    SG_CHECK(!o.dtype || *o.dtype == DType::kBFloat16, "--fp8 ", fp8_flag(o.fp8), " runs bf16 models only, got --dtype ",
             dtype_name(o.dtype.value_or(DType::kBFloat16)), ": pass --dtype bf16 (the default with --fp8), or --fp8 none");
    o.dtype = DType::kBFloat16;
  }
  if (!o.dtype) o.dtype = d.dtype;
  if (o.data.empty()) {
    default_if<std::int64_t>(o.vocab, 0, d.vocab);
    default_if<std::int64_t>(o.order, 0, d.order);
  } else {
    SG_CHECK(o.vocab == 0 && o.order == 0, "--vocab and --order describe the synthetic Markov source; with --data ",
             o.data, " the file decides the vocabulary");
  }

  // Each flag's own range is its CLI11 validator's (parse_command_line); from
  // here on, the combinations.
  // Each step's tokens are indexed and packed (cu_seqlens) with 32-bit integers.
  SG_CHECK(o.batch * o.context <= kMaxSize, "--batch (", o.batch, ") x ", o.heads > 0 ? "--seq-len" : "--context", " (",
           o.context, ") is ", o.batch * o.context, " tokens a step; at most 2^31 - 1 fit the step's 32-bit indices");
  const kernels::LrScheduleKind schedule = o.lr_schedule;
  SG_CHECK(o.min_lr <= o.lr, "--min-lr (", o.min_lr, ") must not exceed --lr (", o.lr, ")");
  const std::int64_t decay_end = o.decay_steps > 0 ? o.decay_steps : o.steps;
  SG_CHECK(schedule == kernels::LrScheduleKind::kConstant || o.warmup_steps < decay_end, "--warmup-steps (",
           o.warmup_steps, ") must be fewer than the steps the decay ends at (", decay_end, ", --decay-steps or --steps) "
           "for the ", kernels::lr_schedule_kind_name(schedule), " decay to have steps left");
  SG_CHECK(schedule != kernels::LrScheduleKind::kConstant || o.decay_steps == 0,
           "--decay-steps is where the cosine and linear decays end; with --lr-schedule constant leave it out");
  SG_CHECK(schedule != kernels::LrScheduleKind::kConstant || o.min_lr == 0,
           "--min-lr is the floor of the cosine and linear decays; with --lr-schedule constant leave it out");
  if (o.heads > 0) {
    SG_CHECK(o.hidden % o.heads == 0, "--hidden (", o.hidden, ") must be a multiple of --heads (", o.heads,
             "): each head gets hidden / heads features");
    SG_CHECK(o.kv_heads == 0 || o.heads % o.kv_heads == 0, "--kv-heads (", o.kv_heads, ") must divide --heads (",
             o.heads, ")");
    // Rotary position embeddings turn pairs of a head's features.
    const std::int64_t head_dim = o.hidden / o.heads;
    SG_CHECK(head_dim % 2 == 0, "--hidden (", o.hidden, ") / --heads (", o.heads, ") is ", head_dim,
             " features a head; rotary positions need an even number: change --hidden or --heads");
    SG_CHECK(device != Device::kCuda || head_dim <= 256, "--hidden (", o.hidden, ") / --heads (", o.heads, ") is ",
             head_dim, " features a head; the CUDA attention kernels take at most 256: raise --heads");
  } else {
    SG_CHECK(o.hidden % o.context == 0, "--hidden (", o.hidden, ") must be a multiple of --context (", o.context,
             "): each of the context tokens gets hidden / context embedding columns");
  }
  if (o.fp8) {
    // The FP8 GEMMs' operand tiles: features and tokens in whole tiles (Note [FP8 Linear] in layers/linear.h).
    const std::string fp8 = fp8_flag(o.fp8);
    const std::int64_t tile = o.fp8->scaling == Fp8Scaling::kBlock ? 128 : 16;
    const std::int64_t kv_features = o.heads > 0 ? (o.kv_heads > 0 ? o.kv_heads : o.heads) * (o.hidden / o.heads) : 0;
    // Tensor-parallel, each rank's slice of the attention's projections (heads / tp of them).
    const std::int64_t heads_tp = o.heads > 0 ? o.tp : 1;
    SG_CHECK(o.hidden % tile == 0 && (o.hidden / heads_tp) % tile == 0 &&
                 ((o.hidden + 2 * kv_features) / heads_tp) % tile == 0 && (o.ffn / o.tp) % tile == 0,
             "--fp8 ", fp8, " needs --hidden", heads_tp > 1 ? " and --hidden / --tp" : "",
             ", the attention's q/k/v width (--hidden + 2 x --kv-heads x head dim = ", o.hidden + 2 * kv_features, ")",
             heads_tp > 1 ? " / --tp" : "", " and --ffn / --tp (", o.ffn / o.tp, ") to be multiples of ", tile,
             ", got --hidden ", o.hidden, ", --ffn ", o.ffn, ", --tp ", o.tp);
    SG_CHECK((o.batch * (o.heads > 0 ? o.context : 1)) % tile == 0, "--fp8 ", fp8, " needs each step's tokens (--batch",
             o.heads > 0 ? " x --seq-len" : "", " = ", o.batch * (o.heads > 0 ? o.context : 1), ") to be a multiple of ",
             tile);
  }
  SG_CHECK(o.experts == 0 || (o.topk >= 1 && o.topk <= o.experts), "--topk (", o.topk,
           ") must be between 1 and --experts (", o.experts, ")");
  SG_CHECK(o.experts == 0 || o.dtype != DType::kFloat16, "--experts with --dtype fp16: the MoE blocks' grouped GEMM takes bf16 "
           "or fp32; pass --dtype bf16 or fp32, or leave --experts out");
  SG_CHECK(o.experts == 0 || o.layers >= 2, "--experts makes every second block an MoE block: it needs --layers 2 or "
           "more, got --layers ", o.layers);
  // MoE load balancing (Note [MoE load balancing] in layers/moe_mlp.h): ResidualStack's rules, asked here to name
  // the flags. --pp refuses --experts below, and with it these.
  for (const auto& [flag, value] : {std::pair{"--moe-aux-loss", o.moe_aux_loss},
                                    std::pair{"--moe-bias-rate", o.moe_bias_rate}}) {
    SG_CHECK(std::isfinite(value) && value >= 0 && value <= kMaxMoeBalance, flag, " must be a finite number in [0, ",
             kMaxMoeBalance, "] (0: off), got ", value);
    SG_CHECK(value == 0 || o.experts > 0, flag, " (", value, ") balances the MoE blocks' experts: it needs --experts N, "
             "or leave ", flag, " out");
  }
  SG_CHECK(!o.resume || !o.checkpoint.empty(), "--resume needs --checkpoint PATH: the file to continue from");
  check_restart_options(o);
  const bool zero1 = o.dp_mode == DataParallelMode::kZero1;
  SG_CHECK(!(o.skip_nonfinite.value_or(false) && zero1),
           "--skip-nonfinite with --dp-mode zero1: the sharded update's collectives cannot run inside the "
           "conditional node that skips a step (NCCL #1986); use --dp-mode allreduce, or --no-skip-nonfinite");
  if (o.ep == 0) o.ep = 1;  // none, as 1
  // Before the checks of --buckets and --pp, which would not name --ep.
  if (o.ep > 1) check_expert_parallel_options(o);
  if (!o.buckets.empty()) {
    SG_CHECK(o.heads > 0, "--buckets trains sequences of varying length: it needs the sequence model (--heads > 0)");
    SG_CHECK(o.tp == 1 && o.cp == 1 && o.dp <= 1 && o.nproc_per_node <= 1,
             "--buckets runs on one rank for now (no --tp, --cp, --dp or --nproc-per-node)");
    if (o.min_seq_len == 0) o.min_seq_len = std::max<std::int64_t>(o.seq_len / 2, 1);
    SG_CHECK(o.min_seq_len >= 1 && o.min_seq_len <= o.seq_len, "--min-seq-len (", o.min_seq_len,
             ") must be in [1, --seq-len ", o.seq_len, "]");
    if (o.fp8) {
      // Each bucket is a step's token count: the FP8 GEMMs take it in whole tiles, as --batch x --seq-len below.
      const std::int64_t tile = o.fp8->scaling == Fp8Scaling::kBlock ? 128 : 16;
      for (std::int64_t size : parse_buckets(o.buckets, o.batch * o.min_seq_len, o.batch * o.seq_len)) {
        SG_CHECK(size % tile == 0, "--fp8 ", fp8_flag(o.fp8), " with --buckets ", o.buckets.to_string(),
                 ": every bucket's token count must be a multiple of ", tile,
                 " (the FP8 GEMMs' token tiles), but one is ", size, " (--batch ", o.batch, " x --min-seq-len ",
                 o.min_seq_len, " to --seq-len ", o.seq_len, "); give counts that are multiples of ", tile,
                 ", or raise --batch or --min-seq-len");
      }
    }
  } else {
    SG_CHECK(o.min_seq_len == 0, "--min-seq-len goes with --buckets");
  }
  if (o.pp > 1) check_pipeline_options(o);
  SG_CHECK(o.dtype != DType::kFloat16 || o.skip_nonfinite.value_or(!zero1),
           "--dtype fp16 scales the loss and skips the steps whose scaled gradients overflow: it needs the skip "
           "(leave out --no-skip-nonfinite, and use --dp-mode allreduce)");
  // The pipeline's step has no skip (PipelineTrainStep): off by default with --pp, as with ZeRO-1.
  if (!o.skip_nonfinite) o.skip_nonfinite = !zero1 && o.pp == 1;
  SG_CHECK(!o.profile || o.mode == StepMode::kGraph, "--profile profiles the captured step: use it with --mode graph");
  SG_CHECK(!o.profile || o.buckets.empty(), "--profile profiles the one captured step; --buckets captures one per "
           "bucket, which it does not profile yet: leave one of them out");
  SG_CHECK(o.ffn % o.tp == 0, "--ffn (", o.ffn, ") must divide by --tp (", o.tp, "): each rank holds ffn / tp of every block");
  if (o.heads > 0 && o.tp > 1) {
    // Note [Tensor-parallel attention] in layers/multihead_attention.h: heads split over the ranks.
    const std::int64_t kv_heads = o.kv_heads > 0 ? o.kv_heads : o.heads;
    SG_CHECK(o.heads % o.tp == 0, "--heads (", o.heads, ") must divide by --tp (", o.tp,
             "): each rank holds heads / tp of every block's attention heads");
    const bool copies = kv_heads % o.tp != 0;  // each rank holds a copy of the kv head its query heads read
    SG_CHECK(!copies || o.tp % kv_heads == 0, "--kv-heads (", kv_heads, ") and --tp (", o.tp,
             ") must divide one another: each rank holds kv_heads / tp of the key/value heads, or a copy of one "
             "where --tp exceeds --kv-heads");
    SG_CHECK(!copies || !o.fp8, "--fp8 ", fp8_flag(o.fp8), " with --tp (", o.tp, ") above --kv-heads (", kv_heads,
             "): copies of kv heads run their projections in 16 bits only; raise --kv-heads to a multiple of --tp, "
             "or pass --fp8 none");
  }

  if (o.cp > 1) {
    // Note [Context-parallel ResidualStack] in layers/residual_stack.h: what it splits and what it refuses.
    SG_CHECK(o.heads > 0, "--cp ", o.cp, " splits the sequence model's sequences: it needs --heads > 0");
    SG_CHECK(o.experts == 0 && o.dropout == 0, "--cp ", o.cp, " does not support --experts (", o.experts,
             ") or --dropout (", o.dropout, ") yet; pass --experts 0 and --dropout 0, or --cp 1");
  }

  SG_CHECK(o.save_every == 0 || !o.checkpoint.empty(), "--save-every needs --checkpoint PATH: where to save");
  return o;
}

std::optional<kernels::LrSchedule> lr_schedule_of(const TrainerOptions& o) {
  if (o.lr_schedule == kernels::LrScheduleKind::kConstant && o.warmup_steps == 0) return std::nullopt;
  return kernels::LrSchedule{.kind = o.lr_schedule,
                             .base = static_cast<float>(o.lr),
                             .min_lr = static_cast<float>(o.min_lr),
                             .warmup = o.warmup_steps,
                             .total = o.decay_steps > 0 ? o.decay_steps : o.steps};
}

}  // namespace stepgraph::trainer
