// The trainer's loop and flags, on the host (cuda where there is a GPU): eager
// and graphed runs give identical losses step for step; a run stopped at a
// checkpoint and resumed continues exactly like an uninterrupted one; a
// checkpoint of another configuration, a missing one and bad flags are clear
// errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/error.h"
#include "tests/support/gpu.h"
#include "tests/trainer/small_model.h"
#include "trainer/options.h"
#include "trainer/token_file.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

// A small, fast configuration; bf16 unless a test says otherwise. The
// sequence model (2 heads, 4 sequences of 8 tokens), or with `window` the
// window model (16 examples of 2 tokens).
TrainerOptions small_options(Device device, bool window = false) {
  return resolve_defaults(
      testing::small_model_flags(window ? testing::SmallModel::kWindow : testing::SmallModel::kSequence,
                                 {.steps = 20, .log_every = 5, .dtype = DType::kBFloat16, .seed = 11}),
      device);
}

std::uint32_t bits(float value) {
  std::uint32_t out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

void expect_same_losses(const std::vector<float>& got, const std::vector<float>& want, std::int64_t first_step) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(bits(got[i]), bits(want[i]))
        << "step " << first_step + static_cast<std::int64_t>(i) << ": " << got[i] << " vs " << want[i];
  }
}

std::filesystem::path temp_path(const std::string& name) { return std::filesystem::path(::testing::TempDir()) / name; }

// `o` trained eagerly, then graphed: the same losses bit for bit. Both runs log to `log`.
TrainResult expect_graph_losses_equal_eager(TrainerOptions o, Device device, std::ostream& log) {
  o.mode = StepMode::kEager;
  const TrainResult eager = train(o, device, log);
  o.mode = StepMode::kGraph;
  TrainResult graph = train(o, device, log);
  expect_same_losses(graph.losses, eager.losses, 1);
  return graph;
}

void expect_eager_equals_graph(Device device, std::int64_t experts = 0, bool window = false) {
  TrainerOptions o = small_options(device, window);
  o.experts = experts;
  std::ostringstream log;
  const TrainResult graph = expect_graph_losses_equal_eager(o, device, log);
  ASSERT_EQ(graph.losses.size(), 20u);
  EXPECT_LT(graph.losses.back(), graph.losses.front()) << log.str();
}

TEST(TrainerHostTest, EagerAndGraphLossesAreEqualOverTwentySteps) { expect_eager_equals_graph(Device::kHost); }

TEST(TrainerHostTest, MoeEagerAndGraphLossesAreEqualOverTwentySteps) { expect_eager_equals_graph(Device::kHost, 4); }

TEST(TrainerHostTest, WindowModelEagerAndGraphLossesAreEqualOverTwentySteps) {
  expect_eager_equals_graph(Device::kHost, 0, /*window=*/true);
}

TEST(TrainerCudaTest, MoeEagerAndGraphLossesAreEqualOverTwentySteps) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph(Device::kCuda, 4);
}

TEST(TrainerCudaTest, EagerAndGraphLossesAreEqualOverTwentySteps) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph(Device::kCuda);
}

// The default cuda run (./bazelw run //trainer on a GPU machine) reaches the
// entropy rate + kFloorMargin, like the host's (trainer_default_run_test).
TEST(TrainerCudaTest, CudaDefaultsReachTheEntropyRate) {
  SG_SKIP_WITHOUT_GPU();
  const TrainerOptions o = resolve_defaults(TrainerOptions{}, Device::kCuda);
  std::ostringstream log;
  const TrainResult result = train(o, Device::kCuda, log);
  std::cout << log.str();
  ASSERT_TRUE(result.entropy_rate.has_value());
  EXPECT_LE(result.final_mean_loss, *result.entropy_rate + kFloorMargin) << log.str();
  EXPECT_TRUE(result.floor_step.has_value()) << log.str();
}

// Each FP8 recipe on the cuda defaults reaches the entropy rate + kFloorMargin, as bf16 does.
TEST(TrainerCudaTest, Fp8RecipesReachTheEntropyRate) {
  SG_SKIP_WITHOUT_GPU();
  for (const char* recipe : {"current", "delayed", "block"}) {
    TrainerOptions o;
    o.fp8 = Fp8Recipe::of(parse_fp8_scaling(recipe));
    o = resolve_defaults(o, Device::kCuda);
    std::ostringstream log;
    const TrainResult result = train(o, Device::kCuda, log);
    std::cout << log.str();
    ASSERT_TRUE(result.entropy_rate.has_value());
    EXPECT_LE(result.final_mean_loss, *result.entropy_rate + kFloorMargin) << recipe << "\n" << log.str();
  }
}

TEST(TrainerHostTest, LogHasStepLinesAndASummary) {
  TrainerOptions o = small_options(Device::kHost);
  std::ostringstream log;
  train(o, Device::kHost, log);
  const std::string text = log.str();
  EXPECT_NE(text.find("entropy rate: "), std::string::npos) << text;
  EXPECT_NE(text.find("\nstep 5 loss "), std::string::npos) << text;
  EXPECT_NE(text.find("\nstep 20 loss "), std::string::npos) << text;
  EXPECT_NE(text.find(" tokens/s "), std::string::npos) << text;
  EXPECT_NE(text.find(" step_ms "), std::string::npos) << text;
  EXPECT_NE(text.find("summary: 20 steps, mean tokens/s "), std::string::npos) << text;
  EXPECT_NE(text.find("pool: "), std::string::npos) << text;
  EXPECT_NE(text.find("capture+instantiate: "), std::string::npos) << text;
  EXPECT_NE(text.find("pool report: "), std::string::npos) << text;
  EXPECT_NE(text.find("non-finite steps: skipped on the device"), std::string::npos) << text;
  EXPECT_NE(text.find("non-finite steps skipped: 0 "), std::string::npos) << text;
  o.mode = StepMode::kEager;
  std::ostringstream eager_log;
  train(o, Device::kHost, eager_log);
  EXPECT_NE(eager_log.str().find("eager peak memory: "), std::string::npos) << eager_log.str();
}

void expect_resume_equals_uninterrupted(const std::string& dtype, const std::string& mode,
                                        const std::string& fp8 = "none", const std::string& lr_schedule = "constant",
                                        double dropout = 0, std::int64_t loss_scale_interval = 2000,
                                        const std::string& buckets = "") {
  TrainerOptions o = small_options(Device::kHost);
  o.dtype = parse_dtype(dtype);
  o.loss_scale_interval = loss_scale_interval;
  if (!buckets.empty()) {
    o.buckets = BucketSpec::parse(buckets);
    o.min_seq_len = 3;
  }
  o.mode = mode == "eager" ? StepMode::kEager : StepMode::kGraph;
  o.dropout = dropout;
  if (lr_schedule != "constant") {  // decaying over the uninterrupted run's 24 steps, whatever --steps says
    o.lr_schedule = kernels::parse_lr_schedule_kind(lr_schedule);
    o.warmup_steps = 4;
    o.min_lr = o.lr / 10;
    o.decay_steps = 24;
  }
  if (fp8 != "none") {  // FP8's 16-multiples
    o.hidden = 64;
    o.ffn = 128;
    o.batch = 2;
    o.seq_len = 16;
    o.fp8 = Fp8Recipe::of(parse_fp8_scaling(fp8));
  }
  o.steps = 24;
  std::ostringstream log;
  const TrainResult whole = train(o, Device::kHost, log);

  const std::filesystem::path path =
      temp_path("resume_" + dtype + "_" + mode + "_" + fp8 + "_" + lr_schedule + (dropout > 0 ? "_dropout" : "") +
                "_" + std::to_string(loss_scale_interval) + (buckets.empty() ? "" : "_buckets") + ".safetensors");
  std::filesystem::remove(path);
  o.checkpoint = path.string();
  o.save_every = 5;
  o.steps = 13;  // saves at 5, 10 and 13
  const TrainResult first = train(o, Device::kHost, log);
  expect_same_losses(first.losses, std::vector<float>(whole.losses.begin(), whole.losses.begin() + 13), 1);
  o.steps = 24;
  o.resume = true;
  const TrainResult rest = train(o, Device::kHost, log);
  EXPECT_EQ(rest.first_step, 14);
  expect_same_losses(rest.losses, std::vector<float>(whole.losses.begin() + 13, whole.losses.end()), 14);
}

// FP8: eager equals graph with each recipe the small model takes
// (block needs 128-multiples; the GPU test below runs it), and delayed
// scaling's histories and scales go into the checkpoint, so a resumed run
// continues exactly.
TEST(TrainerHostTest, Fp8EagerAndGraphLossesAreEqual) {
  // Dense blocks, then MoE blocks with FP8 experts (Note [FP8 GroupedLinear]).
  for (std::int64_t experts : {0, 4}) {
    for (const char* recipe : {"current", "delayed"}) {
      SCOPED_TRACE(std::string(recipe) + (experts > 0 ? " moe" : " dense"));
      TrainerOptions o = small_options(Device::kHost);
      o.hidden = 64;
      o.ffn = 128;
      o.batch = 2;
      o.seq_len = 16;
      o.experts = experts;
      o.fp8 = Fp8Recipe::of(parse_fp8_scaling(recipe));
      std::ostringstream log;
      expect_graph_losses_equal_eager(o, Device::kHost, log);
      EXPECT_NE(log.str().find("fp8: the attention projections"), std::string::npos) << log.str();
      if (experts > 0) EXPECT_NE(log.str().find("the experts' grouped products too"), std::string::npos) << log.str();
      EXPECT_NE(log.str().find("fp8: 0 quantizations met a non-finite amax"), std::string::npos) << log.str();
    }
  }
}

TEST(TrainerHostTest, ResumedFp8DelayedRunEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("bf16", "graph", "delayed");
}

// Note [Learning-rate schedule]: the rate of each step from the device step
// counter, so a resumed run continues the schedule where it stopped.
TEST(TrainerHostTest, ResumedCosineScheduledRunEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("bf16", "graph", "none", "cosine");
}

// Note [Dropout in a captured step]: the generator's state is in the
// checkpoint, so the resumed run draws the masks the uninterrupted one drew.
TEST(TrainerHostTest, ResumedDropoutRunEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("bf16", "graph", "none", "constant", 0.1);
}

// Note [Loss scaling]: fp16 with the scale doubling every 3 good steps, so it
// climbs until the scaled gradients overflow, backs off, and skips those
// steps; the scale and its run of good steps are in the checkpoint, so the
// resumed run overflows where the uninterrupted one did.
TEST(TrainerHostTest, ResumedFp16RunWithItsLossScaleEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("fp16", "graph", "none", "constant", 0, /*loss_scale_interval=*/3);
}

TEST(TrainerHostTest, Fp16RunScalesItsLossEagerAndGraphAlike) {
  TrainerOptions o = small_options(Device::kHost);
  o.dtype = DType::kFloat16;
  o.loss_scale_interval = 3;
  o.steps = 30;
  o.log_every = 1;
  std::ostringstream log;
  expect_graph_losses_equal_eager(o, Device::kHost, log);
  const std::string text = log.str();
  EXPECT_NE(text.find("loss scaling: dynamic, on the device: from 65536, x2 after 3 good steps"), std::string::npos)
      << text;
  EXPECT_NE(text.find(" loss_scale "), std::string::npos) << text;
  // From 2^16, doubling every 3 steps, the scaled loss gradient overflows fp16 within 30 steps: skipped, backed off.
  EXPECT_NE(text.find(" skipped "), std::string::npos) << text;
  EXPECT_NE(text.find("loss scale at the end: "), std::string::npos) << text;
}

// Note [Shape buckets]: sequences of 3 to 8 tokens, 4 a step, in buckets of
// 16 and 32 tokens; eager (the bucket steps run directly) equals graphed
// (one capture each, one shared pool), and the pool is smaller than one per bucket.
TEST(TrainerHostTest, BucketedEagerAndGraphLossesAreEqualInOneSharedPool) {
  TrainerOptions o = small_options(Device::kHost);
  o.buckets = BucketSpec{.pow2 = true};
  o.min_seq_len = 3;
  std::ostringstream log;
  const TrainResult graph = expect_graph_losses_equal_eager(o, Device::kHost, log);
  EXPECT_LT(graph.losses.back(), graph.losses.front()) << log.str();
  const std::string text = log.str();
  EXPECT_NE(text.find("buckets: 16, 32 tokens; 4 sequences a step of 3 to 8 tokens each"), std::string::npos)
      << text;
  EXPECT_NE(text.find("captured 2 bucket steps in "), std::string::npos) << text;
  EXPECT_NE(text.find("pool: one shared pool of "), std::string::npos) << text;
  EXPECT_NE(text.find("buckets used (tokens: steps): 16: "), std::string::npos) << text;
}

// The lengths come from the seed and the step, so a resumed run packs the same buckets.
TEST(TrainerHostTest, ResumedBucketedRunEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("bf16", "graph", "none", "constant", 0, 2000, "16,32");
}

TEST(TrainerHostTest, ResumedBf16GraphRunEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("bf16", "graph");
}
TEST(TrainerHostTest, ResumedFp32EagerRunEqualsAnUninterruptedOne) {
  expect_resume_equals_uninterrupted("fp32", "eager");
}

// `call` throws Error with `code` whose message contains `needle`.
template <typename Call>
void expect_error(Call&& call, ErrorCode code, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no Error; expected one mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code) << error.message();
    EXPECT_NE(error.message().find(needle), std::string::npos) << error.message();
  }
}

// train() reads what resolve_defaults decides; options that skipped it are named, not guessed.
TEST(TrainerHostTest, UnresolvedOptionsAreAClearError) {
  std::ostringstream log;
  expect_error([&] { train(TrainerOptions{}, Device::kHost, log); }, ErrorCode::kInvalidState,
               "pass them through resolve_defaults first");
}

TEST(TrainerHostTest, Fp16WithoutTheNonFiniteSkipIsAClearError) {
  TrainerOptions o;  // as parsed from --dtype fp16 --no-skip-nonfinite
  o.dtype = DType::kFloat16;
  o.skip_nonfinite = false;
  expect_error([&] { resolve_defaults(o, Device::kHost); }, ErrorCode::kInvalidArgument, "needs the skip");
}

TEST(TrainerHostTest, ResumingWithAnotherConfigurationOrNoFileIsAClearError) {
  TrainerOptions o = small_options(Device::kHost);
  const std::filesystem::path path = temp_path("mismatch.safetensors");
  std::filesystem::remove(path);
  o.checkpoint = path.string();
  o.resume = true;
  std::ostringstream log;
  expect_error([&] { train(o, Device::kHost, log); }, ErrorCode::kIo, "mismatch.safetensors");

  o.resume = false;
  o.steps = 3;
  train(o, Device::kHost, log);
  o.resume = true;
  o.steps = 6;
  o.hidden = 64;
  expect_error([&] { train(o, Device::kHost, log); }, ErrorCode::kInvalidArgument,
               "config.hidden: checkpoint 32, this run 64");
  o.hidden = 32;
  o.steps = 3;
  expect_error([&] { train(o, Device::kHost, log); }, ErrorCode::kInvalidArgument, "nothing to resume");
}

TEST(TrainerHostTest, ScheduledEagerAndGraphLossesAreEqualAndTheLogShowsTheRate) {
  TrainerOptions o = small_options(Device::kHost);
  o.lr_schedule = kernels::LrScheduleKind::kLinear;
  o.warmup_steps = 3;
  o.min_lr = 1e-4;
  std::ostringstream log;
  expect_graph_losses_equal_eager(o, Device::kHost, log);
  EXPECT_NE(log.str().find("lr schedule: linear base="), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("step 20 loss"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find(" lr 0.0001\n"), std::string::npos) << "the last step's rate is the floor: " << log.str();
  // A schedule is part of the run: a resume with another one is refused.
  const std::filesystem::path path = temp_path("schedule_mismatch.safetensors");
  std::filesystem::remove(path);
  o.checkpoint = path.string();
  o.steps = 5;
  o.decay_steps = 20;
  train(o, Device::kHost, log);
  o.resume = true;
  o.steps = 10;
  o.lr_schedule = kernels::LrScheduleKind::kCosine;
  expect_error([&] { train(o, Device::kHost, log); }, ErrorCode::kInvalidArgument, "config.lr-schedule");
}

TEST(TrainerHostTest, TrainsOnATokenFileWhoseVocabularyIsNotAMultipleOfEight) {
  // A repeating 0 1 2 3 4 pattern over 5 tokens: the next token is determined,
  // so the loss must fall well below log 5; the LM head is 8 wide.
  std::vector<std::int32_t> tokens(4000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i % 5);
  const std::filesystem::path path = temp_path("pattern.tokens");
  write_token_file(path, 5, tokens);
  TrainerOptions o;
  o.data = path.string();
  o.steps = 60;
  o.batch = 32;
  o.lr = 1e-2;
  o = resolve_defaults(o, Device::kHost);
  std::ostringstream log;
  const TrainResult result = train(o, Device::kHost, log);
  EXPECT_FALSE(result.entropy_rate.has_value());
  EXPECT_NE(log.str().find("vocab 8"), std::string::npos) << log.str();
  EXPECT_LT(result.losses.back(), 0.5) << log.str();
}

ParsedCommandLine parse(std::vector<std::string> args) { return parse_command_line(args); }

TEST(TrainerOptionsTest, BadFlagsGiveClearErrors) {
  auto expect_parse_error = [](std::vector<std::string> args, const std::string& needle) {
    const ParsedCommandLine parsed = parse(args);
    EXPECT_FALSE(parsed.options.has_value()) << args[0];
    EXPECT_NE(parsed.exit_code, 0) << args[0];
    EXPECT_NE(parsed.message.find(needle), std::string::npos) << parsed.message;
    EXPECT_NE(parsed.message.find("--help"), std::string::npos) << parsed.message;
  };
  expect_parse_error({"--bogus"}, "--bogus");
  expect_parse_error({"--mode", "fast"}, "fast");
  expect_parse_error({"--device", "tpu"}, "tpu");
  expect_parse_error({"--steps", "0"}, "--steps");
  expect_parse_error({"--steps", "ten"}, "ten");
  expect_parse_error({"--lr", "-1"}, "--lr");

  const ParsedCommandLine help = parse({"--help"});
  EXPECT_FALSE(help.options.has_value());
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.message.find("--log-every"), std::string::npos) << help.message;
  // The choices are listed, and the defaults stated are the ones resolve_defaults fills.
  EXPECT_NE(help.message.find("{bf16,fp16,fp32}"), std::string::npos) << help.message;
  EXPECT_NE(help.message.find("{allreduce,zero1}"), std::string::npos) << help.message;
  EXPECT_NE(help.message.find("default: 0 on the host, 8 on cuda"), std::string::npos) << help.message;
  EXPECT_EQ(resolve_defaults(TrainerOptions{}, Device::kHost).heads, 0);
  EXPECT_EQ(resolve_defaults(TrainerOptions{}, Device::kCuda).heads, 8);

  auto resolved = [](std::vector<std::string> args) {
    return resolve_defaults(*parse(std::move(args)).options, Device::kHost);
  };
  expect_error(
      [&] {
        resolved({"--heads", "0", "--hidden", "50", "--context", "4"});
      },
      ErrorCode::kInvalidArgument, "must be a multiple of --context");
  expect_error([&] { resolved({"--hidden", "50", "--heads", "4"}); }, ErrorCode::kInvalidArgument,
               "--hidden (50) must be a multiple of --heads (4)");
  expect_error([&] { resolved({"--heads", "4", "--kv-heads", "3"}); }, ErrorCode::kInvalidArgument,
               "--kv-heads (3) must divide --heads (4)");
  expect_error([&] { resolved({"--heads", "4", "--context", "4"}); }, ErrorCode::kInvalidArgument,
               "the sequence model's context is --seq-len");
  expect_error([&] { resolved({"--seq-len", "16"}); }, ErrorCode::kInvalidArgument,
               "--seq-len and --kv-heads are the sequence model's");
  expect_error([&] { resolved({"--resume"}); }, ErrorCode::kInvalidArgument, "--resume needs --checkpoint");
  expect_error([&] { resolved({"--save-every", "5"}); }, ErrorCode::kInvalidArgument, "--save-every needs");
  // The router takes one or two experts a token (kernels::kMaxTopk): a third is refused at the flag, naming it,
  // not later by the model.
  expect_parse_error({"--experts", "4", "--topk", "3"}, "--topk");
  expect_error([&] { resolved({"--data", "x.txt", "--vocab", "8"}); }, ErrorCode::kInvalidArgument, "--vocab");
  expect_parse_error({"--lr-schedule", "step"}, "--lr-schedule: step not in {constant,cosine,linear}");
  expect_error([&] { resolved({"--lr-schedule", "cosine", "--steps", "10", "--warmup-steps", "10"}); },
               ErrorCode::kInvalidArgument, "--warmup-steps (10) must be fewer");
  expect_error([&] { resolved({"--lr", "1e-3", "--min-lr", "1e-2", "--lr-schedule", "cosine"}); },
               ErrorCode::kInvalidArgument, "--min-lr (0.01) must not exceed --lr");
  expect_error([&] { resolved({"--min-lr", "1e-4"}); }, ErrorCode::kInvalidArgument, "with --lr-schedule constant");
  expect_error([&] { resolved({"--dp-mode", "zero1", "--skip-nonfinite"}); }, ErrorCode::kInvalidArgument,
               "--skip-nonfinite with --dp-mode zero1");
}

TEST(TrainerOptionsTest, NonFiniteStepsAreSkippedByDefaultButNotWithZeroOne) {
  auto resolved = [](std::vector<std::string> args) {
    return resolve_defaults(*parse(std::move(args)).options, Device::kHost);
  };
  EXPECT_EQ(resolved({}).skip_nonfinite, std::optional<bool>(true));
  EXPECT_EQ(resolved({"--no-skip-nonfinite"}).skip_nonfinite, std::optional<bool>(false));
  EXPECT_EQ(resolved({"--skip-nonfinite"}).skip_nonfinite, std::optional<bool>(true));
  EXPECT_EQ(resolved({"--dp-mode", "zero1"}).skip_nonfinite, std::optional<bool>(false));
}

TEST(TrainerOptionsTest, EveryFlagOfTheIssueParses) {
  const ParsedCommandLine parsed = parse({"--device",
                                          "host",
                                          "--mode",
                                          "eager",
                                          "--steps",
                                          "7",
                                          "--layers",
                                          "3",
                                          "--hidden",
                                          "48",
                                          "--ffn",
                                          "96",
                                          "--experts",
                                          "4",
                                          "--topk",
                                          "1",
                                          "--batch",
                                          "9",
                                          "--heads",
                                          "0",
                                          "--context",
                                          "3",
                                          "--lr",
                                          "0.02",
                                          "--seed",
                                          "5",
                                          "--log-every",
                                          "2",
                                          "--checkpoint",
                                          "c.safetensors",
                                          "--resume",
                                          "--save-every",
                                          "4"});
  ASSERT_TRUE(parsed.options.has_value()) << parsed.message;
  const TrainerOptions o = resolve_defaults(*parsed.options, Device::kHost);
  EXPECT_EQ(o.device, Device::kHost);
  EXPECT_EQ(o.mode, StepMode::kEager);
  EXPECT_EQ(o.steps, 7);
  EXPECT_EQ(o.layers, 3);
  EXPECT_EQ(o.hidden, 48);
  EXPECT_EQ(o.ffn, 96);
  EXPECT_EQ(o.experts, 4);
  EXPECT_EQ(o.topk, 1);
  EXPECT_EQ(o.batch, 9);
  EXPECT_EQ(o.context, 3);
  EXPECT_DOUBLE_EQ(o.lr, 0.02);
  EXPECT_EQ(o.seed, 5u);
  EXPECT_EQ(o.log_every, 2);
  EXPECT_EQ(o.checkpoint, "c.safetensors");
  EXPECT_TRUE(o.resume);
  EXPECT_EQ(o.save_every, 4);
  const TrainerOptions gpt = resolve_defaults(
      *parse({"--heads", "6", "--kv-heads", "2", "--seq-len", "12", "--hidden", "48"}).options, Device::kHost);
  EXPECT_EQ(gpt.heads, 6);
  EXPECT_EQ(gpt.kv_heads, 2);
  EXPECT_EQ(gpt.seq_len, 12);
  EXPECT_EQ(gpt.context, 12) << "the sequence model's context is the sequence";
  const ParsedCommandLine data = parse({"--data", "corpus.txt"});
  ASSERT_TRUE(data.options.has_value());
  EXPECT_EQ(data.options->data, "corpus.txt");
}

// Numbers that are not plainly a value of the flag's kind and range are
// refused at the edge naming the flag (before: '2.5' gave CLI11's "At Most 1
// required but received 2", NaN and 1e300 reached the layers, -1 wrapped
// around as a seed, and --comm-timeout nan passed).
TEST(TrainerOptionsTest, NumbersOutOfKindOrRangeAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--steps", "2.5"}, "--steps: '2.5' is not a whole number"},
      {{"--steps", "1e3"}, "--steps: '1e3' is not a whole number"},
      {{"--steps", ""}, "--steps: '' is not a whole number"},
      {{"--steps", "0x10"}, "--steps: '0x10' is not a whole number"},
      {{"--log-every", "99999999999999999999"}, "--log-every: 99999999999999999999 is out of range"},
      {{"--hidden", "3000000000"}, "--hidden: 3000000000 is out of range: give a whole number in [1, 2^31 - 1]"},
      {{"--layers", "-1"}, "--layers: -1 is out of range"},
      {{"--batch", "-5"}, "--batch: -5 is out of range"},
      {{"--seed", "-1"}, "--seed: '-1' is not a whole number"},
      {{"--seed", "4294967296"}, "--seed: 4294967296 is out of range"},
      {{"--lr", "nan"}, "--lr: nan is not a finite number"},
      {{"--lr", "inf"}, "--lr: inf is not a finite number"},
      {{"--lr", "1e300"}, "--lr: 1e300 is out of range"},
      {{"--lr", "0"}, "--lr: 0 is out of range"},
      {{"--lr", "fast"}, "--lr: 'fast' is not a number"},
      {{"--min-lr", "nan"}, "--min-lr: nan is not a finite number"},
      {{"--dropout", "nan"}, "--dropout: nan is not a finite number"},
      {{"--dropout", "1"}, "--dropout: 1 is out of range"},
      {{"--comm-timeout", "nan"}, "--comm-timeout: nan is not a finite number"},
      {{"--comm-timeout", "1e300"}, "--comm-timeout: 1e300 is out of range"},
      {{"--loss-scale-interval", "0"}, "--loss-scale-interval: 0 is out of range"},
      {{"--order", "99999999999"}, "--order: 99999999999 is out of range"},
      {{"--nproc-per-node", "65"}, "--nproc-per-node: 65 is out of range"},
      // An empty path meant "none": the Markov source, or no checkpoint, without a word.
      {{"--data", ""}, "--data: the value is empty"},
      {{"--checkpoint", ""}, "--checkpoint: the value is empty"},
      {{"--buckets", ""}, "--buckets: the value is empty"},
      {{"--buckets", "16,abc"}, "trainer: --buckets: 'abc' in '16,abc' is not a positive token count"},
      {{"--overlap", "fast"}, "--overlap: unknown overlap mode 'fast'"},
      {{"--tp", "2", "--overlap", ""}, "--overlap: the value is empty"},
  };
  for (const auto& [args, needle] : cases) {
    const ParsedCommandLine parsed = parse(args);
    EXPECT_FALSE(parsed.options.has_value()) << args[0] << " " << args[1];
    EXPECT_EQ(parsed.exit_code, 2) << args[0];
    EXPECT_NE(parsed.message.find(needle), std::string::npos) << parsed.message;
  }
  // The bounds themselves are values.
  const ParsedCommandLine bounds = parse({"--seed", "4294967295", "--lr", "1e6", "--dropout", "0.99", "--steps",
                                          "1099511627776", "--comm-timeout", "0.5"});
  ASSERT_TRUE(bounds.options.has_value()) << bounds.message;
  EXPECT_EQ(bounds.options->seed, 4294967295u);
  EXPECT_EQ(bounds.options->steps, std::int64_t{1} << 40);
}

// Options that the other flags make meaningless are refused, not ignored.
TEST(TrainerOptionsTest, OptionsThatWouldBeIgnoredAreRefused) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--topk", "2"}, "--topk routes tokens to experts: it needs --experts"},
      {{"--loss-scale-interval", "5"}, "--loss-scale-interval sets fp16's loss scaling: it needs --dtype fp16"},
      {{"--overlap", "none"}, "--overlap sets how tensor-parallel GEMMs meet their collectives"},
      {{"--min-seq-len", "4"}, "--min-seq-len goes with --buckets"},
      {{"--fp8-weight-cache"}, "--fp8-weight-cache keeps FP8 copies of the weights: it needs --fp8 current or delayed"},
      {{"--fp8", "block", "--fp8-weight-cache"},
       "--fp8 block with --fp8-weight-cache: FP8 recipe: cache_weights is built for tensor-wise scaling"},
  };
  for (const auto& [args, needle] : cases) {
    const ParsedCommandLine parsed = parse(args);
    EXPECT_FALSE(parsed.options.has_value()) << args[0];
    EXPECT_EQ(parsed.exit_code, 2) << args[0];
    EXPECT_NE(parsed.message.find(needle), std::string::npos) << parsed.message;
  }
  EXPECT_TRUE(parse({"--experts", "4", "--topk", "2"}).options.has_value());
  EXPECT_TRUE(parse({"--dtype", "fp16", "--loss-scale-interval", "5"}).options.has_value());
  EXPECT_TRUE(parse({"--tp", "2", "--overlap", "none"}).options.has_value());
  const ParsedCommandLine cached = parse({"--fp8", "delayed", "--fp8-weight-cache"});
  ASSERT_TRUE(cached.options.has_value()) << cached.message;
  ASSERT_TRUE(cached.options->fp8.has_value());
  EXPECT_EQ(cached.options->fp8->scaling, Fp8Scaling::kDelayed);
  EXPECT_TRUE(cached.options->fp8->cache_weights);
  auto resolved = [](std::vector<std::string> args) {
    return resolve_defaults(*parse(std::move(args)).options, Device::kHost);
  };
  // One block has no second block to be an MoE block (was ResidualStack's "moe_every must be in [1, layers = 1]").
  expect_error([&] { resolved({"--experts", "2", "--layers", "1"}); }, ErrorCode::kInvalidArgument,
               "--experts makes every second block an MoE block: it needs --layers 2 or more");
  // Was GroupedLinear 'block1.fc1''s "dtype fp16 is not supported", after the model was built.
  expect_error([&] { resolved({"--experts", "2", "--dtype", "fp16"}); }, ErrorCode::kInvalidArgument,
               "--experts with --dtype fp16: the MoE blocks' grouped GEMM takes bf16 or fp32");
}

// FP8 GEMMs are bf16's: fp32 (or fp16) with --fp8 was accepted; --fp8 alone
// now trains bf16 on the host too, whose default is fp32.
TEST(TrainerOptionsTest, Fp8RunsBf16OnlyAndNamesItsShapeFlags) {
  auto resolved = [](std::vector<std::string> args) {
    return resolve_defaults(*parse(std::move(args)).options, Device::kHost);
  };
  expect_error([&] { resolved({"--fp8", "current", "--dtype", "fp32"}); }, ErrorCode::kInvalidArgument,
               "--fp8 current runs bf16 models only, got --dtype fp32");
  expect_error([&] { resolved({"--fp8", "delayed", "--dtype", "fp16"}); }, ErrorCode::kInvalidArgument,
               "--fp8 delayed runs bf16 models only, got --dtype fp16");
  EXPECT_EQ(resolved({"--fp8", "current"}).dtype, DType::kBFloat16);
  EXPECT_EQ(resolved({"--fp8", "current", "--dtype", "bf16"}).dtype, DType::kBFloat16);
  EXPECT_EQ(resolved({}).dtype, DType::kFloat32);
  // The Linear's own error named 'block0.attention.qkv.linear' and its token count.
  expect_error([&] { resolved({"--fp8", "current", "--heads", "4", "--hidden", "64", "--batch", "3", "--seq-len", "5"}); },
               ErrorCode::kInvalidArgument, "--fp8 current needs each step's tokens (--batch x --seq-len = 15)");
  expect_error([&] { resolved({"--fp8", "block"}); }, ErrorCode::kInvalidArgument,
               "to be multiples of 128, got --hidden 64, --ffn 128");
  // Each shape bucket is a step's token count: a bucket of 8 tokens (pow2 from 4 x 2) was refused only by a
  // Linear at the first step, naming no flag.
  expect_error(
      [&] {
        resolved({"--fp8", "delayed", "--heads", "2", "--hidden", "64", "--seq-len", "16", "--batch", "4", "--buckets",
                  "pow2", "--min-seq-len", "2"});
      },
      ErrorCode::kInvalidArgument,
      "--fp8 delayed with --buckets pow2: every bucket's token count must be a multiple of 16 (the FP8 GEMMs' token "
      "tiles), but one is 8");
  EXPECT_EQ(resolved({"--fp8", "delayed", "--heads", "2", "--hidden", "64", "--seq-len", "16", "--batch", "4",
                      "--buckets", "pow2", "--min-seq-len", "4"})
                .min_seq_len,
            4);
}

// An odd head dimension named the rotary kernel's rotary_dim (0), a value no
// flag sets; the flags that decide it are --hidden and --heads.
TEST(TrainerOptionsTest, HeadDimensionErrorsNameHiddenAndHeads) {
  auto resolved = [](std::vector<std::string> args, Device device = Device::kHost) {
    return resolve_defaults(*parse(std::move(args)).options, device);
  };
  expect_error([&] { resolved({"--heads", "8", "--hidden", "24"}); }, ErrorCode::kInvalidArgument,
               "--hidden (24) / --heads (8) is 3 features a head; rotary positions need an even number");
  expect_error([&] { resolved({"--heads", "1", "--hidden", "512"}, Device::kCuda); }, ErrorCode::kInvalidArgument,
               "--hidden (512) / --heads (1) is 512 features a head; the CUDA attention kernels take at most 256");
  EXPECT_EQ(resolved({"--heads", "8", "--hidden", "48"}).heads, 8);
}

// Products of flags stay inside the step's 32-bit token indices.
TEST(TrainerOptionsTest, TokensPerStepFitThirtyTwoBits) {
  auto resolved = [](std::vector<std::string> args) {
    return resolve_defaults(*parse(std::move(args)).options, Device::kHost);
  };
  expect_error([&] { resolved({"--batch", "2000000000", "--heads", "0", "--context", "2"}); },
               ErrorCode::kInvalidArgument, "--batch (2000000000) x --context (2) is 4000000000 tokens a step");
  expect_error([&] { resolved({"--batch", "65536", "--heads", "2", "--seq-len", "65536"}); },
               ErrorCode::kInvalidArgument, "--batch (65536) x --seq-len (65536)");
}

}  // namespace
}  // namespace stepgraph::trainer
