// LanguageModel (window embedding -> ResidualStack) and TrainStep. Host: the
// embedding table's gradient against central finite differences of the
// cross-entropy loss (fp32), config errors, out-of-range tokens, and the whole
// token training step eager and captured as one graph from identical states,
// replayed with new tokens bound into its inputs: identical losses bit for
// bit, step after step. CUDA: the same where there is a GPU.
#include "layers/language_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "graphs/captured_step.h"
#include "optim/adamw.h"
#include "train/train_step.h"
#include "ops/loss_ops.h"
#include "tests/layers/train_rig.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::TrainRig;
using testing::expect_same_step;
using testing::expect_trained_alike;

constexpr std::int64_t kBatch = 32;

LanguageModelConfig small_config(DType dtype) {
  return {.model = {.hidden = 48, .ffn = 96, .layers = 2, .vocab = 16, .dtype = dtype, .seed = 3}, .context = 3};
}

std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> out(static_cast<std::size_t>(n));
  for (auto& t : out) t = pick(rng);
  return out;
}

Tensor int_tensor(Context& ctx, const std::string& name, const Shape& shape, const std::vector<std::int32_t>& values) {
  Tensor t = ctx.persistent(name, {shape, DType::kInt32});
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(std::int32_t));
  return t;
}

TEST(LanguageModelTest, EmbeddingGradientMatchesFiniteDifferencesOfTheLoss) {
  Context ctx(Device::kHost);
  const LanguageModelConfig config = small_config(DType::kFloat32);
  LanguageModel model(ctx, config);
  testing::SeededRng rng;
  const std::int64_t batch = 6;
  const Tensor tokens = int_tensor(ctx, "tokens", Shape{batch, config.context},
                                   random_tokens(batch * config.context, config.model.vocab, rng));
  const Tensor labels = int_tensor(ctx, "labels", Shape{batch}, random_tokens(batch, config.model.vocab, rng));
  const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
  auto loss = [&] {
    const LanguageModel::Forward f = model.forward(ctx, tokens, flag);
    return ctx.to_vector<float>(ops::cross_entropy(ctx, f.logits, labels, flag).loss).at(0);
  };
  {
    const LanguageModel::Forward f = model.forward(ctx, tokens, flag);
    model.backward(ctx, f.saved, ops::cross_entropy(ctx, f.logits, labels, flag).dlogits);
  }
  const Parameter& table = *model.parameters().front();
  ASSERT_EQ(table.name, "embedding.table");
  const std::vector<float> analytic = ctx.to_vector<float>(table.grad);
  std::vector<float> values = ctx.to_vector<float>(table.master);
  const std::vector<std::int32_t> used = ctx.to_vector<std::int32_t>(tokens);
  const std::int64_t dim = config.embedding_dim();
  std::uniform_int_distribution<std::int64_t> column(0, dim - 1);
  std::uniform_int_distribution<std::size_t> position(0, used.size() - 1);
  constexpr float kStep = 1e-2f;
  for (int trial = 0; trial < 8; ++trial) {
    // Half the trials on rows some token uses, half anywhere (mostly unused: gradient 0).
    const std::int64_t row = trial % 2 == 0 ? used[position(rng)] : static_cast<std::int64_t>(rng() % 16);
    const auto i = static_cast<std::size_t>(row * dim + column(rng));
    const float saved = values[i];
    values[i] = saved + kStep;
    ctx.copy_from_host(table.master, values.data(), values.size() * sizeof(float));
    const double up = loss();
    values[i] = saved - kStep;
    ctx.copy_from_host(table.master, values.data(), values.size() * sizeof(float));
    const double down = loss();
    values[i] = saved;
    ctx.copy_from_host(table.master, values.data(), values.size() * sizeof(float));
    const double numeric = (up - down) / (2.0 * kStep);
    EXPECT_NEAR(analytic[i], numeric, 2e-3 + 2e-2 * std::fabs(numeric))
        << "table[" << row << ", " << i % dim << "]: analytic " << analytic[i] << ", finite difference " << numeric;
  }
  EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0);
}

TEST(LanguageModelTest, RejectsAHiddenSizeThatIsNotAMultipleOfTheContext) {
  Context ctx(Device::kHost);
  LanguageModelConfig config = small_config(DType::kFloat32);
  config.context = 5;  // 48 % 5 != 0
  try {
    LanguageModel model(ctx, config);
    ADD_FAILURE() << "no Error for hidden 48 with context 5";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find("multiple of context"), std::string::npos) << error.message();
  }
}

TEST(LanguageModelTest, MixtureOfExpertsIsPassedToTheModel) {
  Context ctx(Device::kHost);
  LanguageModelConfig config = small_config(DType::kFloat32);
  config.model.experts = 4;
  config.model.topk = 2;
  // Block 1 of 2 becomes an MoE block: its router and experts replace the
  // dense MLP's parameters, so the lists differ.
  LanguageModel moe(ctx, config);
  LanguageModel dense(ctx, small_config(DType::kFloat32));
  std::vector<std::string> moe_names, dense_names;
  for (const Parameter* p : moe.parameters()) moe_names.push_back(p->name);
  for (const Parameter* p : dense.parameters()) dense_names.push_back(p->name);
  EXPECT_NE(moe_names, dense_names);
  EXPECT_EQ(moe_names.front(), "embedding.table");
}

TEST(LanguageModelTest, OutOfRangeTokenIsAClearErrorAfterTheStep) {
  Context ctx(Device::kHost);
  const LanguageModelConfig config = small_config(DType::kBFloat16);
  LanguageModel model(ctx, config);
  AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
  TrainStep step(ctx, model, optimizer, 4);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(4 * config.context), 1);
  tokens[2] = 16;  // vocab is 16
  ctx.copy_from_host(step.inputs(), tokens.data(), tokens.size() * sizeof(std::int32_t));
  step(ctx);
  try {
    step.check_errors(ctx);
    ADD_FAILURE() << "no Error for token 16 with vocab 16";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("input token was outside [0, 16)"), std::string::npos) << error.message();
  }
}

// One model with its optimizer and step, all persistent in `ctx`.
struct Trainer : TrainRig<LanguageModel> {
  Trainer(Context& ctx, const LanguageModelConfig& config) : TrainRig(ctx, config, kBatch) {}
};

void expect_eager_equals_graph(Device device, int steps) {
  Context ctx(device);
  const LanguageModelConfig config = small_config(DType::kBFloat16);
  Trainer eager(ctx, config);
  Trainer graphed(ctx, config);
  auto captured =
      CapturedStep::capture(ctx, [&] { return graphed.step(ctx); }, {.pool_report_policy = PoolReportPolicy::kError});
  EXPECT_LE(captured->plan().ratio_to_lower_bound(), 1.10);
  // Two batches, alternating; a "next token = sum of the window mod vocab" rule
  // so there is something to learn.
  std::mt19937 rng(7);
  std::vector<Tensor> batch_tokens, batch_labels;
  for (int b = 0; b < 2; ++b) {
    std::vector<std::int32_t> tokens = random_tokens(kBatch * config.context, config.model.vocab, rng);
    std::vector<std::int32_t> labels(kBatch);
    for (std::int64_t r = 0; r < kBatch; ++r) {
      std::int32_t sum = 0;
      for (std::int64_t w = 0; w < config.context; ++w) sum += tokens[r * config.context + w];
      labels[r] = sum % static_cast<std::int32_t>(config.model.vocab);
    }
    batch_tokens.push_back(int_tensor(ctx, "tokens" + std::to_string(b), Shape{kBatch, config.context}, tokens));
    batch_labels.push_back(int_tensor(ctx, "labels" + std::to_string(b), Shape{kBatch}, labels));
  }
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const Tensor& tokens = batch_tokens[s % 2];
    const Tensor& labels = batch_labels[s % 2];
    std::vector<std::int32_t> t = ctx.to_vector<std::int32_t>(tokens);
    std::vector<std::int32_t> l = ctx.to_vector<std::int32_t>(labels);
    ctx.copy_from_host(eager.step.inputs(), t.data(), t.size() * sizeof(std::int32_t));
    ctx.copy_from_host(eager.step.labels(), l.data(), l.size() * sizeof(std::int32_t));
    const InputBinding bindings[] = {{graphed.step.inputs(), tokens}, {graphed.step.labels(), labels}};
    losses.push_back(expect_same_step<LanguageModel>(ctx, eager, graphed, *captured, s, bindings));
  }
  expect_trained_alike<LanguageModel>(ctx, eager, graphed, losses, steps);
}

TEST(LanguageModelHostTest, TokenStepEagerEqualsGraphForTwelveSteps) { expect_eager_equals_graph(Device::kHost, 12); }

TEST(LanguageModelCudaTest, TokenStepEagerEqualsGraphForTwelveSteps) {
  SG_SKIP_WITHOUT_GPU();
  expect_eager_equals_graph(Device::kCuda, 12);
}

}  // namespace
}  // namespace stepgraph
