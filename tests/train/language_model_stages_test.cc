// The GPT (LanguageModel: embedding, blocks, final norm, head) split into
// pipeline stages on the ranks of host thread worlds (LanguageModelStages:
// the embedding on stage 0, the head and the loss on the last stage, the
// loss broadcast to every stage) against one rank running the whole
// LanguageModel on the same microbatches in order, over two iterations of 4
// microbatches of new tokens and labels:
//
// PP = 1, 2 and 4 (attention blocks), PP = 2 of the window model (MLP
// blocks), and interleaved PP = 2 and 4 of V = 2 chunks: each microbatch's
// loss, the logged loss on every rank, and every parameter's gradient
// summed over the microbatches equal one rank's bit for bit (pipelining
// changes no sum's order: Note [The GPT in pipeline stages]), eager and
// captured (one CapturedStep over the whole iteration).
//
// PP = 2 x TP = 2 (the GPT and the window model): each stage's TP ranks
// hold their slices and rows; bit for bit against a TP world of 2 running
// the whole LanguageModel without a pipeline, per TP rank.
//
// PP = 2 x DP = 2: each replica trains its half of the global batch's 8
// microbatches; the gradient sums and the logged loss are one rank's sums of
// each replica's microbatches, the two replicas' added in fp32 (the
// all-reduce of two ranks is one addition): bit for bit again. And PP = 2 x
// TP = 2 x DP = 2 alike against a TP world, PP = 2 of V = 2 chunks x TP = 2,
// and PP = 2 of V = 2 chunks x DP = 2 (the interleaved stages' sums
// all-reduced after the last pass).
//
// And what the stages refuse: blocks that do not split evenly, a vocabulary
// the TP head cannot slice, MoE, a data-parallel group that mixes stages,
// inputs asked of the wrong stage; a bad token is the first stage's error.
#include "train/language_model_stages.h"

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
  return {.config = {.model = {.hidden = kHidden,
                               .ffn = 64,
                               .layers = kLayers,
                               .vocab = kVocab,
                               .dtype = DType::kFloat32,
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

// How the world is laid out: world rank w is tensor-parallel rank w % T of
// stage (w / T) % S of replica w / (T S).
struct Layout {
  int stages = 1;
  int replicas = 1;
  int chunks = 1;  // per stage
  int tensor_ranks = 1;

  int world_size() const { return stages * replicas * tensor_ranks; }
  std::string to_string() const {
    return std::to_string(stages) + " stage(s) of " + std::to_string(chunks) + " chunk(s) x " +
           std::to_string(replicas) + " replica(s) x " + std::to_string(tensor_ranks) + " tensor-parallel rank(s)";
  }
};

// What an iteration gives one tensor-parallel rank (all of them, without
// TP): the logged loss per world rank, each global microbatch's loss, and
// per parameter name its gradient summed over the microbatches (and the
// replicas), per replica.
struct Results {
  std::map<int, float> logged;
  std::vector<float> microbatch_losses;
  std::vector<std::map<std::string, std::vector<float>>> sums;
};

float scalar(Context& ctx, const Tensor& t) { return read_floats(ctx, t).at(0); }

// Tensor-parallel rank t's rows of a microbatch's `rows` rows of ids (all of them where n is 1).
std::vector<std::int32_t> shard(const std::vector<std::int32_t>& ids, std::int64_t rows, int t, int n) {
  const auto width = static_cast<std::int64_t>(ids.size()) / rows;
  const std::int64_t first = t * (rows / n) * width;
  return {ids.begin() + first, ids.begin() + first + (rows / n) * width};
}

// No pipeline: the whole LanguageModel (`tp`: this rank's slices of it, its
// rows) over every replica's microbatches in order: forward, the loss
// (scale 1 / (M D)), backward, each gradient added to its sum. The
// replicas' sums and losses are added after, in fp32.
std::vector<Results> whole_model(Context& ctx, const Model& model, const Data& data, int replicas,
                                 Communicator* tp = nullptr) {
  const LanguageModelConfig& c = model.config;
  LanguageModel lm(ctx, c, tp);
  const int t = tp != nullptr ? tp->rank() : 0;
  const int n = tp != nullptr ? tp->world_size() : 1;
  const std::int64_t rows = model.rows() / n;
  const Tensor tokens =
      ctx.persistent("tokens", {c.sequence_model() ? Shape{rows, 1} : Shape{rows, c.context}, DType::kInt32});
  const Tensor labels = ctx.persistent("labels", {Shape{rows}, DType::kInt32});
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
        write_values(ctx, tokens, shard(data.tokens[it][g], model.rows(), t, n));
        write_values(ctx, labels, shard(data.labels[it][g], model.rows(), t, n));
        const LanguageModel::Forward f = lm.forward(ctx, tokens, token_error, packing);
        const ops::CrossEntropyResult ce =
            lm.stack().loss(ctx, f.logits, lm.stack().gather_labels(ctx, labels), label_error, {.loss_scale = scale});
        lm.backward(ctx, f.saved, ce.dlogits);
        loss = ops::axpy(ctx, loss, ce.loss, scale);
        r.microbatch_losses[g] = scalar(ctx, ce.loss);
        for (std::size_t p = 0; p < params.size(); ++p) {
          if (m == 0)
            ops::copy_(ctx, sums[p], params[p]->grad);
          else
            ops::axpy_(ctx, sums[p], params[p]->grad, 1.0f);
        }
      }
      // The all-reduce of two ranks: one fp32 addition.
      total_loss = d == 0 ? scalar(ctx, loss) : total_loss + scalar(ctx, loss);
      for (std::size_t p = 0; p < params.size(); ++p) {
        const std::vector<float> sum = read_floats(ctx, sums[p]);
        std::vector<float>& total = total_sums[params[p]->name];
        if (d == 0)
          total = sum;
        else
          for (std::size_t i = 0; i < sum.size(); ++i) total[i] += sum[i];
      }
    }
    r.logged[0] = total_loss;
    r.sums.assign(1, total_sums);
  }
  return out;
}

// The reference of a layout, per tensor-parallel rank: one rank, or a TP
// world without a pipeline.
std::vector<std::vector<Results>> reference(const Model& model, const Data& data, const Layout& layout) {
  std::vector<std::vector<Results>> out(static_cast<std::size_t>(layout.tensor_ranks));
  if (layout.tensor_ranks == 1) {
    Context ctx(Device::kHost);
    out[0] = whole_model(ctx, model, data, layout.replicas);
    return out;
  }
  std::mutex mutex;
  HostWorld::run(layout.tensor_ranks, [&](Communicator& tp) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    std::vector<Results> mine = whole_model(ctx, model, data, layout.replicas, &tp);
    std::lock_guard lock(mutex);
    out[static_cast<std::size_t>(tp.rank())] = std::move(mine);
  });
  return out;
}

// Every rank's stage over the iterations, per tensor-parallel rank: the
// logged loss of each world rank, the microbatch losses of the last stages,
// every replica's gradient sums of every stage.
std::vector<std::vector<Results>> pipelined(const Model& model, const Data& data, const Layout& layout, Mode mode) {
  std::vector<std::vector<Results>> out(static_cast<std::size_t>(layout.tensor_ranks),
                                        std::vector<Results>(kIterations));
  for (std::vector<Results>& rank : out) {
    for (Results& r : rank) {
      r.microbatch_losses.resize(static_cast<std::size_t>(kMicrobatches * layout.replicas));
      r.sums.resize(static_cast<std::size_t>(layout.replicas));
    }
  }
  std::mutex mutex;
  HostWorld::run(layout.world_size(), [&](Communicator& world) {
    const int T = layout.tensor_ranks, S = layout.stages;
    const int w = world.rank();
    const int t = w % T, s = (w / T) % S, replica = w / (T * S);
    const std::unique_ptr<Communicator> pp = world.split(replica * T + t, s, "pp");
    const std::unique_ptr<Communicator> dp = world.split(s * T + t, replica, "dp");
    const std::unique_ptr<Communicator> tp = world.split(replica * S + s, t, "tp");
    LanguageModelStagesOptions options{.virtual_stages = layout.chunks};
    if (layout.replicas > 1) options.stage.data_parallel = dp.get();
    if (T > 1) options.tensor_parallel = tp.get();
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModelStages stages(ctx, *pp, model.config, model.batch, kMicrobatches, options);
    EXPECT_EQ(stages.stage(), s);
    EXPECT_EQ(stages.virtual_stages(), layout.chunks);
    std::shared_ptr<CapturedStep> step;
    if (mode == Mode::kGraphed) {
      CaptureOptions capture;
      capture.pool_report_policy = PoolReportPolicy::kError;
      capture.communicators = stages.communicators();
      step = CapturedStep::capture(
          ctx, [&] { return stages(ctx); }, capture);
    }
    for (int it = 0; it < kIterations; ++it) {
      for (std::int64_t m = 0; m < kMicrobatches; ++m) {
        const auto g = static_cast<std::size_t>(replica * kMicrobatches + m);
        if (stages.is_first()) write_values(ctx, stages.tokens(m), shard(data.tokens[it][g], model.rows(), t, T));
        if (stages.is_last()) write_values(ctx, stages.labels(m), shard(data.labels[it][g], model.rows(), t, T));
      }
      std::vector<Tensor> outputs;
      if (step) {
        step->replay();
        outputs = step->outputs();
      } else {
        outputs = stages(ctx);
      }
      stages.check_errors(ctx);
      std::lock_guard lock(mutex);
      Results& r = out[static_cast<std::size_t>(t)][it];
      EXPECT_EQ(outputs.size(), stages.is_last() ? 1u + kMicrobatches : 1u) << "rank " << w;
      r.logged[w] = scalar(ctx, outputs.at(0));
      for (std::int64_t m = 0; stages.is_last() && m < kMicrobatches; ++m) {
        r.microbatch_losses[static_cast<std::size_t>(replica * kMicrobatches + m)] = scalar(ctx, outputs.at(1 + m));
      }
      const std::vector<Tensor> sums = stages.gradient_sums();
      for (std::size_t p = 0; p < stages.parameters().size(); ++p) {
        r.sums[replica][stages.parameters()[p]->name] = read_floats(ctx, sums[p]);
      }
    }
  });
  return out;
}

// The layout equals its reference bit for bit, eager and graphed: one rank,
// or without tensor parallelism a TP world of the same ranks.
void expect_stages_equal_reference(const Model& model, const Layout& layout) {
  testing::SeededRng rng;
  const Data data = draw(rng, model, kMicrobatches * layout.replicas);
  const std::vector<std::vector<Results>> want = reference(model, data, layout);
  for (const Mode mode : {Mode::kEager, Mode::kGraphed}) {
    SCOPED_TRACE(std::string(mode_name(mode)) + ", " + layout.to_string());
    const std::vector<std::vector<Results>> got = pipelined(model, data, layout, mode);
    for (int t = 0; t < layout.tensor_ranks; ++t) {
      SCOPED_TRACE("tensor-parallel rank " + std::to_string(t));
      for (int it = 0; it < kIterations; ++it) {
        SCOPED_TRACE("iteration " + std::to_string(it));
        const Results& g = got[t][it];
        const Results& w = want[t][it];
        EXPECT_EQ(bits(g.microbatch_losses), bits(w.microbatch_losses)) << "the microbatches' losses";
        EXPECT_EQ(g.logged.size(), static_cast<std::size_t>(layout.stages * layout.replicas));
        for (const auto& [rank, loss] : g.logged) {
          EXPECT_EQ(bits({loss}), bits({w.logged.at(0)}))
              << "the logged loss on world rank " << rank << ": " << loss << " against " << w.logged.at(0);
        }
        for (int d = 0; d < layout.replicas; ++d) {
          SCOPED_TRACE("replica " + std::to_string(d));
          ASSERT_EQ(g.sums[d].size(), w.sums[0].size()) << "parameters over the stages against LanguageModel's";
          for (const auto& [name, sum] : w.sums[0]) {
            ASSERT_EQ(g.sums[d].count(name), 1u) << name << " is on no stage";
            EXPECT_EQ(bits(g.sums[d].at(name)), bits(sum)) << name << "'s gradient sum";
          }
        }
      }
    }
  }
}

// One stage: the embedding, every block and the head on one rank, no transfers.
TEST(LanguageModelStagesTest, OneStageEqualsOneRankBitwise) { expect_stages_equal_reference(gpt(), {}); }

TEST(LanguageModelStagesTest, TwoStagesOfTheGptEqualOneRankBitwise) {
  expect_stages_equal_reference(gpt(), {.stages = 2});
}

TEST(LanguageModelStagesTest, FourStagesOfTheGptEqualOneRankBitwise) {
  expect_stages_equal_reference(gpt(), {.stages = 4});
}

TEST(LanguageModelStagesTest, TwoStagesOfTheWindowModelEqualOneRankBitwise) {
  expect_stages_equal_reference(window_model(), {.stages = 2});
}

TEST(LanguageModelStagesTest, TwoStagesTimesTwoReplicasEqualOneRankOnTheGlobalBatch) {
  expect_stages_equal_reference(gpt(), {.stages = 2, .replicas = 2});
}

// Interleaved: stage 0 holds model chunks 0 (the embedding and block 0) and
// 2, stage 1 chunks 1 and 3 (the last block and the head).
TEST(LanguageModelStagesTest, TwoStagesOfTwoChunksEqualOneRankBitwise) {
  expect_stages_equal_reference(gpt(), {.stages = 2, .chunks = 2});
}

TEST(LanguageModelStagesTest, TwoStagesOfTwoChunksTimesTwoReplicasEqualOneRankOnTheGlobalBatch) {
  expect_stages_equal_reference(gpt(), {.stages = 2, .replicas = 2, .chunks = 2});
}

TEST(LanguageModelStagesTest, FourStagesOfTwoChunksEqualOneRankBitwise) {
  expect_stages_equal_reference(gpt(8), {.stages = 4, .chunks = 2});
}

// Each TP rank of a stage sends its half of the rows; the embedding and the
// head are vocabulary-parallel, the loss too. Bit for bit against a TP world
// of 2 without a pipeline (the TP ranks' sums cross ranks the same way in both).
TEST(LanguageModelStagesTest, TwoStagesTimesTwoTensorParallelRanksEqualATensorParallelWorld) {
  expect_stages_equal_reference(gpt(), {.stages = 2, .tensor_ranks = 2});
}

// 3-D: each replica's pipeline of TP groups on its half of the microbatches,
// against a TP world on each half, the halves' sums added in fp32.
TEST(LanguageModelStagesTest, TwoStagesTimesTwoTensorParallelRanksTimesTwoReplicasEqualATensorParallelWorld) {
  expect_stages_equal_reference(gpt(), {.stages = 2, .replicas = 2, .tensor_ranks = 2});
}

TEST(LanguageModelStagesTest, TwoStagesOfTwoChunksTimesTwoTensorParallelRanksEqualATensorParallelWorld) {
  expect_stages_equal_reference(gpt(), {.stages = 2, .chunks = 2, .tensor_ranks = 2});
}

TEST(LanguageModelStagesTest, TwoStagesOfTheWindowModelTimesTwoTensorParallelRanksEqualATensorParallelWorld) {
  expect_stages_equal_reference(window_model(), {.stages = 2, .tensor_ranks = 2});
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

// Only the last stage builds the head: a vocabulary its TP ranks cannot
// slice must be the same Error on every rank, not a wait in the others'
// schedule exchange.
TEST(LanguageModelStagesTest, AVocabularyTheTensorParallelHeadCannotSliceIsRefusedOnEveryRank) {
  Model model = gpt();
  model.config.model.vocab = 36;  // 18 a rank: not a multiple of 4 fp32 logits
  std::mutex mutex;
  std::vector<std::string> errors(4);
  HostWorld::run(4, [&](Communicator& world) {
    const std::unique_ptr<Communicator> tp = world.split(world.rank() / 2, world.rank() % 2, "tp");
    const std::unique_ptr<Communicator> pp = world.split(world.rank() % 2, world.rank() / 2, "pp");
    Context ctx(Device::kHost);
    std::string message = "no error";
    try {
      LanguageModelStages stages(ctx, *pp, model.config, model.batch, kMicrobatches, {.tensor_parallel = tp.get()});
    } catch (const Error& error) {
      message = error.message();
    }
    std::lock_guard lock(mutex);
    errors[world.rank()] = message;
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("config.model.vocab (36)"), std::string::npos) << e;
}

TEST(LanguageModelStagesTest, MixtureOfExpertsAndChunksOnOneStageAreRefused) {
  Model model = gpt();
  model.config.model.experts = 4;
  HostWorld::run(1, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(LanguageModelStages(ctx, comm, model.config, 2, kMicrobatches), "experts (4)",
                          "not supported in pipeline stages");
    // Interleaved chunks pass activations from rank to rank: one rank has no peer.
    EXPECT_ERROR_CONTAINS(LanguageModelStages(ctx, comm, gpt().config, 2, kMicrobatches, {.virtual_stages = 2}),
                          "options.virtual_stages (2)", "at least 2 pipeline stages");
  });
}

// A block alone refuses what it would silently leave out of ResidualStack's.
TEST(LanguageModelStagesTest, ABlockOnItsOwnRefusesDropoutAndAPackingWithoutAttention) {
  Context ctx(Device::kHost);
  ResidualStackConfig config = gpt().config.model;
  config.dropout = 0.1f;
  EXPECT_ERROR_CONTAINS(ResidualBlockLayer(ctx, config, 0, Tensor{}), "dropout (0.1)", "not supported");
  config.dropout = 0.0f;
  config.heads = 0;
  EXPECT_ERROR_CONTAINS(ResidualBlockLayer(ctx, config, 0, ctx.persistent("cu", {Shape{3}, DType::kInt32})),
                        "no attention (heads = 0)", "pass no cu_seqlens");
}

// Interleaved stages check their data-parallel group themselves: here each
// "replica" group holds both stages of one pipeline.
TEST(LanguageModelStagesTest, ADataParallelGroupOfInterleavedStagesThatMixesStagesIsRefusedOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> errors(4);
  HostWorld::run(4, [&](Communicator& world) {
    const std::unique_ptr<Communicator> pp = world.split(world.rank() / 2, world.rank() % 2, "pp");
    const std::unique_ptr<Communicator> wrong = world.split(world.rank() / 2, world.rank() % 2, "dp");
    Context ctx(Device::kHost);
    LanguageModelStagesOptions options{.virtual_stages = 2};
    options.stage.data_parallel = wrong.get();
    std::string message = "no error";
    try {
      LanguageModelStages stages(ctx, *pp, gpt().config, 2, kMicrobatches, options);
    } catch (const Error& error) {
      message = error.message();
    }
    std::lock_guard lock(mutex);
    errors[world.rank()] = message;
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("must group the same stage of every replica"), std::string::npos) << e;
  }
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
