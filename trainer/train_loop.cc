#include "trainer/train_loop.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/algorithm_choice.h"
#include "engine/context.h"
#include "engine/error.h"
#include "engine/fp8_recipe.h"
#include "graphs/captured_step.h"
#include "graphs/shared_pool_capture.h"
#include "kernels/gemm.h"
#include "optim/adamw.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/language_model.h"
#include "train/context_parallel_batch.h"
#include "train/language_model_stages.h"
#include "train/pipeline_train_step.h"
#include "train/train_step.h"
#include "checkpoint/atomic_file.h"
#include "trainer/buckets.h"
#include "trainer/checkpoint_layout.h"
#include "checkpoint/checkpoint.h"
#include "trainer/data_source.h"
#include "trainer/distributed.h"
#include "trainer/expert_ranks.h"
#include "trainer/markov_source.h"
#include "trainer/pipeline_ranks.h"
#include "trainer/token_file.h"
#include "trainer/train_state.h"
#include "trainer/watchdog.h"

namespace stepgraph::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::unique_ptr<DataSource> open_data(const TrainerOptions& o) {
  if (!o.data.empty()) return open_token_data(o.data, o.seed);
  return make_markov_source(MarkovConfig{.vocab = o.vocab, .order = o.order, .seed = o.seed, .context = o.context});
}

// Cross-entropy reads 16-byte vectors of logits: the LM head's width is the
// data's vocabulary rounded up to 8 (extra logits are never a label), and
// with tensor parallelism so that each rank's slice holds whole vectors
// (16 / dtype bytes logits per vector).
std::int64_t model_vocab(std::int64_t vocab, std::int64_t tp, DType dtype) {
  const std::int64_t multiple = std::lcm<std::int64_t>(8, tp * static_cast<std::int64_t>(16 / dtype_size(dtype)));
  return (vocab + multiple - 1) / multiple * multiple;
}

LanguageModelConfig model_config(const TrainerOptions& o, std::int64_t vocab) {
  const DType dtype = *o.dtype;
  return LanguageModelConfig{.model = {.hidden = o.hidden,
                                       .ffn = o.ffn,
                                       .layers = o.layers,
                                       .vocab = model_vocab(vocab, o.tp, dtype),
                                       .dtype = dtype,
                                       .seed = static_cast<std::uint32_t>(o.seed),
                                       .experts = o.experts,
                                       .topk = o.topk,
                                       .moe_aux_loss_coef = static_cast<float>(o.moe_aux_loss),
                                       .moe_bias_update_rate = static_cast<float>(o.moe_bias_rate),
                                       .heads = o.heads,
                                       .kv_heads = o.kv_heads,
                                       .overlap = o.overlap,
                                       .fp8 = o.fp8,
                                       .dropout = static_cast<float>(o.dropout)},
                             .context = o.context};
}

// The spelling a checkpoint records for --overlap: the preset's name, or the
// four modes. Checkpoints compare these texts, so a saved spelling is read
// back through the same function (canonical_saved_flags).
std::string overlap_text(const MLPOverlap& overlap) {
  if (overlap == MLPOverlap::uniform(CommOverlap::kNone)) return "none";
  if (overlap == MLPOverlap::uniform(CommOverlap::kBulk)) return "bulk";
  if (overlap == MLPOverlap::overlapped()) return "overlap";
  return fmt::format("{},{},{},{}", comm_overlap_name(overlap.fc1_fprop), comm_overlap_name(overlap.fc2_fprop),
                     comm_overlap_name(overlap.fc2_dgrad), comm_overlap_name(overlap.fc1_dgrad));
}

// A checkpoint's recorded flag texts in the spelling this run records them
// in (overlap_text, BucketSpec::to_string), so a checkpoint that wrote
// "bulk,bulk,bulk,bulk" or "16, 32" still resumes a run of the same values.
// A text that does not parse stays as it is: load_state reports the mismatch.
void canonical_saved_flags(Checkpoint& saved) {
  auto canonical = [&saved](const char* key, auto spelling) {
    const auto recorded = saved.metadata.find(key);
    if (recorded == saved.metadata.end()) return;
    try {
      recorded->second = spelling(recorded->second);
    } catch (const Error&) {
    }
  };
  canonical("config.overlap", [](const std::string& text) { return overlap_text(MLPOverlap::parse(text)); });
  canonical("config.buckets", [](const std::string& text) { return BucketSpec::parse(text).to_string(); });
}

// What must match for a resumed run to continue the saved one exactly (and
// between the ranks of one run).
RunConfig run_config(const TrainerOptions& o, const DataSource& data, int dp) {
  RunConfig config{{"config.dp", std::to_string(dp)},
          {"config.tp", std::to_string(o.tp)},
          {"config.overlap", overlap_text(o.overlap)},
          {"config.dp-mode", std::string(data_parallel_mode_name(o.dp_mode))},
          {"config.layers", std::to_string(o.layers)},
          {"config.hidden", std::to_string(o.hidden)},
          {"config.ffn", std::to_string(o.ffn)},
          {"config.experts", std::to_string(o.experts)},
          {"config.topk", std::to_string(o.topk)},
          {"config.batch", std::to_string(o.batch)},
          {"config.context", std::to_string(o.context)},
          {"config.heads", std::to_string(o.heads)},
          {"config.kv-heads", std::to_string(o.kv_heads)},
          {"config.dtype", std::string(dtype_name(*o.dtype))},
          {"config.fp8", o.fp8 ? std::string(fp8_scaling_name(o.fp8->scaling)) : std::string("none")},
          {"config.lr", fmt::format("{}", o.lr)},
          {"config.seed", std::to_string(o.seed)},
          {"config.data", data.describe()}};
  // Only a scheduled run records its schedule (older checkpoints stay resumable);
  // its total is --steps, so a resume must keep them.
  if (const std::optional<kernels::LrSchedule> schedule = lr_schedule_of(o)) {
    config["config.lr-schedule"] = schedule->to_string();
  }
  if (o.dropout > 0) config["config.dropout"] = fmt::format("{}", o.dropout);  // likewise
  if (o.cp > 1) config["config.cp"] = std::to_string(o.cp);                    // likewise
  if (o.ep > 1) config["config.ep"] = std::to_string(o.ep);                    // likewise
  // The MoE blocks' balancing: the aux loss's gradient and the expert biases (in the checkpoint) shape the run.
  if (o.moe_aux_loss > 0) config["config.moe-aux-loss"] = fmt::format("{}", o.moe_aux_loss);  // likewise
  if (o.moe_bias_rate > 0) config["config.moe-bias-rate"] = fmt::format("{}", o.moe_bias_rate);  // likewise
  if (o.pp > 1) {                                                               // likewise
    config["config.pp"] = std::to_string(o.pp);
    config["config.virtual-stages"] = std::to_string(o.virtual_stages);
    config["config.microbatches"] = std::to_string(o.microbatches);
  }
  if (o.dtype == DType::kFloat16) config["config.loss-scale-interval"] = std::to_string(o.loss_scale_interval);
  // A timed run's picks are in its checkpoints, which a heuristic run must not take.
  if (o.gemm_algorithms != AlgorithmChoice::kHeuristic) {
    config["config.gemm-algorithms"] = algorithm_choice_name(o.gemm_algorithms);
  }
  if (!o.buckets.empty()) {  // the sequence lengths and buckets a resume must draw again
    config["config.buckets"] = o.buckets.to_string();
    config["config.min-seq-len"] = std::to_string(o.min_seq_len);
  }
  return config;
}

// The best mean loss of the sequence model on the Markov source: token i + 1
// of a sequence is predicted from the i + 1 tokens before it, so the first
// positions of each sequence see less than the chain's order.
double sequence_floor(const MarkovSource& source, std::int64_t length) {
  double sum = 0;
  for (std::int64_t i = 0; i < length; ++i) sum += source.conditional_entropy(i + 1);
  return sum / static_cast<double>(length);
}

// Note [Deterministic algorithm choice]: a checkpoint names the library and
// GPU its GEMMs were picked for and, where they were timed, the picks, so the
// resumed run launches the algorithms of the run it continues.
void record_gemm_algorithms(Checkpoint& state, AlgorithmChoice choice, const std::string& library) {
  if (library.empty()) return;
  state.metadata[kGemmLibraryKey] = library;
  if (choice == AlgorithmChoice::kTimed) state.metadata[kGemmAlgorithmsKey] = kernels::export_timed_gemm_algorithms();
}

// Before the first step: adopts a timed run's picks (an Error on another
// library or GPU, where they are not valid) and says where a heuristic run
// resumes elsewhere, whose bits may then differ in the last place.
void resume_gemm_algorithms(const Checkpoint& saved, AlgorithmChoice choice, const std::string& library,
                            std::ostream& out) {
  if (library.empty()) return;
  const auto recorded = saved.metadata.find(kGemmLibraryKey);
  if (choice == AlgorithmChoice::kTimed) {
    const auto picks = saved.metadata.find(kGemmAlgorithmsKey);
    SG_CHECK_CODE(picks != saved.metadata.end(), ErrorCode::kIo,
                  "the checkpoint has no timed GEMM algorithms although its run was --gemm-algorithms timed; it "
                  "was not written by this trainer");
    kernels::adopt_timed_gemm_algorithms(picks->second);
    out << "gemm algorithms: the checkpoint's timed picks adopted\n";
    return;
  }
  if (recorded != saved.metadata.end() && recorded->second != library) {
    out << fmt::format("note: the checkpoint's GEMMs were picked for {}; this run has {}: cuBLASLt may pick other "
                       "algorithms, so the steps after the resume may differ in their last bits from an "
                       "uninterrupted run\n",
                       printable(recorded->second, 200), library);
  }
}

// Which of the MoE blocks' balancing methods run (Note [MoE load balancing]
// in layers/moe_mlp.h), for the setup lines.
std::string moe_balancing_line(const TrainerOptions& o) {
  std::vector<std::string> on;
  if (o.moe_aux_loss > 0) {
    on.push_back(fmt::format("the Switch auxiliary loss x {} (its gradient trains the routers in the step; its value, "
                             "summed over the MoE blocks, is logged as aux beside the loss)",
                             o.moe_aux_loss));
  }
  if (o.moe_bias_rate > 0) {
    on.push_back(fmt::format("the expert bias at rate {} (DeepSeek-V3's aux-loss-free balancing: each block's bias "
                             "on the top-k choice moved toward the mean load after every step, on the device; in "
                             "checkpoints)",
                             o.moe_bias_rate));
  }
  if (on.empty()) return "moe balancing: none (--moe-aux-loss and --moe-bias-rate are 0)\n";
  return fmt::format("moe balancing: {}\n", fmt::join(on, "; "));
}

std::string mebibytes(std::int64_t bytes) { return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / 1048576.0); }

// "\r[step 120/600 20%] loss 2.31" on stderr when it is a terminal, cleared
// before each step line.
class ProgressLine {
 public:
  ProgressLine() : enabled_(isatty(STDERR_FILENO) == 1) {}
  void show(std::int64_t step, std::int64_t steps, float loss) {
    if (!enabled_) return;
    std::fprintf(stderr, "\r[step %lld/%lld %3lld%%] loss %.4f ", static_cast<long long>(step),
                 static_cast<long long>(steps), static_cast<long long>(100 * step / steps), loss);
    std::fflush(stderr);
    shown_ = true;
  }
  void clear() {
    if (!shown_) return;
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    shown_ = false;
  }

 private:
  bool enabled_;
  bool shown_ = false;
};

}  // namespace

TrainResult train(const TrainerOptions& o, Device device, std::ostream& out, Communicator* world) {
  SG_CHECK_CODE(o.dtype.has_value() && o.skip_nonfinite.has_value(), ErrorCode::kInvalidState,
                "train: the options are not resolved (no dtype or non-finite skip chosen); pass them through "
                "resolve_defaults first");
  const int ranks = world != nullptr ? world->world_size() : 1;
  const int rank = world != nullptr ? world->rank() : 0;
  const int tp = static_cast<int>(o.tp);
  const int cp = static_cast<int>(o.cp);
  const int pp = static_cast<int>(o.pp);
  // Note [Pipeline ranks in the trainer]: the world is tp x pp x dp; pipeline_ranks checks it.
  // Note [Expert parallelism in the trainer]: the world is ep x dp ranks; expert_ranks checks it.
  std::optional<PipelineRanks> pipe;
  std::optional<ExpertRanks> experts;
  if (pp > 1) {
    pipe = pipeline_ranks(o, rank, ranks);
  } else if (o.ep > 1) {
    experts = expert_ranks(o, rank, ranks);
  } else if (cp == 1) {
    SG_CHECK(ranks % o.tp == 0, "--tp ", o.tp, " must divide the world of ", ranks,
             " ranks (the world is tp x dp: start a multiple of --tp ranks)");
  } else {
    SG_CHECK(ranks % (tp * cp) == 0, "--tp ", o.tp, " x --cp ", o.cp, " must divide the world of ", ranks,
             " ranks (the world is tp x cp x dp: start a multiple of ", tp * cp, " ranks)");
  }
  // Expert-parallel ranks train their own rows as replicas do, but only each EP group is a replica.
  const int dp = ranks / (tp * cp * pp * static_cast<int>(o.ep));
  SG_CHECK(pp > 1 || experts || o.dp == 0 || o.dp == dp, "--dp ", o.dp, " needs a world of ", o.dp * o.tp * o.cp,
           " ranks, but this run has ", ranks, " (the world is --dp x --tp", cp > 1 ? " x --cp" : "",
           " ranks: start that many, or leave --dp out)");
  SG_CHECK(pp > 1 || o.batch % ranks == 0, "--batch ", o.batch, " is the global batch and must split evenly over the ", ranks,
           " ranks (", dp, " data-parallel x ", o.tp, " tensor-parallel",
           cp > 1 ? fmt::format(" x {} context-parallel", cp) : "", ": each holds its rows)");
  // Each rank's rows of the global batch: rank r holds rows [r b, (r + 1) b),
  // tensor-parallel groups of consecutive ranks (Note [Tensor-parallel ResidualStack]).
  // Context-parallel, a TP x CP group holds its data-parallel share of the
  // rows, each CP rank its zig-zag chunks of their tokens (Note
  // [Context-parallel ResidualStack]), each TP rank its rows of those.
  const std::int64_t local_batch = o.batch / ranks;
  const int tp_rank = rank % tp;
  const int cp_rank = (rank / tp) % cp;
  const int dp_rank = rank / (tp * cp * pp);
  SG_CHECK(cp == 1 || (o.batch / dp * o.context) % (2 * cp) == 0, "--cp ", cp, ": each context-parallel group's ",
           o.batch / dp * o.context, " tokens (--batch ", o.batch, " / ", dp, " data-parallel x --seq-len ", o.context,
           ") must cut into 2 x ", cp, " equal chunks; make them a multiple of ", 2 * cp);
  std::unique_ptr<DataSource> data = open_data(o);
  out << "data: " << data->describe() << "\n";
  TrainResult result;
  result.entropy_rate = data->entropy_rate();
  const bool sequences = o.heads > 0;
  // Predicted tokens per step, all ranks.
  const std::int64_t tokens_per_step = o.batch * (sequences ? o.seq_len : 1);
  if (result.entropy_rate) {
    out << fmt::format("entropy rate: {:.4f} nats/token\n", *result.entropy_rate);
    if (const auto* markov = dynamic_cast<const MarkovSource*>(data.get()); markov != nullptr && sequences) {
      out << fmt::format("best mean loss over sequences of {} tokens: {:.4f} (their first tokens see less than the "
                         "order {})\n",
                         o.seq_len, sequence_floor(*markov, o.seq_len), markov->config().order);
    }
  } else {
    out << "entropy rate: unknown for this data (no loss floor to compare with)\n";
  }

  const RunConfig run = run_config(o, *data, dp);
  if (world != nullptr) check_same_flags(*world, run);  // before any work: a mismatch would hang in NCCL

  // The groups: the whole world for one kind of parallelism, splits for
  // several: tensor groups of consecutive ranks, context groups across them,
  // and the gradients summed over data x context (the ranks of one TP rank).
  std::unique_ptr<Communicator> tp_group;
  std::unique_ptr<Communicator> cp_group;
  std::unique_ptr<Communicator> dp_group;
  Communicator* tp_comm = nullptr;
  Communicator* cp_comm = nullptr;
  Communicator* dp_comm = world;
  // Expert-parallel: each replica's EP group, and the ranks holding the same experts (Note [Expert parallelism in
  // the trainer]); TrainStep's data-parallel group stays the world.
  ExpertGroups expert_comms;
  if (experts) expert_comms = expert_groups(*world, *experts);
  Communicator* const ep_comm = expert_comms.expert_parallel;
  if (tp > 1) {
    tp_comm = world;
    if (tp < ranks) {
      tp_group = world->split(rank / tp, rank, "tp");
      tp_comm = tp_group.get();
    }
  }
  if (cp > 1) {
    cp_comm = world;
    if (cp < ranks) {
      cp_group = world->split(tp_rank + tp * dp_rank, rank, "cp");
      cp_comm = cp_group.get();
    }
  }
  if (tp > 1 && pp == 1) {
    dp_comm = nullptr;
    if (dp * cp > 1) {
      dp_group = world->split(tp_rank, rank, cp > 1 ? "dp x cp" : "dp");
      dp_comm = dp_group.get();
    }
  }
  // The pipeline's: its stages, and each stage's replicas (Note [Pipeline ranks in the trainer]).
  std::unique_ptr<PipelineGroups> pipeline_groups;
  if (pipe) {
    pipeline_groups = std::make_unique<PipelineGroups>(*world, *pipe);
    dp_comm = pipeline_groups->data_parallel();
  }

  // With several ranks the gradient all-reduces run on a stream of their own
  // (stream 2), beside the weight-gradient stream (1).
  Context ctx(device, ranks > 1 ? 2 : 1);
  if (ranks > 1) ctx.set_communication_stream(2);
  ctx.set_algorithm_choice(o.gemm_algorithms);
  // What cuBLASLt's picks depend on; empty on the host, whose GEMMs are ours.
  const std::string gemm_library = device == Device::kCuda ? kernels::gemm_library_identity() : std::string();
  const LanguageModelConfig config = model_config(o, data->vocab());
  // ResidualStack's rule, asked before the model is built to name the flags.
  if (const std::optional<std::string> gap = ResidualStack::tensor_parallel_gap(config.model); gap && o.tp > 1) {
    SG_THROW(ErrorCode::kInvalidArgument, "--tp ", o.tp, ": the model's ", *gap,
             " is not tensor-parallel yet; pass --tp 1, or leave it out (--dropout 0)");
  }
  // One of the two: the whole model (over its TP and CP groups), or this rank's pipeline stage.
  std::unique_ptr<LanguageModel> whole_model;
  std::unique_ptr<LanguageModelStages> stages;
  if (pipe) {
    LanguageModelStagesOptions stage_options{.virtual_stages = static_cast<int>(o.virtual_stages),
                                             .tensor_parallel = tp_comm};
    stage_options.stage.data_parallel = dp_comm;
    stages = std::make_unique<LanguageModelStages>(ctx, pipeline_groups->pipeline(), config, pipe->microbatch_rows,
                                                   pipe->microbatches, stage_options);
  } else {
    whole_model = std::make_unique<LanguageModel>(ctx, config, tp_comm, cp_comm, ep_comm);
  }
  // What a checkpoint holds of the model: the stages hold no state besides their parameters
  // (no FP8 scaling or dropout generator: --pp refuses both).
  const ModelState model_state = stages ? ModelState{stages->parameters(), {}}
                                        : ModelState{whole_model->parameters(), whole_model->state()};
  AdamW optimizer(ctx, model_state.parameters, {.lr = static_cast<float>(o.lr)}, lr_schedule_of(o));
  const bool zero1 = o.dp_mode == DataParallelMode::kZero1;
  optimizer.set_skip_nonfinite(ctx, *o.skip_nonfinite);
  // fp16: dynamic loss scaling on the device (Note [Loss scaling] in kernels/step_guard.h).
  const kernels::LossScaling loss_scaling{.growth_interval = static_cast<int>(o.loss_scale_interval)};
  if (config.model.dtype == DType::kFloat16) optimizer.set_loss_scaling(ctx, loss_scaling);
  std::unique_ptr<TrainStep> train_step;
  std::unique_ptr<PipelineTrainStep> pipeline_step;
  if (stages)
    pipeline_step = std::make_unique<PipelineTrainStep>(*stages, optimizer);
  else
    train_step = std::make_unique<TrainStep>(
        ctx, *whole_model, optimizer, local_batch,
        GradientGroups{.data_parallel = dp_comm,
                       .mode = o.dp_mode,
                       .expert_data_parallel = expert_comms.expert_data_parallel});
  // One step, eager or traced, and the communicators its capture checks.
  const auto step = [&] { return pipeline_step ? (*pipeline_step)(ctx) : (*train_step)(ctx); };
  const std::vector<Communicator*> step_communicators =
      stages ? stages->communicators() : train_step->communicators();
  const std::string moe_blocks = config.model.moe_every == 1
                                     ? std::string("every block an MoE block")
                                     : fmt::format("an MoE block every {} blocks", config.model.moe_every);
  const std::string moe =
      o.experts > 0 ? fmt::format(" ({}: {} experts, top-{})", moe_blocks, o.experts, o.topk) : std::string();
  if (sequences) {
    out << fmt::format(
        "model: GPT, {} TransformerLayers{}, hidden {}, {} heads ({} kv), ffn {}, vocab {}, rotary positions, causal "
        "attention over sequences of {} tokens, {}, batch {} sequences ({} tokens), lr {}; device {}, mode {}\n",
        o.layers, moe, o.hidden, o.heads, o.kv_heads != 0 ? o.kv_heads : o.heads, o.ffn, config.model.vocab,
        o.seq_len, dtype_name(config.model.dtype), o.batch, tokens_per_step, o.lr, device_name(device),
        step_mode_name(o.mode));
  } else {
    out << fmt::format(
        "model: window, {} MLP blocks{}, hidden {}, ffn {}, vocab {}, context {} (embedding width {}), {}, batch {}, "
        "lr {}; device {}, mode {}\n",
        o.layers, moe, o.hidden, o.ffn, config.model.vocab, o.context, config.embedding_dim(),
        dtype_name(config.model.dtype), o.batch, o.lr, device_name(device), step_mode_name(o.mode));
  }
  if (device == Device::kCuda) {
    out << fmt::format("gemm algorithms: {} ({}){}\n", algorithm_choice_name(o.gemm_algorithms), gemm_library,
                       o.gemm_algorithms == AlgorithmChoice::kTimed
                           ? ": the fastest in this process, another run may pick others and get other bits; "
                             "checkpoints keep the picks"
                           : ": the same bits on every run with this binary and GPU model");
  }
  if (o.experts > 0) out << moe_balancing_line(o);
  if (config.model.fp8) {
    out << fmt::format("fp8: the attention projections and MLPs' GEMMs{} in FP8, recipe {}\n",
                       config.model.experts > 0 ? " (the experts' grouped products too)" : "",
                       config.model.fp8->to_string());
  }
  if (o.dropout > 0) {
    out << fmt::format("dropout: {} on the stack's input and every attention and MLP output (Philox, its state on "
                       "the device and in checkpoints)\n",
                       o.dropout);
  }
  if (optimizer.schedule()) {
    out << fmt::format("lr schedule: {} (computed on the device from the step counter)\n",
                       optimizer.schedule()->to_string());
  }
  if (optimizer.scales_loss()) {
    out << fmt::format("loss scaling: dynamic, on the device: from {}, x{} after {} good steps, x{} on overflow\n",
                       loss_scaling.initial_scale, loss_scaling.growth_factor, loss_scaling.growth_interval,
                       loss_scaling.backoff_factor);
  }
  out << (optimizer.skips_nonfinite()
              ? std::string("non-finite steps: skipped on the device (a step whose loss or gradients are NaN or "
                            "infinite changes nothing)\n")
              : fmt::format("non-finite steps: not checked ({})\n",
                            zero1  ? "--dp-mode zero1 does not support the skip"
                            : pipe ? "--pp does not support the skip yet; off by default with --pp"
                                   : "--no-skip-nonfinite"));
  if (stages) out << pipeline_setup_line(*stages, *pipe, o.layers, sequences, dp_comm);
  if (experts) {
    std::int64_t moe_blocks = 0;
    for (std::int64_t i = 0; i < o.layers; ++i) moe_blocks += whole_model->stack().is_moe_block(i) ? 1 : 0;
    out << expert_setup_line(*experts, expert_comms, *world, moe_blocks, local_batch * (sequences ? o.seq_len : 1),
                             o.topk, sequences);
  } else if (dp_comm != nullptr && !pipe) {
    out << fmt::format("data parallel: {} ranks ({}), {} examples each per step, {}\n", dp, dp_comm->describe(),
                       local_batch * o.tp * o.cp, zero1 ? "ZeRO-1 (sharded optimizer)" : "all-reduce");
  }
  if (cp_comm != nullptr) {
    out << fmt::format(
        "context parallel: {} ranks ({}), each {} of its group's {} tokens a step (zig-zag chunks), "
        "attention by all-gather of K/V; gradients summed over {} ranks ({})\n",
        cp, cp_comm->describe(), local_batch * o.tp * o.context, local_batch * o.tp * cp * o.context, dp * cp,
        dp_comm->describe());
  }
  if (tp_comm != nullptr) {
    out << fmt::format("tensor parallel: {} ranks ({}), {} examples each outside the blocks, ffn {} and vocab {} "
                       "per rank; overlap {}; captured ring steps by {} ({})\n",
                       o.tp, tp_comm->describe(), pipe ? o.batch / (dp * tp) : local_batch,
                       o.ffn / o.tp, config.model.vocab / o.tp,
                       config.model.overlap.to_string(), peer_transport_name(tp_comm->peer_transport()),
                       tp_comm->peer_transport_reason());
  }

  // Note [Checkpoint parts in the trainer]: one file, or a part per rank committed by a manifest.
  const CheckpointLayout layout = checkpoint_layout(o, optimizer.sharded());
  const bool per_rank_files = layout.per_rank;
  const std::string& checkpoint_path = o.checkpoint;
  if (!checkpoint_path.empty() && (rank == 0 || per_rank_files)) {
    check_writable_directory(checkpoint_path, "--checkpoint");  // a rank that writes: before training, not after
  }
  std::int64_t done = 0;
  if (o.resume) {
    const ResumeSource source =
        read_resume_checkpoint(checkpoint_path, rank, ranks, layout, run, canonical_saved_flags);
    const Checkpoint& saved = source.checkpoint;
    const Progress progress = load_state(ctx, model_state, optimizer, run, saved);
    SG_CHECK_CODE(!source.manifest_step || progress.step == *source.manifest_step, ErrorCode::kIo,
                  "checkpoint part ", source.file, " is at step ", progress.step, " but its manifest ",
                  checkpoint_path, " is at step ", source.manifest_step.value_or(0));
    resume_gemm_algorithms(saved, o.gemm_algorithms, gemm_library, out);
    SG_CHECK(progress.step < o.steps, "the checkpoint ", checkpoint_path, " is at step ", progress.step,
             ", not before --steps ", o.steps, ": nothing to resume");
    data->seek(progress.data_position);
    done = progress.step;
    out << fmt::format("resumed from {} at step {}\n", checkpoint_path, done);
  }
  auto save = [&](std::int64_t steps_done, std::uint64_t data_position) {
    if (rank != 0 && !per_rank_files) return;
    Checkpoint state = save_state(ctx, model_state, optimizer, run, {steps_done, data_position});
    record_gemm_algorithms(state, o.gemm_algorithms, gemm_library);
    write_rank_checkpoint(checkpoint_path, layout, steps_done, rank, ranks, state, world);
  };

  // On cuda a dead peer leaves this rank waiting inside the device (the
  // capture's exchange, a step's graph): the watchdog ends it
  // (trainer/watchdog.h). On host the collectives run on this thread and
  // time out by themselves.
  std::unique_ptr<Watchdog> watchdog;
  if (ranks > 1 && device == Device::kCuda) {
    watchdog = std::make_unique<Watchdog>(
        *world, std::chrono::milliseconds(static_cast<std::int64_t>(o.comm_timeout_s * 1000)),
        zero1     ? "the loss all-reduce, and per parameter group a gradient reduce-scatter and a weight "
                    "all-gather"
        : experts ? "the loss all-reduce, per parameter group a gradient all-reduce (the experts' over the ranks "
                    "holding them), and every MoE block's exchanges of tokens with the other ranks' experts"
                  : "the loss all-reduce and one gradient all-reduce per parameter group");
  }
  // Note [Shape buckets]: one step per bucket, each over up to local_batch
  // sequences and the padding's (padded_sequences), captured into one shared pool.
  std::vector<std::int64_t> buckets;
  std::vector<std::unique_ptr<TrainStep>> bucket_steps;
  SharedPoolCapture bucket_graphs;
  std::vector<std::int64_t> bucket_uses;
  std::int64_t padded_tokens = 0;
  if (!o.buckets.empty()) {
    buckets = parse_buckets(o.buckets, local_batch * o.min_seq_len, local_batch * o.seq_len);
    for (std::int64_t size : buckets) {
      const TrainStep::PackedTokens packing{.tokens = size,
                                            .sequences = padded_sequences(local_batch, size, o.seq_len)};
      bucket_steps.push_back(std::make_unique<TrainStep>(ctx, *whole_model, optimizer, packing));
    }
    bucket_uses.assign(buckets.size(), 0);
    out << fmt::format("buckets: {} tokens; {} sequences a step of {} to {} tokens each\n",
                       fmt::join(buckets, ", "), local_batch, o.min_seq_len, o.seq_len);
    if (o.mode == StepMode::kGraph) {
      std::vector<CapturedStep::StepFunction> functions;
      for (const auto& bucket_step : bucket_steps) {
        functions.push_back([&ctx, bucket_step = bucket_step.get()] { return (*bucket_step)(ctx); });
      }
      const auto start = Clock::now();
      bucket_graphs = capture_sharing_one_pool(ctx, functions);
      out << fmt::format("captured {} bucket steps in {:.1f} ms into one shared pool of {} (one pool each: {})\n",
                         buckets.size(), seconds_since(start) * 1e3, mebibytes(bucket_graphs.pool->bytes()),
                         mebibytes(bucket_graphs.separate_pool_bytes));
    }
  }
  std::shared_ptr<CapturedStep> graph;
  if (o.mode == StepMode::kGraph && buckets.empty()) {
    if (watchdog) watchdog->start("the capture of the step (the ranks compare their collectives)");
    const auto start = Clock::now();
    graph = CapturedStep::capture(ctx, step, {.communicators = step_communicators});
    const CaptureTimings& t = graph->timings();
    out << fmt::format(
        "captured the step in {:.1f} ms (trace {:.1f}, plan {:.1f}, prepare {:.1f}, capture {:.1f}, instantiate "
        "{:.1f}): {} segment(s), {} instructions\n",
        seconds_since(start) * 1e3, t.trace_ms, t.plan_ms, t.prepare_ms, t.capture_ms, t.instantiate_ms,
        graph->segment_count(), graph->program().instructions().size());
    if (watchdog) watchdog->finish();
  }

  // Note [Drawing the next batch during the step]
  // The next step's batch is drawn on the host while the device runs this
  // step (launches and replays return at once on cuda), so tokens/s measures
  // the step rather than the sampler. `position` is the data position after
  // the batch of the step in flight: what a checkpoint after it records.
  Batch batch;
  Batch next_batch;
  std::vector<std::int32_t> labels;  // the sequence model's, per token
  data->next_batch(o.batch, o.context, batch);
  std::uint64_t position = data->position();
  ProgressLine progress;
  std::deque<float> window;
  double window_sum = 0;
  double total_seconds = 0;
  double interval_seconds = 0;
  std::int64_t interval_steps = 0;
  std::int64_t interval_tokens = 0;  // predicted tokens (with buckets: without the padding)
  std::int64_t total_tokens = 0;
  PackedBatch packed;  // with buckets: the step's batch in its bucket
  // TrainStep returns {loss, aux_loss} with the aux loss on (pipeline stages have no experts).
  const bool aux = o.moe_aux_loss > 0 && !stages;
  result.first_step = done + 1;
  for (std::int64_t s = done + 1; s <= o.steps; ++s) {
    if (watchdog) watchdog->start("step " + std::to_string(s));
    try {
      const auto start = Clock::now();
      std::int64_t step_tokens = tokens_per_step;
      // This rank's slice of the global batch.
      const auto first = static_cast<std::size_t>(rank * local_batch);
      const auto rows = static_cast<std::size_t>(local_batch);
      const auto width = static_cast<std::size_t>(o.context);
      Tensor loss_tensor;
      Tensor aux_tensor;  // with --moe-aux-loss: the step's second output
      const TrainStep* ran = train_step.get();
      if (!buckets.empty()) {  // Note [Shape buckets]
        const std::vector<std::int64_t> lengths =
            sequence_lengths(static_cast<std::uint64_t>(o.seed), s, local_batch, o.min_seq_len, o.seq_len);
        std::int64_t total = 0;
        for (std::int64_t length : lengths) total += length;
        const std::size_t b = bucket_for(buckets, total);
        pack_into_bucket(batch, first, width, lengths, buckets[b], padded_sequences(local_batch, buckets[b], o.seq_len),
                         packed);
        ran = bucket_steps[b].get();
        ctx.copy_from_host(ran->inputs(), packed.tokens.data(), packed.tokens.size() * sizeof(std::int32_t));
        ctx.copy_from_host(ran->labels(), packed.labels.data(), packed.labels.size() * sizeof(std::int32_t));
        ctx.copy_from_host(ran->packing(), packed.cu_seqlens.data(), packed.cu_seqlens.size() * sizeof(std::int32_t));
        std::vector<Tensor> outputs;
        if (o.mode == StepMode::kGraph) {
          bucket_graphs.steps[b]->replay();
          outputs = bucket_graphs.steps[b]->outputs();
        } else {
          outputs = (*ran)(ctx);
        }
        loss_tensor = outputs.at(0);
        if (aux) aux_tensor = outputs.at(1);
        ++bucket_uses[b];
        padded_tokens += buckets[b] - packed.real_tokens;
        step_tokens = packed.real_tokens;
      } else {
        if (stages) {
          load_microbatches(ctx, *stages, batch, *pipe, sequences, o.context);
        } else if (cp > 1) {
          // The group's tokens and next-token labels, then this rank's share.
          const auto group_rows = static_cast<std::size_t>(o.batch / dp);
          const std::size_t group_first = static_cast<std::size_t>(dp_rank) * group_rows;
          const std::span<const std::int32_t> group_tokens(batch.windows.data() + group_first * width,
                                                           group_rows * width);
          next_token_labels(batch, group_first, group_rows, width, labels);
          const std::size_t n = rows * width;
          const auto mine = [&](std::span<const std::int32_t> all) {
            std::vector<std::int32_t> chunks = context_parallel_rows(all, 1, cp, cp_rank);
            return std::vector<std::int32_t>(chunks.begin() + tp_rank * n, chunks.begin() + (tp_rank + 1) * n);
          };
          const std::vector<std::int32_t> my_tokens = mine(group_tokens);
          const std::vector<std::int32_t> my_labels = mine(labels);
          ctx.copy_from_host(train_step->inputs(), my_tokens.data(), n * sizeof(std::int32_t));
          ctx.copy_from_host(train_step->labels(), my_labels.data(), n * sizeof(std::int32_t));
        } else if (sequences) {
          // The sequence model's tokens [rows * width, 1] are the windows' bytes.
          ctx.copy_from_host(train_step->inputs(), batch.windows.data() + first * width, rows * width * sizeof(std::int32_t));
          next_token_labels(batch, first, rows, width, labels);
          ctx.copy_from_host(train_step->labels(), labels.data(), labels.size() * sizeof(std::int32_t));
        } else {
          ctx.copy_from_host(train_step->inputs(), batch.windows.data() + first * width, rows * width * sizeof(std::int32_t));
          ctx.copy_from_host(train_step->labels(), batch.labels.data() + first, rows * sizeof(std::int32_t));
        }
        std::vector<Tensor> outputs;
        if (graph) {
          graph->replay();
          outputs = graph->outputs();
        } else {
          outputs = step();
        }
        loss_tensor = outputs.at(0);
        if (aux) aux_tensor = outputs.at(1);
      }
      std::uint64_t next_position = position;
      if (s < o.steps) {
        data->next_batch(o.batch, o.context, next_batch);
        next_position = data->position();
      }
      const float loss = ctx.to_vector<float>(loss_tensor).at(0);
      const float aux_loss = aux ? ctx.to_vector<float>(aux_tensor).at(0) : 0.0f;
      if (stages)
        stages->check_errors(ctx);
      else
        ran->check_errors(ctx);
      if (watchdog) watchdog->finish();
      const double seconds = seconds_since(start);
      total_seconds += seconds;
      interval_seconds += seconds;
      ++interval_steps;
      interval_tokens += step_tokens;
      total_tokens += step_tokens;

      result.losses.push_back(loss);
      if (aux) result.aux_losses.push_back(aux_loss);
      window.push_back(loss);
      window_sum += loss;
      if (static_cast<std::int64_t>(window.size()) > kFloorWindow) {
        window_sum -= window.front();
        window.pop_front();
      }
      const double window_mean = window_sum / static_cast<double>(window.size());
      if (result.entropy_rate && !result.floor_step && static_cast<std::int64_t>(window.size()) == kFloorWindow &&
          window_mean <= *result.entropy_rate + kFloorMargin) {
        result.floor_step = s;
      }

      if (s % o.log_every == 0 || s == o.steps) {
        progress.clear();
        // With a schedule, the rate this step's update used (read from the device).
        const std::string rate = optimizer.schedule() ? fmt::format(" lr {:.3g}", optimizer.lr(ctx)) : "";
        const std::int64_t skipped = optimizer.skipped_steps(ctx);
        const std::string skips = skipped > 0 ? fmt::format(" skipped {}", skipped) : "";
        const std::string scale = optimizer.scales_loss() ? fmt::format(" loss_scale {:g}", optimizer.loss_scale(ctx))
                                                          : "";
        const std::string aux_text = aux ? fmt::format(" aux {:.4g}", aux_loss) : "";
        out << fmt::format("step {} loss {:.4f}{} tokens/s {:.0f} step_ms {:.2f}{}{}{}\n", s, loss, aux_text,
                           static_cast<double>(interval_tokens) / interval_seconds,
                           interval_seconds * 1e3 / static_cast<double>(interval_steps), rate, skips, scale);
        out.flush();
        interval_seconds = 0;
        interval_steps = 0;
        interval_tokens = 0;
      } else {
        progress.show(s, o.steps, loss);
      }
      if (!o.checkpoint.empty() && o.save_every > 0 && s % o.save_every == 0 && s != o.steps) save(s, position);
      std::swap(batch, next_batch);
      position = next_position;
    } catch (const Error& error) {
      // Which step failed: with several ranks, what the others were doing then.
      SG_THROW(error.code(), "step ", s, ": ", error.message());
    }
  }
  progress.clear();
  if (!o.checkpoint.empty()) {
    save(o.steps, position);
    out << "checkpoint: "
        << o.checkpoint << (per_rank_files ? " (the manifest of one file per rank: " + layout.why + ")" : "")
        << " at step " << o.steps << "\n";
  }

  const auto steps_run = static_cast<std::int64_t>(result.losses.size());
  result.mean_tokens_per_s = steps_run > 0 ? static_cast<double>(total_tokens) / total_seconds : 0.0;
  result.final_mean_loss = window.empty() ? 0.0 : window_sum / static_cast<double>(window.size());
  out << fmt::format("summary: {} steps, mean tokens/s {:.0f}, mean step_ms {:.3f}\n", steps_run,
                     result.mean_tokens_per_s, steps_run > 0 ? total_seconds * 1e3 / steps_run : 0.0);
  if (optimizer.skips_nonfinite()) {
    out << fmt::format("non-finite steps skipped: {} (their updates did not run)\n", optimizer.skipped_steps(ctx));
  }
  if (optimizer.scales_loss()) out << fmt::format("loss scale at the end: {:g}\n", optimizer.loss_scale(ctx));
  if (config.model.fp8) {
    out << fmt::format("fp8: {} quantizations met a non-finite amax (their scales kept)\n",
                       whole_model->non_finite_amaxes(ctx));
  }
  if (result.entropy_rate) {
    out << fmt::format("final loss (mean of the last {} steps) {:.4f}, {:+.4f} nats from the entropy rate {:.4f}; ",
                       window.size(), result.final_mean_loss, result.final_mean_loss - *result.entropy_rate,
                       *result.entropy_rate);
    out << (result.floor_step ? fmt::format("within {} nats from step {}\n", kFloorMargin, *result.floor_step)
                              : fmt::format("not within {} nats\n", kFloorMargin));
  } else {
    out << fmt::format("final loss (mean of the last {} steps) {:.4f}\n", window.size(), result.final_mean_loss);
  }
  if (!buckets.empty()) {
    std::vector<std::string> uses;
    for (std::size_t b = 0; b < buckets.size(); ++b) uses.push_back(fmt::format("{}: {}", buckets[b], bucket_uses[b]));
    out << fmt::format("buckets used (tokens: steps): {}; padding {:.1f}% of the tokens run\n", fmt::join(uses, ", "),
                       total_tokens + padded_tokens > 0
                           ? 100.0 * static_cast<double>(padded_tokens) / static_cast<double>(total_tokens + padded_tokens)
                           : 0.0);
    if (bucket_graphs.pool) {
      out << fmt::format("pool: one shared pool of {} ({} bytes) for {} buckets; one pool each would take {} ({} bytes)\n",
                         mebibytes(bucket_graphs.pool->bytes()), bucket_graphs.pool->bytes(), buckets.size(),
                         mebibytes(bucket_graphs.separate_pool_bytes), bucket_graphs.separate_pool_bytes);
    }
  }
  if (graph) {
    const StepPlan& plan = graph->plan();
    const CaptureTimings& t = graph->timings();
    out << fmt::format("pool: {} ({} bytes), lower bound {} ({} bytes), ratio {:.3f}\n", mebibytes(plan.pool_bytes),
                       plan.pool_bytes, mebibytes(plan.lower_bound_bytes), plan.lower_bound_bytes,
                       plan.ratio_to_lower_bound());
    out << fmt::format("capture+instantiate: {:.1f} ms\n", t.trace_ms + t.plan_ms + t.capture_ms + t.instantiate_ms);
    if (o.profile) out << graph->profile().to_string();
    out << "pool report: "
        << (graph->report().empty() ? "every pool tensor is returned or freed (0 held)" : graph->report().to_string())
        << "\n";
  } else if (!bucket_graphs.pool) {
    const MemoryStats stats = ctx.memory_stats();
    out << fmt::format("eager peak memory: {} ({} bytes) of transient tensors; persistent {}\n",
                       mebibytes(stats.eager_peak_bytes), stats.eager_peak_bytes, mebibytes(stats.persistent_bytes));
  }
  return result;
}

}  // namespace stepgraph::trainer
