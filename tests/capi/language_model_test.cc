// The C API's language model and optimizer config, as a C caller uses them
// on the host: the versioned configs (defaults, refusals naming the field or
// the header mismatch, a struct of an older header), a GPT and a window
// model trained by their train steps, packed sequences, and the optimizer's
// options (non-finite skip, loss scaling, step-scoped gradients).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "capi/stepgraph.h"
#include "tests/capi/capi_test_support.h"

namespace {

void expect_error(sg_result result, const std::string& words) {
  EXPECT_NE(result, SG_OK);
  const std::string message = sg_last_error();
  EXPECT_NE(message.find(words), std::string::npos) << message;
}

// A small fp32 GPT: vocab 16, hidden 16, 1 layer of 2 heads, sequences of 8.
sg_language_model_config small_gpt() {
  sg_language_model_config c;
  sg_language_model_config_default(&c);
  c.vocab = 16;
  c.hidden = 16;
  c.ffn = 32;
  c.layers = 1;
  c.heads = 2;
  c.context = 8;
  c.dtype = SG_DTYPE_FLOAT32;
  return c;
}

class LanguageModelTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_SG_OK(sg_context_create(SG_DEVICE_HOST, 1, &ctx_)); }
  void TearDown() override {
    EXPECT_EQ(sg_train_step_destroy(step_), SG_OK);
    EXPECT_EQ(sg_optimizer_destroy(optimizer_), SG_OK);
    EXPECT_EQ(sg_layer_destroy(model_), SG_OK);
    EXPECT_EQ(sg_context_destroy(ctx_), SG_OK);
  }

  // The model, an optimizer of `options` and a step of `tokens` rows (`sequences` packed ones when > 0).
  void build(const sg_language_model_config& model, const sg_optimizer_config& options, int64_t tokens,
             int64_t sequences = 0) {
    ASSERT_SG_OK(sg_language_model_create(ctx_, &model, &model_));
    ASSERT_SG_OK(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_));
    sg_train_step_config step = SG_TRAIN_STEP_CONFIG_INITIALIZER;
    step.tokens = tokens;
    step.sequences = sequences;
    ASSERT_SG_OK(sg_train_step_create(model_, optimizer_, &step, &step_));
  }

  std::vector<int64_t> dims(sg_tensor t) {
    int rank = 0;
    EXPECT_EQ(sg_tensor_rank(t, &rank), SG_OK);
    std::vector<int64_t> out(static_cast<std::size_t>(rank));
    EXPECT_EQ(sg_tensor_dims(t, out.data(), rank), SG_OK);
    return out;
  }

  // Writes `tokens` and `labels` into the step's inputs and runs `steps` eager steps; their losses.
  std::vector<float> train(const std::vector<int32_t>& tokens, const std::vector<int32_t>& labels, int steps) {
    sg_tensor x = nullptr;
    sg_tensor y = nullptr;
    EXPECT_EQ(sg_train_step_inputs(step_, &x, &y), SG_OK);
    copy_step_inputs(x, y, tokens, labels);
    std::vector<float> losses;
    for (int s = 0; s < steps; ++s) losses.push_back(run_step_loss(step_));
    EXPECT_EQ(sg_train_step_check_errors(step_), SG_OK) << sg_last_error();
    EXPECT_EQ(sg_tensor_destroy(x), SG_OK);
    EXPECT_EQ(sg_tensor_destroy(y), SG_OK);
    return losses;
  }

  sg_context ctx_ = nullptr;
  sg_layer model_ = nullptr;
  sg_optimizer optimizer_ = nullptr;
  sg_train_step step_ = nullptr;
};

TEST_F(LanguageModelTest, ConfigsStartVersionedWithTheEngineDefaults) {
  sg_language_model_config model;
  std::memset(&model, 0xab, sizeof(model));
  sg_language_model_config_default(&model);
  EXPECT_EQ(model.size, sizeof(sg_language_model_config));
  EXPECT_EQ(model.magic, SG_LANGUAGE_MODEL_CONFIG_MAGIC);
  EXPECT_EQ(model.version, static_cast<uint32_t>(SG_LANGUAGE_MODEL_CONFIG_VERSION));
  EXPECT_GT(model.heads, 0);  // a GPT
  EXPECT_EQ(model.fp8, 0);
  EXPECT_EQ(model.fp8_recipe.scaling, SG_FP8_CURRENT);
  EXPECT_EQ(model.tensor_parallel, nullptr);
  EXPECT_EQ(model.overlap, nullptr);
  sg_language_model_config_default(nullptr);

  sg_optimizer_config options;
  std::memset(&options, 0xab, sizeof(options));
  sg_optimizer_config_default(&options);
  // The initializer and the function agree field by field (padding bytes may differ).
  const sg_optimizer_config initializer = SG_OPTIMIZER_CONFIG_INITIALIZER;
  sg_adamw_config adamw;
  sg_adamw_config_default(&adamw);
  for (const sg_optimizer_config* c : std::initializer_list<const sg_optimizer_config*>{&options, &initializer}) {
    EXPECT_EQ(c->size, sizeof(sg_optimizer_config));
    EXPECT_EQ(c->magic, SG_OPTIMIZER_CONFIG_MAGIC);
    EXPECT_EQ(c->version, static_cast<uint32_t>(SG_OPTIMIZER_CONFIG_VERSION));
    EXPECT_EQ(c->adamw.lr, adamw.lr);
    EXPECT_EQ(c->adamw.beta1, adamw.beta1);
    EXPECT_EQ(c->adamw.beta2, adamw.beta2);
    EXPECT_EQ(c->adamw.eps, adamw.eps);
    EXPECT_EQ(c->adamw.weight_decay, adamw.weight_decay);
    EXPECT_EQ(c->schedule, 0);
    EXPECT_EQ(c->lr_schedule.kind, 0);
    EXPECT_EQ(c->lr_schedule.base, adamw.lr);
    EXPECT_EQ(c->lr_schedule.min_lr, 0.0f);
    EXPECT_EQ(c->lr_schedule.warmup, 0);
    EXPECT_EQ(c->lr_schedule.total, 0);
    EXPECT_EQ(c->loss_scale_initial, 65536.0f);
    EXPECT_EQ(c->loss_scale_growth_factor, 2.0f);
    EXPECT_EQ(c->loss_scale_backoff_factor, 0.5f);
    EXPECT_EQ(c->step_scoped_gradients, 0);
  }
  EXPECT_EQ(options.skip_nonfinite, 0);
  EXPECT_EQ(options.loss_scaling, 0);
  EXPECT_EQ(options.loss_scale_growth_interval, 2000);
}

TEST_F(LanguageModelTest, GptTrainsOnTokenIdsWithItsPacking) {
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.adamw.lr = 1e-2f;
  options.skip_nonfinite = 1;
  build(small_gpt(), options, 32);  // 4 sequences of 8
  char kind[32];
  ASSERT_SG_OK(sg_layer_kind(model_, kind, sizeof(kind), nullptr));
  EXPECT_STREQ(kind, "language_model");
  sg_tensor x = nullptr;
  sg_tensor labels = nullptr;
  sg_tensor packing = nullptr;
  ASSERT_SG_OK(sg_train_step_inputs(step_, &x, &labels));
  ASSERT_SG_OK(sg_train_step_packing(step_, &packing));
  EXPECT_EQ(dims(x), (std::vector<int64_t>{32, 1}));
  EXPECT_EQ(dims(labels), (std::vector<int64_t>{32}));
  ASSERT_NE(packing, nullptr);
  std::vector<int32_t> cu(5);
  ASSERT_SG_OK(sg_tensor_copy_to_host(packing, cu.data(), cu.size() * 4));
  EXPECT_EQ(cu, (std::vector<int32_t>{0, 8, 16, 24, 32}));
  for (sg_tensor t : {x, labels, packing}) ASSERT_SG_OK(sg_tensor_destroy(t));

  std::vector<int32_t> tokens(32);
  std::vector<int32_t> next(32);
  for (int i = 0; i < 32; ++i) tokens[i] = (i * 5) % 16;
  for (int i = 0; i < 32; ++i) next[i] = tokens[(i + 1) % 32];
  const std::vector<float> losses = train(tokens, next, 8);
  for (float loss : losses) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(losses.back(), losses.front());
  int64_t skipped = -1;
  ASSERT_SG_OK(sg_optimizer_skipped_steps(optimizer_, &skipped));
  EXPECT_EQ(skipped, 0);
  float scale = 0;
  ASSERT_SG_OK(sg_optimizer_loss_scale(optimizer_, &scale));
  EXPECT_EQ(scale, 1.0f);  // no loss scaling

  // Its input is tokens with their packing: no forward of its own.
  sg_tensor activations = nullptr;
  const int64_t shape[2] = {4, 16};
  ASSERT_SG_OK(sg_tensor_create(ctx_, "x", SG_DTYPE_FLOAT32, 2, shape, &activations));
  sg_tensor y = nullptr;
  sg_saved saved = nullptr;
  expect_error(sg_layer_forward(model_, activations, &y, &saved), "train it with a train step");
  ASSERT_SG_OK(sg_tensor_destroy(activations));
}

TEST_F(LanguageModelTest, PackedSequencesOfAnyLengths) {
  build(small_gpt(), SG_OPTIMIZER_CONFIG_INITIALIZER, 24, 5);
  sg_tensor packing = nullptr;
  ASSERT_SG_OK(sg_train_step_packing(step_, &packing));
  std::vector<int32_t> cu(6);
  ASSERT_SG_OK(sg_tensor_copy_to_host(packing, cu.data(), cu.size() * 4));
  EXPECT_EQ(cu, (std::vector<int32_t>{0, 24, 24, 24, 24, 24}));  // one sequence of every token, then empty ones
  const std::vector<int32_t> lengths{0, 5, 13, 13, 20, 24};
  ASSERT_SG_OK(sg_tensor_copy_from_host(packing, lengths.data(), lengths.size() * 4));
  ASSERT_SG_OK(sg_tensor_destroy(packing));
  std::vector<int32_t> tokens(24, 3);
  const std::vector<float> losses = train(tokens, tokens, 2);
  EXPECT_LT(losses[1], losses[0]);
}

TEST_F(LanguageModelTest, WindowModelTakesOneExamplePerRow) {
  sg_language_model_config model = small_gpt();
  model.heads = 0;
  model.context = 4;  // hidden 16: 4 embedding columns per token
  build(model, SG_OPTIMIZER_CONFIG_INITIALIZER, 6);
  sg_tensor x = nullptr;
  sg_tensor packing = reinterpret_cast<sg_tensor>(1);
  ASSERT_SG_OK(sg_train_step_inputs(step_, &x, nullptr));
  ASSERT_SG_OK(sg_train_step_packing(step_, &packing));
  EXPECT_EQ(dims(x), (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(packing, nullptr);  // no attention, no packing
  ASSERT_SG_OK(sg_tensor_destroy(x));
  const std::vector<float> losses = train(std::vector<int32_t>(24, 1), std::vector<int32_t>(6, 2), 3);
  EXPECT_LT(losses[2], losses[0]);
}

TEST_F(LanguageModelTest, StepScopedGradientsTrainLikePersistentOnes) {
  std::vector<int32_t> tokens(32);
  for (int i = 0; i < 32; ++i) tokens[i] = (i * 7 + 3) % 16;
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  build(small_gpt(), options, 32);
  const std::vector<float> persistent = train(tokens, tokens, 3);
  TearDown();
  SetUp();
  step_ = nullptr;
  optimizer_ = nullptr;
  model_ = nullptr;
  options.step_scoped_gradients = 1;
  build(small_gpt(), options, 32);
  EXPECT_EQ(train(tokens, tokens, 3), persistent);
}

TEST_F(LanguageModelTest, LossScalingStartsAtItsInitialScale) {
  sg_language_model_config model = small_gpt();
  model.dtype = SG_DTYPE_FLOAT16;
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.loss_scaling = 1;
  options.skip_nonfinite = 1;  // an overflowing step is skipped
  options.loss_scale_initial = 1024.0f;
  options.loss_scale_growth_interval = 1;
  build(model, options, 32);
  float scale = 0;
  ASSERT_SG_OK(sg_optimizer_loss_scale(optimizer_, &scale));
  EXPECT_EQ(scale, 1024.0f);
  train(std::vector<int32_t>(32, 1), std::vector<int32_t>(32, 2), 1);
  ASSERT_SG_OK(sg_optimizer_loss_scale(optimizer_, &scale));
  EXPECT_EQ(scale, 2048.0f);  // one good step grows it with an interval of 1
}

TEST_F(LanguageModelTest, BadConfigsAreRefusedNamingTheField) {
  sg_language_model_config model = small_gpt();
  model.magic = 0;
  expect_error(sg_language_model_create(ctx_, &model, &model_),
               "sg_language_model_create: config (sg_language_model_config) was not initialised");
  model = small_gpt();
  model.version = SG_LANGUAGE_MODEL_CONFIG_VERSION + 1;
  expect_error(sg_language_model_create(ctx_, &model, &model_), "built against a newer stepgraph.h");
  model = small_gpt();
  model.size = sizeof(model) - 8;
  expect_error(sg_language_model_create(ctx_, &model, &model_), "built against an older");
  model = small_gpt();
  model.fp8_weight_cache = 1;
  expect_error(sg_language_model_create(ctx_, &model, &model_), "config fp8_weight_cache applies to FP8 GEMMs");
  model = small_gpt();
  model.fp8 = 2;
  expect_error(sg_language_model_create(ctx_, &model, &model_), "config fp8");
  model = small_gpt();
  model.overlap = "bulk";
  expect_error(sg_language_model_create(ctx_, &model, &model_), "tensor_parallel is NULL");
  model = small_gpt();
  model.heads = 0;
  model.kv_heads = 1;
  expect_error(sg_language_model_create(ctx_, &model, &model_), "config kv_heads (1) and rope_base");
  model = small_gpt();
  model.topk = 1;
  expect_error(sg_language_model_create(ctx_, &model, &model_), "config topk (1) and moe_every");
  EXPECT_EQ(model_, nullptr);

  model = small_gpt();
  ASSERT_SG_OK(sg_language_model_create(ctx_, &model, &model_));
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.loss_scale_growth_interval = 10;
  expect_error(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_), "config->loss_scaling is 0");
  options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.loss_scaling = 1;
  expect_error(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_),
               "config->loss_scaling skips the steps whose scaled gradients overflow, and config->skip_nonfinite is 0");
  options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.lr_schedule.kind = 1;
  expect_error(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_), "config->schedule is 0");
  options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.skip_nonfinite = 1;
  options.step_scoped_gradients = 1;
  expect_error(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_), "non-finite skip");
  options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.version = 7;
  expect_error(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_), "config (sg_optimizer_config) version 7");
  EXPECT_EQ(optimizer_, nullptr);
  options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  ASSERT_SG_OK(sg_optimizer_create(ctx_, &model_, 1, &options, &optimizer_));
}

}  // namespace
