// Checkpoints through the C API on the host (sg_checkpoint_save,
// sg_checkpoint_load): a GPT's whole training state with its optimizer's
// (dropout generator, non-finite skip, loss scale included) saved, loaded into
// a new context, model and optimizer, and trained on bit for bit; the caller's
// metadata back; a residual stack's; and the refusals: another model (the
// tensor named, nothing loaded), a corrupted file, an optimizer over other
// parameters, bad metadata and configs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "capi/stepgraph.h"
#include "tests/capi/capi_test_support.h"

namespace {

void expect_error(sg_result result, sg_result code, const std::string& words) {
  EXPECT_EQ(result, code) << sg_last_error();
  const std::string message = sg_last_error();
  EXPECT_NE(message.find(words), std::string::npos) << message;
}

std::string temporary_path(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + info->name() + "." + name;
  std::remove(path.c_str());
  return path;
}

// A small fp16 GPT with dropout: every kind of state a checkpoint holds (the
// dropout generator, the loss scale) has a part in its steps.
sg_language_model_config small_gpt(int64_t hidden = 16) {
  sg_language_model_config c;
  sg_language_model_config_default(&c);
  c.vocab = 16;
  c.hidden = hidden;
  c.ffn = 32;
  c.layers = 1;
  c.heads = 2;
  c.context = 8;
  c.dtype = SG_DTYPE_FLOAT16;
  c.dropout = 0.1f;
  c.seed = 5;
  return c;
}

sg_optimizer_config optimizer_options() {
  sg_optimizer_config o = SG_OPTIMIZER_CONFIG_INITIALIZER;
  o.adamw.lr = 1e-2f;
  o.skip_nonfinite = 1;
  o.loss_scaling = 1;
  o.loss_scale_growth_interval = 2;  // the scale grows within the test's steps
  return o;
}

constexpr int64_t kTokens = 16;  // two sequences of 8

// Step s's batch: token ids and their next tokens.
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> labels;
};

Batch batch_of_step(int s) {
  Batch batch{std::vector<int32_t>(kTokens), std::vector<int32_t>(kTokens)};
  for (int64_t i = 0; i < kTokens; ++i) {
    batch.tokens[i] = static_cast<int32_t>((i * 5 + s * 3) % 16);
    batch.labels[i] = static_cast<int32_t>((i * 5 + s * 3 + 1) % 16);
  }
  return batch;
}

// One run: a context, a model, its optimizer and a train step.
struct TrainingRun {
  explicit TrainingRun(const sg_language_model_config& model) {
    EXPECT_EQ(sg_context_create(SG_DEVICE_HOST, 1, &ctx), SG_OK);
    EXPECT_EQ(sg_language_model_create(ctx, &model, &layer), SG_OK) << sg_last_error();
    const sg_optimizer_config options = optimizer_options();
    EXPECT_EQ(sg_optimizer_create(ctx, &layer, 1, &options, &optimizer), SG_OK) << sg_last_error();
    sg_train_step_config config = SG_TRAIN_STEP_CONFIG_INITIALIZER;
    config.tokens = kTokens;
    EXPECT_EQ(sg_train_step_create(layer, optimizer, &config, &step), SG_OK) << sg_last_error();
  }
  ~TrainingRun() {
    EXPECT_EQ(sg_train_step_destroy(step), SG_OK);
    EXPECT_EQ(sg_optimizer_destroy(optimizer), SG_OK);
    EXPECT_EQ(sg_layer_destroy(layer), SG_OK);
    EXPECT_EQ(sg_context_destroy(ctx), SG_OK);
  }
  TrainingRun(const TrainingRun&) = delete;
  TrainingRun& operator=(const TrainingRun&) = delete;

  // Steps [first, first + count) on each step's own batch; their losses.
  std::vector<float> train(int first, int count) {
    sg_tensor x = nullptr;
    sg_tensor y = nullptr;
    EXPECT_EQ(sg_train_step_inputs(step, &x, &y), SG_OK);
    std::vector<float> losses;
    for (int s = first; s < first + count; ++s) {
      const Batch batch = batch_of_step(s);
      copy_step_inputs(x, y, batch.tokens, batch.labels);
      losses.push_back(run_step_loss(step));
    }
    EXPECT_EQ(sg_tensor_destroy(x), SG_OK);
    EXPECT_EQ(sg_tensor_destroy(y), SG_OK);
    return losses;
  }

  // Every parameter's fp32 master, end to end.
  std::vector<float> masters() {
    int64_t count = 0;
    EXPECT_EQ(sg_layer_parameter_count(layer, &count), SG_OK);
    std::vector<float> out;
    for (int64_t i = 0; i < count; ++i) {
      sg_tensor master = nullptr;
      EXPECT_EQ(sg_layer_parameter(layer, i, nullptr, 0, nullptr, &master, nullptr, nullptr), SG_OK);
      int64_t numel = 0;
      EXPECT_EQ(sg_tensor_numel(master, &numel), SG_OK);
      std::vector<float> values(static_cast<size_t>(numel));
      EXPECT_EQ(sg_tensor_copy_to_host(master, values.data(), values.size() * sizeof(float)), SG_OK);
      out.insert(out.end(), values.begin(), values.end());
      EXPECT_EQ(sg_tensor_destroy(master), SG_OK);
    }
    return out;
  }

  sg_result save(const std::string& path, const std::map<std::string, std::string>& metadata = {}) {
    std::vector<const char*> keys;
    std::vector<const char*> values;
    for (const auto& [k, v] : metadata) {
      keys.push_back(k.c_str());
      values.push_back(v.c_str());
    }
    sg_checkpoint_config config = SG_CHECKPOINT_CONFIG_INITIALIZER;
    config.metadata_keys = keys.data();
    config.metadata_values = values.data();
    config.metadata_count = keys.size();
    return sg_checkpoint_save(layer, optimizer, path.c_str(), &config);
  }

  // Loads `path`; the metadata it hands back into *metadata.
  sg_result load(const std::string& path, std::map<std::string, std::string>* metadata = nullptr) {
    sg_checkpoint_config config;
    sg_checkpoint_config_default(&config);
    sg_checkpoint_metadata entries = nullptr;
    const sg_result result = sg_checkpoint_load(layer, optimizer, path.c_str(), &config, &entries);
    if (result != SG_OK) return result;
    size_t count = 0;
    EXPECT_EQ(sg_checkpoint_metadata_count(entries, &count), SG_OK);
    for (size_t i = 0; i < count && metadata != nullptr; ++i) {
      size_t key_length = 0;
      size_t value_length = 0;
      EXPECT_EQ(sg_checkpoint_metadata_entry(entries, i, nullptr, 0, &key_length, nullptr, 0, &value_length), SG_OK);
      std::string key(key_length + 1, '\0');
      std::string value(value_length + 1, '\0');
      EXPECT_EQ(sg_checkpoint_metadata_entry(entries, i, key.data(), key.size(), nullptr, value.data(), value.size(),
                                             nullptr),
                SG_OK);
      key.pop_back();
      value.pop_back();
      (*metadata)[key] = value;
    }
    EXPECT_EQ(sg_checkpoint_metadata_destroy(entries), SG_OK);
    return result;
  }

  sg_context ctx = nullptr;
  sg_layer layer = nullptr;
  sg_optimizer optimizer = nullptr;
  sg_train_step step = nullptr;
};

TEST(CheckpointTest, ConfigStartsVersioned) {
  sg_checkpoint_config config;
  sg_checkpoint_config_default(&config);
  EXPECT_EQ(config.size, sizeof(sg_checkpoint_config));
  EXPECT_EQ(config.magic, SG_CHECKPOINT_CONFIG_MAGIC);
  EXPECT_EQ(config.version, static_cast<uint32_t>(SG_CHECKPOINT_CONFIG_VERSION));
  EXPECT_EQ(config.world, nullptr);
  EXPECT_EQ(config.metadata_count, 0u);
  sg_checkpoint_config_default(nullptr);
  EXPECT_EQ(sg_api_version(), 11);
}

TEST(CheckpointTest, ALoadedRunContinuesBitForBit) {
  const std::string path = temporary_path("gpt.safetensors");
  std::vector<float> uninterrupted;
  std::vector<float> saved_masters;
  {
    TrainingRun run(small_gpt());
    const std::vector<float> first = run.train(0, 3);
    ASSERT_SG_OK(run.save(path, {{"data.position", "48"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}}));
    saved_masters = run.masters();
    uninterrupted = run.train(3, 3);
    EXPECT_NE(first, uninterrupted);
  }
  TrainingRun resumed(small_gpt());
  EXPECT_NE(resumed.masters(), saved_masters);
  std::map<std::string, std::string> metadata;
  ASSERT_SG_OK(resumed.load(path, &metadata));
  EXPECT_EQ(resumed.masters(), saved_masters);
  const std::map<std::string, std::string> expected{
      {"data.position", "48"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}, {"stepgraph.step", "3"}};
  EXPECT_EQ(metadata, expected);
  int64_t steps = 0;
  ASSERT_SG_OK(sg_optimizer_steps_taken(resumed.optimizer, &steps));
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(resumed.train(3, 3), uninterrupted);  // the generator, moments and loss scale came back too
}

TEST(CheckpointTest, ACapturedStepReplaysFromTheLoadedState) {
  const std::string path = temporary_path("gpt.safetensors");
  TrainingRun run(small_gpt());
  run.train(0, 2);
  ASSERT_SG_OK(run.save(path));
  const std::vector<float> after = run.train(2, 1);
  TrainingRun other(small_gpt());
  sg_graph graph = nullptr;
  ASSERT_SG_OK(sg_train_step_capture(other.step, SG_POOL_REPORT_ERROR, &graph));
  ASSERT_SG_OK(other.load(path));
  sg_tensor x = nullptr;
  sg_tensor y = nullptr;
  ASSERT_SG_OK(sg_train_step_inputs(other.step, &x, &y));
  const Batch batch = batch_of_step(2);
  copy_step_inputs(x, y, batch.tokens, batch.labels);
  ASSERT_FALSE(HasFailure()) << "step 2's batch was not written";
  ASSERT_SG_OK(sg_graph_replay(graph, nullptr, nullptr, 0));
  sg_tensor loss = nullptr;
  ASSERT_SG_OK(sg_graph_output(graph, 0, &loss));
  float value = NAN;
  ASSERT_SG_OK(sg_tensor_copy_to_host(loss, &value, sizeof(value)));
  EXPECT_EQ(value, after.at(0));
  for (sg_tensor t : {loss, x, y}) ASSERT_SG_OK(sg_tensor_destroy(t));
  ASSERT_SG_OK(sg_graph_destroy(graph));
}

TEST(CheckpointTest, AResidualStackRoundTrips) {
  sg_context ctx = nullptr;
  ASSERT_SG_OK(sg_context_create(SG_DEVICE_HOST, 1, &ctx));
  const sg_residual_stack_config config = small_fp32_stack_config();
  sg_layer stacks[2] = {nullptr, nullptr};
  sg_optimizer optimizers[2] = {nullptr, nullptr};
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  for (int i = 0; i < 2; ++i) {
    sg_residual_stack_config c = config;
    c.seed = static_cast<uint32_t>(i + 1);
    ASSERT_SG_OK(sg_residual_stack_create(ctx, &c, &stacks[i]));
    ASSERT_SG_OK(sg_optimizer_create(ctx, &stacks[i], 1, &options, &optimizers[i]));
  }
  const std::string path = temporary_path("stack.safetensors");
  sg_checkpoint_config checkpoint = SG_CHECKPOINT_CONFIG_INITIALIZER;
  ASSERT_SG_OK(sg_optimizer_step(optimizers[0]));
  ASSERT_SG_OK(sg_checkpoint_save(stacks[0], optimizers[0], path.c_str(), &checkpoint));
  ASSERT_SG_OK(sg_checkpoint_load(stacks[1], optimizers[1], path.c_str(), &checkpoint, nullptr));
  int64_t steps = 0;
  ASSERT_SG_OK(sg_optimizer_steps_taken(optimizers[1], &steps));
  EXPECT_EQ(steps, 1);
  sg_tensor masters[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    ASSERT_SG_OK(sg_layer_parameter(stacks[i], 0, nullptr, 0, nullptr, &masters[i], nullptr, nullptr));
  }
  int64_t bytes = 0;
  ASSERT_SG_OK(sg_tensor_bytes(masters[0], &bytes));
  std::vector<char> a(static_cast<size_t>(bytes));
  std::vector<char> b(static_cast<size_t>(bytes));
  ASSERT_SG_OK(sg_tensor_copy_to_host(masters[0], a.data(), a.size()));
  ASSERT_SG_OK(sg_tensor_copy_to_host(masters[1], b.data(), b.size()));
  EXPECT_EQ(a, b);
  // A stack's optimizer with a language model, or a plain layer: refused, naming what is wrong.
  sg_layer linear = nullptr;
  sg_linear_config linear_config;
  sg_linear_config_default(&linear_config);
  linear_config.in_features = 8;
  linear_config.out_features = 8;
  linear_config.dtype = SG_DTYPE_FLOAT32;
  ASSERT_SG_OK(sg_linear_create(ctx, "l", &linear_config, 1, &linear));
  expect_error(sg_checkpoint_save(linear, optimizers[0], path.c_str(), &checkpoint), SG_ERROR_INVALID_ARGUMENT,
               "model is a linear layer");
  expect_error(sg_checkpoint_save(stacks[1], optimizers[0], path.c_str(), &checkpoint), SG_ERROR_INVALID_ARGUMENT,
               "pass the optimizer made over this model's parameters");
  ASSERT_SG_OK(sg_layer_destroy(linear));
  for (int i = 0; i < 2; ++i) {
    ASSERT_SG_OK(sg_tensor_destroy(masters[i]));
    ASSERT_SG_OK(sg_optimizer_destroy(optimizers[i]));
    ASSERT_SG_OK(sg_layer_destroy(stacks[i]));
  }
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST(CheckpointTest, AnotherModelIsRefusedNamingTheTensorAndNothingIsLoaded) {
  const std::string path = temporary_path("gpt.safetensors");
  {
    TrainingRun run(small_gpt());
    run.train(0, 1);
    ASSERT_SG_OK(run.save(path));
  }
  TrainingRun wider(small_gpt(/*hidden=*/32));
  const std::vector<float> before = wider.masters();
  sg_checkpoint_config config = SG_CHECKPOINT_CONFIG_INITIALIZER;
  expect_error(sg_checkpoint_load(wider.layer, wider.optimizer, path.c_str(), &config, nullptr), SG_ERROR_IO,
               "checkpoint tensor '");
  EXPECT_NE(std::string(sg_last_error()).find("but this model's is"), std::string::npos) << sg_last_error();
  EXPECT_EQ(wider.masters(), before);
  int64_t steps = -1;
  ASSERT_SG_OK(sg_optimizer_steps_taken(wider.optimizer, &steps));
  EXPECT_EQ(steps, 0);
}

TEST(CheckpointTest, ACorruptedOrMissingFileIsRefused) {
  const std::string path = temporary_path("gpt.safetensors");
  TrainingRun run(small_gpt());
  ASSERT_SG_OK(run.save(path));
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() - 5] ^= 0x10;  // one bit of the data
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  const std::vector<float> before = run.masters();
  sg_checkpoint_config config = SG_CHECKPOINT_CONFIG_INITIALIZER;
  expect_error(sg_checkpoint_load(run.layer, run.optimizer, path.c_str(), &config, nullptr), SG_ERROR_IO, "checksum");
  EXPECT_EQ(run.masters(), before);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() / 2);
  expect_error(sg_checkpoint_load(run.layer, run.optimizer, path.c_str(), &config, nullptr), SG_ERROR_IO, path);
  const std::string missing = path + ".missing";
  expect_error(sg_checkpoint_load(run.layer, run.optimizer, missing.c_str(), &config, nullptr), SG_ERROR_IO, missing);
}

TEST(CheckpointTest, BadMetadataAndConfigsAreRefusedNamingTheField) {
  const std::string path = temporary_path("gpt.safetensors");
  TrainingRun run(small_gpt());
  expect_error(run.save(path, {{"stepgraph.step", "9"}}), SG_ERROR_INVALID_ARGUMENT,
               "config->metadata_keys[0] is \"stepgraph.step\", an entry the library writes itself");
  expect_error(run.save(path, {{"", "x"}}), SG_ERROR_INVALID_ARGUMENT, "config->metadata_keys[0] is empty");
  const char* keys[] = {"a", "a"};
  const char* values[] = {"1", nullptr};
  sg_checkpoint_config config = SG_CHECKPOINT_CONFIG_INITIALIZER;
  config.metadata_keys = keys;
  config.metadata_values = values;
  config.metadata_count = 2;
  expect_error(sg_checkpoint_save(run.layer, run.optimizer, path.c_str(), &config), SG_ERROR_INVALID_ARGUMENT,
               "config->metadata_values[1] is NULL");
  values[1] = "2";
  expect_error(sg_checkpoint_save(run.layer, run.optimizer, path.c_str(), &config), SG_ERROR_INVALID_ARGUMENT,
               "config->metadata_keys[1] \"a\" is given twice");
  expect_error(sg_checkpoint_load(run.layer, run.optimizer, path.c_str(), &config, nullptr),
               SG_ERROR_INVALID_ARGUMENT, "leave them NULL and 0");
  sg_checkpoint_config uninitialised{};
  expect_error(sg_checkpoint_save(run.layer, run.optimizer, path.c_str(), &uninitialised), SG_ERROR_INVALID_ARGUMENT,
               "sg_checkpoint_config_default");
  sg_checkpoint_config plain = SG_CHECKPOINT_CONFIG_INITIALIZER;
  expect_error(sg_checkpoint_save(run.layer, run.optimizer, "", &plain), SG_ERROR_INVALID_ARGUMENT, "path is empty");
  expect_error(sg_checkpoint_save(run.layer, run.optimizer, nullptr, &plain), SG_ERROR_INVALID_ARGUMENT,
               "path is NULL");
  expect_error(sg_checkpoint_save(run.layer, run.optimizer, path.c_str(), nullptr), SG_ERROR_INVALID_ARGUMENT,
               "config is NULL");
  ASSERT_SG_OK(sg_checkpoint_save(run.layer, run.optimizer, path.c_str(), &plain));
  sg_checkpoint_metadata metadata = nullptr;
  ASSERT_SG_OK(sg_checkpoint_load(run.layer, run.optimizer, path.c_str(), &plain, &metadata));
  expect_error(sg_checkpoint_metadata_entry(metadata, 1, nullptr, 0, nullptr, nullptr, 0, nullptr),
               SG_ERROR_INVALID_ARGUMENT, "index 1 is past the 1 entries");
  ASSERT_SG_OK(sg_checkpoint_metadata_destroy(metadata));
  expect_error(sg_checkpoint_metadata_destroy(metadata), SG_ERROR_INVALID_ARGUMENT, "already destroyed");
}

}  // namespace
