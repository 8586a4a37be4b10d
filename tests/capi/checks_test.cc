// The C API refuses the values a C caller can pass that the Python binding
// refuses too: a wrapped tensor's byte count past int64 or the address space
// (whatever the address), flags other than 0 or 1, a norm's eps that is not
// finite or is negative, a schedule's negative total, and fields the layer
// would ignore (another scaling's FP8 fields, topk without experts, a
// constant schedule's decay). sg_layer_check_errors
// reports an FP8 layer's non-finite amaxes where the recipe says stop. A step
// may return a persistent tensor that no op of it read. On the host.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "capi/stepgraph.h"
#include "tests/capi/capi_test_support.h"

namespace {

// The call fails with SG_ERROR_INVALID_ARGUMENT and a message holding every word.
#define EXPECT_INVALID(call, ...)                                                            \
  do {                                                                                       \
    EXPECT_EQ((call), SG_ERROR_INVALID_ARGUMENT) << #call;                                   \
    const std::string message = sg_last_error();                                             \
    for (const char* word : {__VA_ARGS__}) {                                                 \
      EXPECT_NE(message.find(word), std::string::npos) << "'" << word << "' in " << message; \
    }                                                                                        \
  } while (0)

// A square fp32 Linear of `features`, the engine's defaults otherwise.
sg_linear_config fp32_linear_config(int64_t features) {
  sg_linear_config config;
  sg_linear_config_default(&config);
  config.in_features = config.out_features = features;
  config.dtype = SG_DTYPE_FLOAT32;
  return config;
}

class CapiChecksTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_SG_OK(sg_context_create(SG_DEVICE_HOST, 0, &ctx_)); }
  void TearDown() override { sg_context_destroy(ctx_); }
  sg_context ctx_ = nullptr;
};

TEST_F(CapiChecksTest, WrapChecksTheByteCountForEveryAddress) {
  std::vector<float> memory(4);
  sg_tensor t = nullptr;
  const int64_t elements_overflow[] = {int64_t{1} << 32, int64_t{1} << 32};
  EXPECT_INVALID(sg_tensor_wrap(ctx_, "w", SG_DTYPE_FLOAT32, 2, elements_overflow, nullptr, memory.data(), &t),
                 "sg_tensor_wrap 'w'", "more elements than int64");
  const int64_t bytes_overflow[] = {int64_t{1} << 31, int64_t{1} << 31};  // 2^62 elements, 2^64 bytes
  EXPECT_INVALID(sg_tensor_wrap(ctx_, "w", SG_DTYPE_FLOAT32, 2, bytes_overflow, nullptr, memory.data(), &t),
                 "sg_tensor_wrap 'w'", "more bytes than int64");
  EXPECT_EQ(t, nullptr);
  // A count that fits int64 but runs past the end of the address space.
  const int64_t large[] = {int64_t{1} << 40};
  void* near_end = reinterpret_cast<void*>(std::numeric_limits<std::uintptr_t>::max() - 4095);
  EXPECT_INVALID(sg_tensor_wrap(ctx_, "w", SG_DTYPE_FLOAT32, 1, large, nullptr, near_end, &t),
                 "pass the end of the address space");
  const int64_t fits[] = {4};
  ASSERT_SG_OK(sg_tensor_wrap(ctx_, "w", SG_DTYPE_FLOAT32, 1, fits, nullptr, memory.data(), &t));
  ASSERT_SG_OK(sg_tensor_destroy(t));
}

TEST_F(CapiChecksTest, FlagsAreZeroOrOne) {
  sg_linear_config config = fp32_linear_config(16);
  sg_layer layer = nullptr;
  config.bias = 2;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "sg_linear_create", "config bias is a flag",
                 "got 2");
  config.bias = 1;
  config.wgrad = -1;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "config wgrad is a flag", "got -1");
  config.wgrad = 1;
  sg_fp8_recipe recipe;
  sg_fp8_recipe_default(&recipe, SG_FP8_CURRENT);
  recipe.stop_on_non_finite = 7;
  config.fp8 = 1;
  config.fp8_recipe = recipe;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "sg_linear_create",
                 "recipe stop_on_non_finite is a flag", "got 7");
  sg_fp8_recipe_default(&config.fp8_recipe, SG_FP8_CURRENT);
  config.fp8_recipe.hybrid = 3;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "recipe hybrid is a flag");
  config.fp8 = 2;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "config fp8 is a flag", "got 2");
  EXPECT_EQ(layer, nullptr);
}

TEST_F(CapiChecksTest, FieldsThatWouldBeIgnoredAreRefused) {
  sg_linear_config config = fp32_linear_config(16);
  sg_layer layer = nullptr;
  sg_fp8_recipe recipe;
  sg_fp8_recipe_default(&recipe, SG_FP8_CURRENT);
  recipe.margin = 2;  // delayed scaling's
  config.fp8 = 1;
  config.fp8_recipe = recipe;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "margin (2)", "apply to delayed scaling only");
  sg_fp8_recipe_default(&config.fp8_recipe, SG_FP8_DELAYED);
  config.fp8_recipe.power_of_two_scales = 0;  // block scaling's
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &config, 1, &layer), "power_of_two_scales", "block scaling only");
  config.fp8 = 0;
  sg_residual_stack_config stack = small_fp32_stack_config();
  stack.topk = 1;  // experts is 0
  EXPECT_INVALID(sg_residual_stack_create(ctx_, &stack, &layer), "config topk (1)", "experts is 0");
  stack = small_fp32_stack_config();
  stack.overlap = "bulk";  // without a tensor-parallel world
  EXPECT_INVALID(sg_residual_stack_create(ctx_, &stack, &layer), "config overlap", "tensor_parallel is NULL");
  ASSERT_SG_OK(sg_linear_create(ctx_, "fc", &config, 1, &layer));
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.schedule = 1;
  options.lr_schedule = sg_lr_schedule{0, 1e-3f, 1e-4f, 0, 100};
  sg_optimizer optimizer = nullptr;
  EXPECT_INVALID(sg_optimizer_create(ctx_, &layer, 1, &options, &optimizer), "schedule->min_lr",
                 "a constant one (kind 0) ignores them");
  sg_layer_destroy(layer);
  EXPECT_EQ(optimizer, nullptr);
}

// Every layer config carries size, magic and version: a struct not made by its _default
// function, or from another stepgraph.h, is refused naming the struct and what to do.
TEST_F(CapiChecksTest, LayerConfigsAreVersioned) {
  sg_layer layer = nullptr;
  sg_linear_config linear = fp32_linear_config(8);
  linear.magic = 0;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &linear, 1, &layer), "sg_linear_create: config (sg_linear_config) was "
                 "not initialised", "start from sg_linear_config_default");
  linear = fp32_linear_config(8);
  linear.version = SG_LINEAR_CONFIG_VERSION + 1;
  EXPECT_INVALID(sg_linear_create(ctx_, "fc", &linear, 1, &layer), "built against a newer stepgraph.h");
  sg_norm_config norm;
  sg_norm_config_default(&norm);
  norm.size -= 8;
  EXPECT_INVALID(sg_norm_create(ctx_, "n", &norm, &layer), "config (sg_norm_config) size", "an older");
  sg_layernorm_linear_config norm_linear;
  sg_layernorm_linear_config_default(&norm_linear);
  norm_linear.version = 0;
  EXPECT_INVALID(sg_layernorm_linear_create(ctx_, "l", &norm_linear, 1, &layer), "version 0 is not a version");
  sg_layernorm_mlp_config mlp;
  std::memset(&mlp, 0, sizeof(mlp));  // never initialised
  EXPECT_INVALID(sg_layernorm_mlp_create(ctx_, "m", &mlp, 1, &layer), "sg_layernorm_mlp_config_default");
  sg_residual_stack_config stack = small_fp32_stack_config();
  stack.magic = SG_LINEAR_CONFIG_MAGIC;  // another struct's
  EXPECT_INVALID(sg_residual_stack_create(ctx_, &stack, &layer), "config (sg_residual_stack_config) was not "
                 "initialised");
  EXPECT_EQ(layer, nullptr);
}

TEST_F(CapiChecksTest, EpsMustBeFiniteAndNotNegative) {
  sg_layer layer = nullptr;
  for (const float eps : {std::numeric_limits<float>::infinity(), std::nanf(""), -1e-5f}) {
    SCOPED_TRACE(eps);
    sg_norm_config norm;
    sg_norm_config_default(&norm);
    norm.hidden = 8;
    norm.eps = eps;
    EXPECT_INVALID(sg_norm_create(ctx_, "n", &norm, &layer), "sg_norm_create", "config eps must be finite and >= 0");
    sg_layernorm_linear_config norm_linear;
    sg_layernorm_linear_config_default(&norm_linear);
    norm_linear.in_features = norm_linear.out_features = 8;
    norm_linear.eps = eps;
    EXPECT_INVALID(sg_layernorm_linear_create(ctx_, "l", &norm_linear, 1, &layer), "config eps must be finite");
    sg_layernorm_mlp_config mlp;
    sg_layernorm_mlp_config_default(&mlp);
    mlp.hidden = 8;
    mlp.ffn = 16;
    mlp.eps = eps;
    EXPECT_INVALID(sg_layernorm_mlp_create(ctx_, "m", &mlp, 1, &layer), "config eps must be finite");
    sg_residual_stack_config stack = small_fp32_stack_config();
    stack.eps = eps;
    EXPECT_INVALID(sg_residual_stack_create(ctx_, &stack, &layer), "sg_residual_stack_create",
                   "config eps must be finite");
  }
  EXPECT_EQ(layer, nullptr);
}

TEST_F(CapiChecksTest, ScheduleTotalMustNotBeNegative) {
  sg_linear_config config = fp32_linear_config(8);
  sg_layer layer = nullptr;
  ASSERT_SG_OK(sg_linear_create(ctx_, "fc", &config, 1, &layer));
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.schedule = 1;
  options.lr_schedule = sg_lr_schedule{0, 1e-3f, 0.0f, 0, -5};
  sg_optimizer optimizer = nullptr;
  EXPECT_INVALID(sg_optimizer_create(ctx_, &layer, 1, &options, &optimizer), "schedule->total",
                 "must be >= 0, got -5");
  ASSERT_SG_OK(sg_layer_destroy(layer));
}

// A [16, 16] fp32 input with one NaN.
sg_tensor nan_input(sg_context ctx) {
  const int64_t dims[] = {16, 16};
  sg_tensor x = nullptr;
  EXPECT_EQ(sg_tensor_create(ctx, "x", SG_DTYPE_FLOAT32, 2, dims, &x), SG_OK) << sg_last_error();
  std::vector<float> values(256, 0.5f);
  values[3] = std::nanf("");
  EXPECT_EQ(sg_tensor_copy_from_host(x, values.data(), values.size() * sizeof(float)), SG_OK) << sg_last_error();
  return x;
}

TEST_F(CapiChecksTest, CheckErrorsReportsNonFiniteAmaxesWhereTheRecipeSaysStop) {
  sg_linear_config config = fp32_linear_config(16);
  sg_tensor x = nan_input(ctx_);
  for (const int stop : {0, 1}) {
    SCOPED_TRACE(stop);
    config.fp8 = 1;
    sg_fp8_recipe_default(&config.fp8_recipe, SG_FP8_CURRENT);
    config.fp8_recipe.stop_on_non_finite = stop;
    sg_layer layer = nullptr;
    ASSERT_SG_OK(sg_linear_create(ctx_, "fc", &config, 1, &layer));
    ASSERT_SG_OK(sg_layer_check_errors(layer));  // nothing counted yet
    sg_tensor y = nullptr;
    sg_saved saved = nullptr;
    ASSERT_SG_OK(sg_layer_forward(layer, x, &y, &saved));
    if (stop == 1) {
      EXPECT_INVALID(sg_layer_check_errors(layer), "Linear 'fc'", "met a non-finite amax", "on_non_finite is stop");
    } else {
      EXPECT_EQ(sg_layer_check_errors(layer), SG_OK) << sg_last_error();
    }
    sg_saved_destroy(saved);
    sg_tensor_destroy(y);
    sg_layer_destroy(layer);
  }
  sg_tensor_destroy(x);
  // A layer with nothing to count.
  sg_norm_config norm;
  sg_norm_config_default(&norm);
  norm.hidden = 8;
  sg_layer layer = nullptr;
  ASSERT_SG_OK(sg_norm_create(ctx_, "n", &norm, &layer));
  EXPECT_EQ(sg_layer_check_errors(layer), SG_OK) << sg_last_error();
  sg_layer_destroy(layer);
  EXPECT_NE(sg_layer_check_errors(nullptr), SG_OK);
}

// The step returns its input unchanged: read by no op, it is still an output.
int return_the_input(void* user, sg_tensor* outputs, size_t capacity, size_t* count) {
  if (capacity < 1) return 1;
  if (sg_tensor_retain(static_cast<sg_tensor>(user), &outputs[0]) != SG_OK) return 1;
  *count = 1;
  return 0;
}

TEST_F(CapiChecksTest, AStepMayReturnAPersistentTensorNoOpRead) {
  const int64_t dims[] = {3};
  sg_tensor x = nullptr;
  ASSERT_SG_OK(sg_tensor_create(ctx_, "x", SG_DTYPE_FLOAT32, 1, dims, &x));
  const float values[] = {1, 2, 3};
  ASSERT_SG_OK(sg_tensor_copy_from_host(x, values, sizeof(values)));
  sg_graph graph = nullptr;
  ASSERT_SG_OK(sg_capture(ctx_, return_the_input, x, SG_POOL_REPORT_ERROR, &graph));
  ASSERT_SG_OK(sg_graph_replay(graph, nullptr, nullptr, 0));
  sg_tensor out = nullptr;
  ASSERT_SG_OK(sg_graph_output(graph, 0, &out));
  float got[3] = {};
  ASSERT_SG_OK(sg_tensor_copy_to_host(out, got, sizeof(got)));
  EXPECT_EQ(std::vector<float>(got, got + 3), (std::vector<float>{1, 2, 3}));
  sg_tensor_destroy(out);
  sg_graph_destroy(graph);
  sg_tensor_destroy(x);
}

}  // namespace
