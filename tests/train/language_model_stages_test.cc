// The GPT (LanguageModel: embedding, blocks, final norm, head) split into
// pipeline stages on the ranks of host thread worlds (LanguageModelStages:
// the embedding on stage 0, the head and the loss on the last stage, the
// loss broadcast to every stage) against one rank running the whole
// LanguageModel on the same microbatches in order, over two iterations of 4
// microbatches of new tokens and labels:
//
// PP = 1, 2 and 4 (attention blocks), PP = 2 of the window model (MLP
// blocks), and interleaved PP = 2 and 4 of V = 2 chunks: each microbatch's loss, the logged loss on every rank, and every
// parameter's gradient summed over the microbatches equal one rank's bit for
// bit (pipelining changes no sum's order: Note [The GPT in pipeline
// stages]), eager and captured (one CapturedStep over the whole iteration).
//
// PP = 2 x DP = 2: each replica trains its half of the global batch's 8
// microbatches; the gradient sums and the logged loss are one rank's sums of
// each replica's microbatches, the two replicas' added in fp32 (the
// all-reduce of two ranks is one addition): bit for bit again.
//
// And what the stages refuse: blocks that do not split evenly, MoE, data
// parallelism with chunks, inputs asked of the wrong stage; a bad token is
// the first stage's error.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/language_model.h"
#include "ops/elementwise_ops.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"
#include "train/language_model_stages.h"

namespace stepgraph {
namespace {

using testing::bits;
using testing::read_floats;
using testing::write_values;

constexpr std::int64_t kVocab = 32;
constexpr std::int64_t kHidden = 32;
constexpr std::int64_t kLayers = 4;
constexpr std::int64_t kMicrobatches = 4;  // per replica
constexpr int kIterations = 2;

enum class Mode { kEager, kGraphed };
const char* mode_name(Mode mode) { return mode == Mode::kEager ? "eager" : "graphed"; }

// A sequence model (heads 2: sequences of 8 tokens, 2 a microbatch) or the
// window model (MLP blocks: windows of 4 tokens, 4 examples a microbatch).
struct Model {
  LanguageModelConfig config;
  std::int64_t batch;

  std::int64_t rows() const { return config.sequence_model() ? batch * config.context : batch; }
  std::int64_t token_count() const { return config.sequence_model() ? rows() : batch * config.context; }
};

Model gpt(std::int64_t layers = kLayers) {
  return {.config = {.model = {.hidden = kHidden,
                               .ffn = 64,
                               .layers = layers,
                               .vocab = kVocab,
                               .dtype = DType::kFloat32,
                               .seed = 17,
                               .heads = 2},
                     .context = 8},
          .batch = 2};
}

Model window_model() {
  return {.config = {.model = {.hidden = kHidden, .ffn = 64, .layers = kLayers, .vocab = kVocab, .dtype = DType::kFloat32,
                               .seed = 29},
                     .context = 4},
          .batch = 4};
}

// Per iteration, per global microbatch: its tokens and labels.
struct Data {
  std::vector<std::vector<std::vector<std::int32_t>>> tokens, labels;
};

Data draw(std::mt19937& rng, const Model& model, std::int64_t microbatches) {
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(kVocab - 1));
  auto ids = [&](std::int64_t n) {
    std::vector<std::int32_t> out(static_cast<std::size_t>(n));
    for (std::int32_t& v : out) v = id(rng);
    return out;
  };
  Data d;
  for (int it = 0; it < kIterations; ++it) {
    d.tokens.emplace_back();
    d.labels.emplace_back();
    for (std::int64_t m = 0; m < microbatches; ++m) {
      d.tokens.back().push_back(ids(model.token_count()));
      d.labels.back().push_back(ids(model.rows()));
    }
  }
  return d;
}

// What an iteration gives: the logged loss (per world rank), each global
// microbatch's loss, and per parameter name its gradient summed over the
// microbatches (and replicas), per replica.
struct Results {
  std::vector<float> logged;
  std::vector<float> microbatch_losses;
  std::vector<std::map<std::string, std::vector<float>>> sums;
};

float scalar(Context& ctx, const Tensor& t) { return read_floats(ctx, t).at(0); }

// One rank, the whole LanguageModel, every replica's microbatches in order:
// forward, the loss (scale 1 / (M D)), backward, each gradient added to its
// sum. The replicas' sums and losses are added after, in fp32.
std::vector<Results> one_rank(const Model& model, const Data& data, int replicas) {
  Context ctx(Device::kHost);
  LanguageModel lm(ctx, model.config);
  const LanguageModelConfig& c = model.config;
  const Tensor tokens = ctx.persistent(
      "tokens", {c.sequence_model() ? Shape{model.rows(), 1} : Shape{model.batch, c.context}, DType::kInt32});
  const Tensor labels = ctx.persistent("labels", {Shape{model.rows()}, DType::kInt32});
  const Tensor token_error = ctx.persistent("token_error", {Shape{1}, DType::kInt32});
  const Tensor label_error = ctx.persistent("label_error", {Shape{1}, DType::kInt32});
  Tensor packing;
  if (c.sequence_model()) {
    std::vector<std::int32_t> cu;
    for (std::int64_t s = 0; s <= model.batch; ++s) cu.push_back(static_cast<std::int32_t>(s * c.context));
    packing = ctx.persistent("cu_seqlens", {Shape{model.batch + 1}, DType::kInt32});
    write_values(ctx, packing, cu);
  }
  std::vector<Parameter*> params = lm.parameters();
  std::vector<Tensor> sums;
  for (Parameter* p : params) sums.push_back(ctx.persistent(p->name + ".sum", p->grad.meta()));
  const float scale = 1.0f / static_cast<float>(kMicrobatches * replicas);

  std::vector<Results> out(kIterations);
  for (int it = 0; it < kIterations; ++it) {
    Results& r = out[it];
    r.microbatch_losses.resize(static_cast<std::size_t>(kMicrobatches * replicas));
    std::map<std::string, std::vector<float>> total_sums;
    float total_loss = 0.0f;
    for (int d = 0; d < replicas; ++d) {
      Tensor loss = ops::fill(ctx, {Shape{}, DType::kFloat32}, 0.0f);
      for (std::int64_t m = 0; m < kMicrobatches; ++m) {
        const auto g = static_cast<std::size_t>(d * kMicrobatches + m);
        write_values(ctx, tokens, data.tokens[it][g]);
        write_values(ctx, labels, data.labels[it][g]);
        const LanguageModel::Forward f = lm.forward(ctx, tokens, token_error, packing);
        const ops::CrossEntropyResult ce =
            lm.stack().loss(ctx, f.logits, labels, label_error, {.loss_scale = scale});
        lm.backward(ctx, f.saved, ce.dlogits);
        loss = ops::axpy(ctx, loss, ce.loss, scale);
        r.microbatch_losses[g] = scalar(ctx, ce.loss);
        for (std::size_t p = 0; p < params.size(); ++p) {
          if (m == 0) ops::copy_(ctx, sums[p], params[p]->grad);
          else ops::axpy_(ctx, sums[p], params[p]->grad, 1.0f);
        }
      }
      // The all-reduce of two ranks: one fp32 addition.
      total_loss = d == 0 ? scalar(ctx, loss) : total_loss + scalar(ctx, loss);
      for (std::size_t p = 0; p < params.size(); ++p) {
        const std::vector<float> sum = read_floats(ctx, sums[p]);
        std::vector<float>& total = total_sums[params[p]->name];
        if (d == 0) total = sum;
        else for (std::size_t i = 0; i < sum.size(); ++i) total[i] += sum[i];
      }
    }
    r.logged.assign(1, total_loss);
    r.sums.assign(1, total_sums);
  }
  return out;
}

// Every rank's stage over the iterations, merged: the logged loss of each
// world rank, the microbatch losses of the last stages, every replica's
// gradient sums of every stage.
std::vector<Results> pipelined(const Model& model, const Data& data, int stages, int replicas, int chunks, Mode mode) {
  const int world_size = stages * replicas;
  std::vector<Results> out(kIterations);
  for (Results& r : out) {
    r.logged.resize(static_cast<std::size_t>(world_size));
    r.microbatch_losses.resize(static_cast<std::size_t>(kMicrobatches * replicas));
    r.sums.resize(static_cast<std::size_t>(replicas));
  }
  std::mutex mutex;
  HostWorld::run(world_size, [&](Communicator& world) {
    const int replica = world.rank() / stages;
    const int s = world.rank() % stages;
    std::unique_ptr<Communicator> pp, dp;
    Communicator* pipeline = &world;
    LanguageModelStagesOptions options{.virtual_stages = chunks};
    if (replicas > 1) {
      pp = world.split(replica, s, "pp");
      dp = world.split(s, replica, "dp");
      pipeline = pp.get();
      options.stage.data_parallel = dp.get();
    }
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModelStages gpt_stages(ctx, *pipeline, model.config, model.batch, kMicrobatches, options);
    const LanguageModelStages& stage = gpt_stages;
    EXPECT_EQ(stage.stage(), s);
    EXPECT_EQ(stage.virtual_stages(), chunks);
    std::shared_ptr<CapturedStep> step;
    if (mode == Mode::kGraphed) {
      CaptureOptions capture;
      capture.pool_report_policy = PoolReportPolicy::kError;
      capture.communicators = gpt_stages.communicators();
      step = CapturedStep::capture(ctx, [&] { return gpt_stages(ctx); }, capture);
    }
    for (int it = 0; it < kIterations; ++it) {
      for (std::int64_t m = 0; m < kMicrobatches; ++m) {
        const auto g = static_cast<std::size_t>(replica * kMicrobatches + m);
        if (stage.is_first()) write_values(ctx, gpt_stages.tokens(m), data.tokens[it][g]);
        if (stage.is_last()) write_values(ctx, gpt_stages.labels(m), data.labels[it][g]);
      }
      std::vector<Tensor> outputs;
      if (step) {
        step->replay();
        outputs = step->outputs();
      } else {
        outputs = gpt_stages(ctx);
      }
      gpt_stages.check_errors(ctx);
      std::lock_guard lock(mutex);
      Results& r = out[it];
      EXPECT_EQ(outputs.size(), stage.is_last() ? 1u + kMicrobatches : 1u) << "rank " << world.rank();
      r.logged[static_cast<std::size_t>(world.rank())] = scalar(ctx, outputs.at(0));
      for (std::int64_t m = 0; stage.is_last() && m < kMicrobatches; ++m) {
        r.microbatch_losses[static_cast<std::size_t>(replica * kMicrobatches + m)] = scalar(ctx, outputs.at(1 + m));
      }
      for (std::size_t p = 0; p < gpt_stages.parameters().size(); ++p) {
        r.sums[replica][gpt_stages.parameters()[p]->name] = read_floats(ctx, gpt_stages.gradient_sums()[p]);
      }
    }
  });
  return out;
}

void expect_stages_equal_one_rank(const Model& model, int stages, int replicas = 1, int chunks = 1) {
  testing::SeededRng rng;
  const Data data = draw(rng, model, kMicrobatches * replicas);
  const std::vector<Results> want = one_rank(model, data, replicas);
  for (const Mode mode : {Mode::kEager, Mode::kGraphed}) {
    SCOPED_TRACE(std::string(mode_name(mode)) + ", " + std::to_string(stages) + " stage(s) of " +
                 std::to_string(chunks) + " chunk(s) x " + std::to_string(replicas) + " replica(s)");
    const std::vector<Results> got = pipelined(model, data, stages, replicas, chunks, mode);
    for (int it = 0; it < kIterations; ++it) {
      SCOPED_TRACE("iteration " + std::to_string(it));
      EXPECT_EQ(bits(got[it].microbatch_losses), bits(want[it].microbatch_losses)) << "the microbatches' losses";
      for (std::size_t rank = 0; rank < got[it].logged.size(); ++rank) {
        EXPECT_EQ(bits({got[it].logged[rank]}), bits(want[it].logged)) << "the logged loss on world rank " << rank
                                                                        << ": " << got[it].logged[rank] << " against "
                                                                        << want[it].logged[0];
      }
      const std::map<std::string, std::vector<float>>& sums = want[it].sums[0];
      for (int d = 0; d < replicas; ++d) {
        SCOPED_TRACE("replica " + std::to_string(d));
        ASSERT_EQ(got[it].sums[d].size(), sums.size()) << "parameters over the stages against LanguageModel's";
        for (const auto& [name, sum] : sums) {
          ASSERT_EQ(got[it].sums[d].count(name), 1u) << name << " is on no stage";
          EXPECT_EQ(bits(got[it].sums[d].at(name)), bits(sum)) << name << "'s gradient sum";
        }
      }
    }
  }
}

// One stage: the embedding, every block and the head on one rank, no transfers.
TEST(LanguageModelStagesTest, OneStageEqualsOneRankBitwise) { expect_stages_equal_one_rank(gpt(), 1); }

TEST(LanguageModelStagesTest, TwoStagesOfTheGptEqualOneRankBitwise) { expect_stages_equal_one_rank(gpt(), 2); }

TEST(LanguageModelStagesTest, FourStagesOfTheGptEqualOneRankBitwise) { expect_stages_equal_one_rank(gpt(), 4); }

TEST(LanguageModelStagesTest, TwoStagesOfTheWindowModelEqualOneRankBitwise) {
  expect_stages_equal_one_rank(window_model(), 2);
}

TEST(LanguageModelStagesTest, TwoStagesTimesTwoReplicasEqualOneRankOnTheGlobalBatch) {
  expect_stages_equal_one_rank(gpt(), 2, 2);
}

// Interleaved: stage 0 holds model chunks 0 (the embedding and block 0) and
// 2, stage 1 chunks 1 and 3 (the last block and the head).
TEST(LanguageModelStagesTest, TwoStagesOfTwoChunksEqualOneRankBitwise) {
  expect_stages_equal_one_rank(gpt(), 2, 1, 2);
}

TEST(LanguageModelStagesTest, FourStagesOfTwoChunksEqualOneRankBitwise) {
  expect_stages_equal_one_rank(gpt(8), 4, 1, 2);
}

// Stage 0 holds the embedding and its share of the blocks, the last stage
// its blocks and the head, and every parameter is on exactly one stage.
TEST(LanguageModelStagesTest, EmbeddingAndHeadRideWithTheFirstAndLastStagesBlocks) {
  std::mutex mutex;
  std::vector<std::vector<std::string>> names(4);
  HostWorld::run(4, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    LanguageModelStages stages(ctx, comm, gpt(8).config, 2, kMicrobatches);
    std::lock_guard lock(mutex);
    for (const Parameter* p : stages.parameters()) names[comm.rank()].push_back(p->name);
  });
  auto has = [](const std::vector<std::string>& list, const std::string& prefix) {
    for (const std::string& name : list) {
      if (name.rfind(prefix, 0) == 0) return true;
    }
    return false;
  };
  EXPECT_TRUE(has(names[0], "embedding") && has(names[0], "block0") && has(names[0], "block1") &&
              !has(names[0], "block2"));
  EXPECT_TRUE(has(names[1], "block2") && has(names[1], "block3") && !has(names[1], "embedding"));
  EXPECT_TRUE(has(names[3], "block7") && has(names[3], "final_norm") && has(names[3], "head"));
  EXPECT_FALSE(has(names[1], "head") || has(names[2], "head") || has(names[0], "head"));
  Context ctx(Device::kHost);
  LanguageModel whole(ctx, gpt(8).config);
  std::size_t total = 0;
  for (const auto& list : names) total += list.size();
  EXPECT_EQ(total, whole.parameters().size());
}

TEST(LanguageModelStagesTest, BlocksThatDoNotSplitEvenlyAreRefusedOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    try {
      LanguageModelStages stages(ctx, comm, gpt(3).config, 2, kMicrobatches);
    } catch (const Error& error) {
      std::lock_guard lock(mutex);
      errors[comm.rank()] = error.message();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("config.model.layers (3)"), std::string::npos) << e;
    EXPECT_NE(e.find("pipeline stages (2"), std::string::npos) << e;
  }
}

TEST(LanguageModelStagesTest, MixtureOfExpertsAndDataParallelChunksAreRefused) {
  Model model = gpt();
  model.config.model.experts = 4;
  HostWorld::run(1, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(LanguageModelStages(ctx, comm, model.config, 2, kMicrobatches), "experts (4)",
                          "not supported in pipeline stages");
    LanguageModelStagesOptions options{.virtual_stages = 2};
    options.stage.data_parallel = &comm;
    EXPECT_ERROR_CONTAINS(LanguageModelStages(ctx, comm, gpt().config, 2, kMicrobatches, options),
                          "options.stage.data_parallel", "virtual stages (2)", "not supported yet");
  });
}

// A token outside the vocabulary is stage 0's error, read after the
// iteration; the other stages have no tokens to check. (A label outside it
// is the last stage's: the host's cross-entropy raises it at once, the
// device's sets the flag check_errors reads.)
TEST(LanguageModelStagesTest, BadTokensAreAnErrorOfTheFirstStage) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    const Model model = gpt();
    LanguageModelStages stages(ctx, comm, model.config, model.batch, kMicrobatches);
    for (std::int64_t m = 0; m < kMicrobatches; ++m) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(model.rows()), 1);
      if (stages.is_last()) write_values(ctx, stages.labels(m), ids);
      if (m == 2) ids[3] = static_cast<std::int32_t>(kVocab);
      if (stages.is_first()) write_values(ctx, stages.tokens(m), ids);
    }
    (void)stages(ctx);
    std::string message = "no error";
    try {
      stages.check_errors(ctx);
    } catch (const Error& error) {
      message = error.message();
    }
    std::lock_guard lock(mutex);
    errors[comm.rank()] = message;
  });
  EXPECT_NE(errors[0].find("an input token was outside [0, 32)"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "no error");
}

TEST(LanguageModelStagesTest, InputsOfAnotherStageAreRefused) {
  std::mutex mutex;
  std::vector<std::string> errors(2);
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    LanguageModelStages stages(ctx, comm, gpt().config, 2, kMicrobatches);
    std::string message;
    try {
      (void)(comm.rank() == 0 ? stages.labels(0) : stages.tokens(0));
    } catch (const Error& error) {
      message = error.message();
    }
    std::lock_guard lock(mutex);
    errors[comm.rank()] = message;
  });
  EXPECT_NE(errors[0].find("the labels are the last stage's (1) inputs"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("the tokens are stage 0's inputs"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace stepgraph
