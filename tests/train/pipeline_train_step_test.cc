// The GPT trained in pipeline stages (PipelineTrainStep: LanguageModelStages'
// iteration, then AdamW over each stage's parameters) on host thread worlds
// of PP = 2 and PP = 4 (and PP = 2 x TP = 2 against a TP world), over 3
// steps on the same 4 microbatches, against one rank running the whole
// LanguageModel on them in order and AdamW over every parameter: each
// step's logged loss on every rank and every master weight after each step
// equal the reference bit for bit (pipelining changes no sum's order, and
// AdamW's arithmetic per element does not depend on which parameters one
// optimizer holds), eager and captured; the loss falls. An optimizer over
// another stage's parameters, or with the non-finite skip, is refused.
#include "train/pipeline_train_step.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/language_model.h"
#include "ops/elementwise_ops.h"
#include "optim/adamw.h"
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
constexpr std::int64_t kMicrobatches = 4;
constexpr std::int64_t kBatch = 2;  // sequences of a microbatch
constexpr std::int64_t kContext = 8;
constexpr std::int64_t kRows = kBatch * kContext;
constexpr int kSteps = 3;
const kernels::AdamWHyper kHyper{.lr = 1e-2f};

LanguageModelConfig gpt() {
  return {
      .model = {.hidden = 32, .ffn = 64, .layers = 4, .vocab = kVocab, .dtype = DType::kFloat32, .seed = 5, .heads = 2},
      .context = kContext};
}

enum class Mode { kEager, kGraphed };

// Per microbatch: tokens and labels, the same every step.
struct Data {
  std::vector<std::vector<std::int32_t>> tokens, labels;
};

Data draw(std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(kVocab - 1));
  Data d;
  for (std::int64_t m = 0; m < kMicrobatches; ++m) {
    d.tokens.emplace_back(kRows);
    d.labels.emplace_back(kRows);
    for (std::int32_t& v : d.tokens.back()) v = id(rng);
    for (std::int32_t& v : d.labels.back()) v = id(rng);
  }
  return d;
}

// TP rank t's rows of n.
std::vector<std::int32_t> shard(const std::vector<std::int32_t>& ids, int t, int n) {
  const std::int64_t rows = kRows / n;
  return {ids.begin() + t * rows, ids.begin() + (t + 1) * rows};
}

// Per step: the logged loss per world rank, and every master weight by name.
struct Trace {
  std::vector<std::map<int, float>> losses;
  std::vector<std::map<std::string, std::vector<float>>> masters;
};

float scalar(Context& ctx, const Tensor& t) { return read_floats(ctx, t).at(0); }

// The whole model (TP rank `tp`'s slices where given), every microbatch in
// order, the gradients summed, AdamW over every parameter.
Trace whole_model(Context& ctx, const Data& data, Communicator* tp = nullptr) {
  LanguageModel lm(ctx, gpt(), tp);
  AdamW optimizer(ctx, lm.parameters(), kHyper);
  const int t = tp != nullptr ? tp->rank() : 0;
  const int n = tp != nullptr ? tp->world_size() : 1;
  const Tensor tokens = ctx.persistent("tokens", {Shape{kRows / n, 1}, DType::kInt32});
  const Tensor labels = ctx.persistent("labels", {Shape{kRows / n}, DType::kInt32});
  const Tensor token_error = ctx.persistent("token_error", {Shape{1}, DType::kInt32});
  const Tensor label_error = ctx.persistent("label_error", {Shape{1}, DType::kInt32});
  const Tensor packing = ctx.persistent("cu_seqlens", {Shape{kBatch + 1}, DType::kInt32});
  write_values(ctx, packing, std::vector<std::int32_t>{0, 8, 16});
  std::vector<Parameter*> params = lm.parameters();
  std::vector<Tensor> sums;
  for (Parameter* p : params) sums.push_back(ctx.persistent(p->name + ".sum", p->grad.meta()));
  const float scale = 1.0f / kMicrobatches;
  Trace trace;
  for (int step = 0; step < kSteps; ++step) {
    Tensor loss = ops::fill(ctx, {Shape{}, DType::kFloat32}, 0.0f);
    for (std::int64_t m = 0; m < kMicrobatches; ++m) {
      write_values(ctx, tokens, shard(data.tokens[m], t, n));
      write_values(ctx, labels, shard(data.labels[m], t, n));
      const LanguageModel::Forward f = lm.forward(ctx, tokens, token_error, packing);
      const ops::CrossEntropyResult ce =
          lm.stack().loss(ctx, f.logits, lm.stack().gather_labels(ctx, labels), label_error, {.loss_scale = scale});
      lm.backward(ctx, f.saved, ce.dlogits);
      loss = ops::axpy(ctx, loss, ce.loss, scale);
      for (std::size_t p = 0; p < params.size(); ++p) {
        if (m == 0)
          ops::copy_(ctx, sums[p], params[p]->grad);
        else
          ops::axpy_(ctx, sums[p], params[p]->grad, 1.0f);
      }
    }
    for (std::size_t p = 0; p < params.size(); ++p) ops::copy_(ctx, params[p]->grad, sums[p]);
    optimizer.step(ctx);
    trace.losses.push_back({{0, scalar(ctx, loss)}});
    trace.masters.emplace_back();
    for (Parameter* p : params) trace.masters.back()[p->name] = read_floats(ctx, p->master);
  }
  return trace;
}

// Per TP rank: every world rank's losses and every stage's masters merged.
std::vector<Trace> pipelined(const Data& data, int stages, int tensor_ranks, Mode mode) {
  std::vector<Trace> out(static_cast<std::size_t>(tensor_ranks));
  for (Trace& trace : out) {
    trace.losses.resize(kSteps);
    trace.masters.resize(kSteps);
  }
  std::mutex mutex;
  HostWorld::run(stages * tensor_ranks, [&](Communicator& world) {
    const int t = world.rank() % tensor_ranks, s = world.rank() / tensor_ranks;
    const std::unique_ptr<Communicator> pp = world.split(t, s, "pp");
    const std::unique_ptr<Communicator> tp = world.split(s, t, "tp");
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModelStages gpt_stages(ctx, *pp, gpt(), kBatch, kMicrobatches,
                                   {.tensor_parallel = tensor_ranks > 1 ? tp.get() : nullptr});
    AdamW optimizer(ctx, gpt_stages.parameters(), kHyper);
    PipelineTrainStep step(gpt_stages, optimizer);
    std::shared_ptr<CapturedStep> graph;
    if (mode == Mode::kGraphed) {
      CaptureOptions options;
      options.pool_report_policy = PoolReportPolicy::kError;
      options.communicators = gpt_stages.communicators();
      graph = CapturedStep::capture(
          ctx, [&] { return step(ctx); }, options);
    }
    for (std::int64_t m = 0; m < kMicrobatches; ++m) {
      if (gpt_stages.is_first()) write_values(ctx, gpt_stages.tokens(m), shard(data.tokens[m], t, tensor_ranks));
      if (gpt_stages.is_last()) write_values(ctx, gpt_stages.labels(m), shard(data.labels[m], t, tensor_ranks));
    }
    for (int k = 0; k < kSteps; ++k) {
      std::vector<Tensor> outputs;
      if (graph) {
        graph->replay();
        outputs = graph->outputs();
      } else {
        outputs = step(ctx);
      }
      std::lock_guard lock(mutex);
      Trace& trace = out[static_cast<std::size_t>(t)];
      trace.losses[k][world.rank()] = scalar(ctx, outputs.at(0));
      for (const Parameter* p : gpt_stages.parameters()) trace.masters[k][p->name] = read_floats(ctx, p->master);
    }
  });
  return out;
}

void expect_training_equals_reference(int stages, int tensor_ranks) {
  testing::SeededRng rng;
  const Data data = draw(rng);
  std::vector<Trace> want(static_cast<std::size_t>(tensor_ranks));
  if (tensor_ranks == 1) {
    Context ctx(Device::kHost);
    want[0] = whole_model(ctx, data);
  } else {
    std::mutex mutex;
    HostWorld::run(tensor_ranks, [&](Communicator& tp) {
      Context ctx(Device::kHost, 2);
      ctx.set_communication_stream(2);
      Trace mine = whole_model(ctx, data, &tp);
      std::lock_guard lock(mutex);
      want[static_cast<std::size_t>(tp.rank())] = std::move(mine);
    });
  }
  EXPECT_LT(want[0].losses.back().at(0), want[0].losses.front().at(0)) << "the reference does not learn";
  for (const Mode mode : {Mode::kEager, Mode::kGraphed}) {
    SCOPED_TRACE(std::string(mode == Mode::kEager ? "eager" : "graphed") + ", " + std::to_string(stages) +
                 " stages x " + std::to_string(tensor_ranks) + " tensor-parallel rank(s)");
    const std::vector<Trace> got = pipelined(data, stages, tensor_ranks, mode);
    for (int t = 0; t < tensor_ranks; ++t) {
      for (int k = 0; k < kSteps; ++k) {
        SCOPED_TRACE("tensor-parallel rank " + std::to_string(t) + ", step " + std::to_string(k));
        const float loss = want[t].losses[k].at(0);
        EXPECT_EQ(got[t].losses[k].size(), static_cast<std::size_t>(stages));
        for (const auto& [rank, value] : got[t].losses[k]) {
          EXPECT_EQ(bits({value}), bits({loss}))
              << "the loss on world rank " << rank << ": " << value << " against " << loss;
        }
        ASSERT_EQ(got[t].masters[k].size(), want[t].masters[k].size()) << "parameters over the stages";
        for (const auto& [name, master] : want[t].masters[k]) {
          ASSERT_EQ(got[t].masters[k].count(name), 1u) << name << " is on no stage";
          EXPECT_EQ(bits(got[t].masters[k].at(name)), bits(master)) << name << " after the step";
        }
      }
    }
  }
}

TEST(PipelineTrainStepTest, TwoStagesTrainAsOneRankBitwise) { expect_training_equals_reference(2, 1); }

TEST(PipelineTrainStepTest, FourStagesTrainAsOneRankBitwise) { expect_training_equals_reference(4, 1); }

TEST(PipelineTrainStepTest, TwoStagesTimesTwoTensorParallelRanksTrainAsATensorParallelWorldBitwise) {
  expect_training_equals_reference(2, 2);
}

TEST(PipelineTrainStepTest, AnOptimizerOfOtherParametersOrWithTheNonFiniteSkipIsRefused) {
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    LanguageModelStages stages(ctx, comm, gpt(), kBatch, kMicrobatches);
    LanguageModel other(ctx, gpt());
    AdamW wrong(ctx, other.parameters(), kHyper);
    EXPECT_ERROR_CONTAINS(PipelineTrainStep(stages, wrong), "is not a parameter of stage",
                          "LanguageModelStages::parameters()");
    AdamW skipping(ctx, stages.parameters(), kHyper);
    skipping.set_skip_nonfinite(ctx, true);
    EXPECT_ERROR_CONTAINS(PipelineTrainStep(stages, skipping), "non-finite skip", "not supported");
  });
}

}  // namespace
}  // namespace stepgraph
