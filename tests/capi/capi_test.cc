// The C API from C++ as a C caller uses it: handles, result codes, the
// thread-local last error, no exception crossing the edge, a captured train
// step equal to eager steps, on the host. The CUDA paths are tested through
// libstepgraph_c.so from Python (tests/python/cuda_test.py, torch_parity_test.py).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "capi/stepgraph.h"
#include "tests/capi/capi_test_support.h"

namespace {

std::string tensor_name(sg_tensor tensor) {
  char buffer[64];
  size_t length = 0;
  EXPECT_EQ(sg_tensor_name(tensor, buffer, sizeof(buffer), &length), SG_OK);
  EXPECT_EQ(length, std::strlen(buffer));
  return buffer;
}

sg_context make_context(sg_device device) {
  sg_context ctx = nullptr;
  EXPECT_EQ(sg_context_create(device, 1, &ctx), SG_OK) << sg_last_error();
  return ctx;
}

TEST(CapiHostTest, TensorCreateCopyAndQuery) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  const int64_t dims[] = {2, 3};
  sg_tensor t = nullptr;
  ASSERT_SG_OK(sg_tensor_create(ctx, "t", SG_DTYPE_FLOAT32, 2, dims, &t));
  int rank = 0;
  int64_t got[2] = {};
  sg_dtype dtype = SG_DTYPE_INT64;
  sg_storage storage = SG_STORAGE_EAGER;
  int64_t bytes = 0;
  ASSERT_SG_OK(sg_tensor_rank(t, &rank));
  ASSERT_SG_OK(sg_tensor_dims(t, got, 2));
  ASSERT_SG_OK(sg_tensor_dtype(t, &dtype));
  ASSERT_SG_OK(sg_tensor_storage(t, &storage));
  ASSERT_SG_OK(sg_tensor_bytes(t, &bytes));
  EXPECT_EQ(rank, 2);
  EXPECT_EQ(got[0], 2);
  EXPECT_EQ(got[1], 3);
  EXPECT_EQ(dtype, SG_DTYPE_FLOAT32);
  EXPECT_EQ(storage, SG_STORAGE_PERSISTENT);
  EXPECT_EQ(bytes, 24);
  EXPECT_EQ(tensor_name(t), "t");

  const std::vector<float> in = {1, 2, 3, 4, 5, 6};
  std::vector<float> out(6, 0.0f);
  ASSERT_SG_OK(sg_tensor_copy_from_host(t, in.data(), 24));
  ASSERT_SG_OK(sg_tensor_copy_to_host(t, out.data(), 24));
  EXPECT_EQ(out, in);
  EXPECT_EQ(sg_tensor_copy_to_host(t, out.data(), 20), SG_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sg_last_error()).find("holds 24 bytes, got a buffer of 20"), std::string::npos)
      << sg_last_error();

  // Handles go in any order: the tensor outlives the context handle.
  ASSERT_SG_OK(sg_context_destroy(ctx));
  ASSERT_SG_OK(sg_tensor_copy_to_host(t, out.data(), 24));
  ASSERT_SG_OK(sg_tensor_destroy(t));
}

TEST(CapiHostTest, WrapUsesTheCallersMemoryAndNeverFreesIt) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  std::vector<float> memory = {1, 2, 3, 4, 5, 6};
  const int64_t dims[] = {3, 2};
  const int64_t row_major[] = {2, 1};
  sg_tensor t = nullptr;
  ASSERT_SG_OK(sg_tensor_wrap(ctx, "w", SG_DTYPE_FLOAT32, 2, dims, row_major, memory.data(), &t));
  void* data = nullptr;
  ASSERT_SG_OK(sg_tensor_data(t, &data));
  EXPECT_EQ(data, memory.data());
  ASSERT_SG_OK(sg_tensor_destroy(t));  // must not free memory.data()
  ASSERT_SG_OK(sg_context_destroy(ctx));
  memory.push_back(7);  // the vector still owns its memory (a double free would abort here or at exit)
  EXPECT_EQ(memory[5], 6);
}

TEST(CapiHostTest, WrapRefusesNonContiguousStridesSayingWhy) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  std::vector<float> memory(6);
  const int64_t dims[] = {3, 2};
  const int64_t transposed[] = {1, 3};
  sg_tensor t = nullptr;
  EXPECT_EQ(sg_tensor_wrap(ctx, "w", SG_DTYPE_FLOAT32, 2, dims, transposed, memory.data(), &t),
            SG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(t, nullptr);
  EXPECT_NE(std::string(sg_last_error()).find("not contiguous row-major"), std::string::npos) << sg_last_error();
  sg_context_destroy(ctx);
}

TEST(CapiHostTest, NullHandlesAndBadEnumsAreErrorsNotCrashesOrExceptions) {
  int rank = 0;
  EXPECT_NO_THROW(EXPECT_EQ(sg_tensor_rank(nullptr, &rank), SG_ERROR_INVALID_ARGUMENT));
  EXPECT_EQ(std::string(sg_last_error()).rfind("[invalid_argument] sg_tensor_rank: tensor is NULL (", 0), 0u)
      << "the message names the call and the argument: " << sg_last_error();
  sg_context ctx = nullptr;
  EXPECT_NO_THROW(EXPECT_EQ(sg_context_create(static_cast<sg_device>(7), 0, &ctx), SG_ERROR_INVALID_ARGUMENT));
  EXPECT_EQ(ctx, nullptr);
  EXPECT_NE(std::string(sg_last_error()).find("is not an sg_device"), std::string::npos);
  ctx = make_context(SG_DEVICE_HOST);
  const int64_t dims[] = {2};
  sg_tensor t = nullptr;
  EXPECT_EQ(sg_tensor_create(ctx, "t", static_cast<sg_dtype>(99), 1, dims, &t), SG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(sg_tensor_create(ctx, "t", SG_DTYPE_FLOAT32, -1, dims, &t), SG_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(sg_result_name(SG_ERROR_UNSUPPORTED), "unsupported");
  EXPECT_STREQ(sg_result_name(SG_OK), "ok");
  EXPECT_STREQ(sg_result_name(42), "unknown");
  sg_context_destroy(ctx);
}

TEST(CapiHostTest, LastErrorIsPerThreadAndKeptBySuccessfulCalls) {
  EXPECT_EQ(sg_layer_destroy(nullptr), SG_OK);  // destroying NULL is fine, like free
  EXPECT_EQ(sg_tensor_numel(nullptr, nullptr), SG_ERROR_INVALID_ARGUMENT);
  const std::string mine = sg_last_error();
  EXPECT_NE(mine.find("sg_tensor_numel"), std::string::npos);
  std::string other = "unset";
  std::thread([&] { other = sg_last_error(); }).join();
  EXPECT_EQ(other, "") << "another thread sees its own (empty) last error";
  sg_context ctx = make_context(SG_DEVICE_HOST);  // a success
  EXPECT_EQ(sg_last_error(), mine);
  sg_context_destroy(ctx);
}

TEST(CapiHostTest, EngineErrorsKeepTheirCodeAndMessage) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_linear_config linear;
  sg_linear_config_default(&linear);
  EXPECT_EQ(linear.bias, 1);
  EXPECT_EQ(linear.dtype, SG_DTYPE_BFLOAT16);
  linear.in_features = 8;
  linear.out_features = 4;
  linear.dtype = SG_DTYPE_FLOAT32;
  sg_layer layer = nullptr;
  ASSERT_SG_OK(sg_linear_create(ctx, "fc", &linear, 1, &layer));
  const int64_t dims[] = {3, 7};
  sg_tensor x = nullptr;
  ASSERT_SG_OK(sg_tensor_create(ctx, "x", SG_DTYPE_FLOAT32, 2, dims, &x));
  sg_tensor y = nullptr;
  sg_saved saved = nullptr;
  EXPECT_NO_THROW(EXPECT_EQ(sg_layer_forward(layer, x, &y, &saved), SG_ERROR_INVALID_ARGUMENT));
  EXPECT_EQ(y, nullptr);
  EXPECT_EQ(saved, nullptr);
  EXPECT_NE(std::string(sg_last_error()).find("input must be [tokens, 8] fp32, got [3, 7] fp32"), std::string::npos)
      << sg_last_error();
  sg_tensor_destroy(x);
  sg_layer_destroy(layer);
  sg_context_destroy(ctx);
}

struct FailingStep {
  static int run(void*, sg_tensor*, size_t, size_t* count) {
    *count = 0;
    sg_step_error("the batch was empty");
    return 3;
  }
};

TEST(CapiHostTest, FailingStepFunctionFailsTheCaptureWithItsMessage) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_graph graph = nullptr;
  EXPECT_EQ(sg_capture(ctx, &FailingStep::run, nullptr, SG_POOL_REPORT_ERROR, &graph), SG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(graph, nullptr);
  EXPECT_NE(std::string(sg_last_error()).find("the step function failed (it returned 3): the batch was empty"),
            std::string::npos)
      << sg_last_error();
  sg_context_destroy(ctx);
}

// A model, its optimizer and step; eager and graphed copies from one seed.
struct Training {
  Training(sg_context ctx, int64_t tokens) {
    sg_residual_stack_config config;
    sg_residual_stack_config_default(&config);
    config.hidden = 32;
    config.ffn = 64;
    config.layers = 2;
    config.vocab = 40;
    config.seed = 7;
    EXPECT_EQ(sg_residual_stack_create(ctx, &config, &model), SG_OK) << sg_last_error();
    sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
    options.adamw.lr = 1e-2f;
    EXPECT_EQ(sg_optimizer_create(ctx, &model, 1, &options, &optimizer), SG_OK) << sg_last_error();
    sg_train_step_config step_config = SG_TRAIN_STEP_CONFIG_INITIALIZER;
    step_config.tokens = tokens;
    EXPECT_EQ(sg_train_step_create(model, optimizer, &step_config, &step), SG_OK) << sg_last_error();
    EXPECT_EQ(sg_train_step_inputs(step, &x, &labels), SG_OK) << sg_last_error();
  }
  ~Training() {
    for (sg_tensor t : {x, labels}) sg_tensor_destroy(t);
    sg_train_step_destroy(step);
    sg_optimizer_destroy(optimizer);
    sg_layer_destroy(model);
  }
  void load(int64_t tokens, uint32_t seed) const {
    std::vector<uint16_t> xs(static_cast<size_t>(tokens * 32));
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<uint16_t>(0x3c00 + ((i * 37 + seed) % 512));  // bf16
    std::vector<int32_t> ls(static_cast<size_t>(tokens));
    for (size_t i = 0; i < ls.size(); ++i) ls[i] = static_cast<int32_t>((i * 7 + seed) % 40);
    EXPECT_EQ(sg_tensor_copy_from_host(x, xs.data(), xs.size() * 2), SG_OK) << sg_last_error();
    EXPECT_EQ(sg_tensor_copy_from_host(labels, ls.data(), ls.size() * 4), SG_OK) << sg_last_error();
  }
  sg_layer model = nullptr;
  sg_optimizer optimizer = nullptr;
  sg_train_step step = nullptr;
  sg_tensor x = nullptr;
  sg_tensor labels = nullptr;
};

float read_scalar(sg_tensor t) {
  float value = 0;
  EXPECT_EQ(sg_tensor_copy_to_host(t, &value, sizeof(value)), SG_OK) << sg_last_error();
  return value;
}

void expect_graph_equals_eager(sg_device device) {
  constexpr int64_t kTokens = 16;
  sg_context ctx = make_context(device);
  Training eager(ctx, kTokens);
  Training graphed(ctx, kTokens);
  sg_graph graph = nullptr;
  ASSERT_SG_OK(sg_train_step_capture(graphed.step, SG_POOL_REPORT_ERROR, &graph));
  size_t report_count = 1;
  ASSERT_SG_OK(sg_graph_pool_report_count(graph, &report_count, nullptr));
  EXPECT_EQ(report_count, 0u);
  std::vector<float> losses;
  for (int s = 0; s < 4; ++s) {
    eager.load(kTokens, 11 + s % 2);
    graphed.load(kTokens, 11 + s % 2);
    sg_tensor eager_loss = nullptr;
    ASSERT_SG_OK(sg_train_step_run(eager.step, &eager_loss));
    ASSERT_SG_OK(sg_graph_replay(graph, nullptr, nullptr, 0));
    sg_tensor graph_loss = nullptr;
    ASSERT_SG_OK(sg_graph_output(graph, 0, &graph_loss));
    const float e = read_scalar(eager_loss);
    const float g = read_scalar(graph_loss);
    EXPECT_EQ(std::memcmp(&e, &g, sizeof(float)), 0) << "step " << s << ": eager " << e << ", graph " << g;
    losses.push_back(g);
    sg_tensor_destroy(eager_loss);
    sg_tensor_destroy(graph_loss);
  }
  ASSERT_SG_OK(sg_train_step_check_errors(graphed.step));
  int64_t steps = 0;
  ASSERT_SG_OK(sg_optimizer_steps_taken(graphed.optimizer, &steps));
  EXPECT_EQ(steps, 4);
  EXPECT_LT(losses.back(), losses.front());
  sg_graph_destroy(graph);
  sg_context_destroy(ctx);
}

// On CUDA through the shared library: tests/python/cuda_test.py (one binary less in the GPU bundle).
TEST(CapiHostTest, CapturedTrainStepEqualsEagerBitForBit) { expect_graph_equals_eager(SG_DEVICE_HOST); }

struct LinearStep {
  sg_layer layer;
  sg_tensor x;
  static int run(void* user, sg_tensor* outputs, size_t capacity, size_t* count) {
    auto* self = static_cast<LinearStep*>(user);
    sg_saved saved = nullptr;
    if (capacity < 1 || sg_layer_forward(self->layer, self->x, &outputs[0], &saved) != SG_OK) return 1;
    sg_saved_destroy(saved);
    *count = 1;
    return 0;
  }
};

TEST(CapiHostTest, GraphCacheCountsHitsAndMisses) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_linear_config config;
  sg_linear_config_default(&config);
  config.in_features = 8;
  config.out_features = 8;
  config.dtype = SG_DTYPE_FLOAT32;
  LinearStep step{};
  ASSERT_SG_OK(sg_linear_create(ctx, "fc", &config, 1, &step.layer));
  const int64_t dims[] = {4, 8};
  ASSERT_SG_OK(sg_tensor_create(ctx, "x", SG_DTYPE_FLOAT32, 2, dims, &step.x));
  sg_graph_cache cache = nullptr;
  ASSERT_SG_OK(sg_graph_cache_create(1 << 30, &cache));
  sg_graph a = nullptr;
  sg_graph b = nullptr;
  ASSERT_SG_OK(sg_graph_cache_get_or_capture(cache, "fc", ctx, &LinearStep::run, &step, SG_POOL_REPORT_ERROR, &a));
  ASSERT_SG_OK(sg_graph_cache_get_or_capture(cache, "fc", ctx, &LinearStep::run, &step, SG_POOL_REPORT_ERROR, &b));
  sg_graph_cache_stats stats{};
  ASSERT_SG_OK(sg_graph_cache_get_stats(cache, &stats));
  EXPECT_EQ(stats.hits, 1);
  EXPECT_EQ(stats.misses, 1);
  EXPECT_EQ(stats.captures, 1);
  EXPECT_EQ(stats.entries, 1);
  int64_t pool = 0;
  ASSERT_SG_OK(sg_graph_pool_bytes(a, &pool));
  EXPECT_EQ(stats.pool_bytes, pool);
  ASSERT_SG_OK(sg_graph_replay(b, nullptr, nullptr, 0));
  int64_t replays = 0;
  ASSERT_SG_OK(sg_graph_replay_count(a, &replays));
  EXPECT_EQ(replays, 1) << "a hit hands back the same captured step";
  // The cache keeps the step (and its context) alive after every handle is gone.
  for (sg_graph g : {a, b}) sg_graph_destroy(g);
  sg_tensor_destroy(step.x);
  sg_layer_destroy(step.layer);
  sg_context_destroy(ctx);
  ASSERT_SG_OK(sg_graph_cache_clear(cache));
  ASSERT_SG_OK(sg_graph_cache_destroy(cache));
}

// ---- Checked handles: misuse is an error code and a message, never a crash ----

// `result` is SG_ERROR_INVALID_ARGUMENT and the last error starts with the call
// and names the problem.
void expect_handle_error(sg_result result, const std::string& function, const std::string& problem) {
  EXPECT_EQ(result, SG_ERROR_INVALID_ARGUMENT) << sg_last_error();
  const std::string message = sg_last_error();
  EXPECT_NE(message.find(function + ": "), std::string::npos) << "names the call " << function << ": " << message;
  EXPECT_NE(message.find(problem), std::string::npos) << "says '" << problem << "': " << message;
}

template <typename Handle>
Handle forged(uint64_t value) {
  return reinterpret_cast<Handle>(static_cast<uintptr_t>(value));
}

sg_layer make_linear(sg_context ctx, int64_t in, int64_t out) {
  sg_linear_config config;
  sg_linear_config_default(&config);
  config.in_features = in;
  config.out_features = out;
  config.dtype = SG_DTYPE_FLOAT32;
  sg_layer layer = nullptr;
  EXPECT_EQ(sg_linear_create(ctx, "fc", &config, 1, &layer), SG_OK) << sg_last_error();
  return layer;
}

sg_tensor make_tensor(sg_context ctx, int64_t rows, int64_t cols) {
  const int64_t dims[] = {rows, cols};
  sg_tensor t = nullptr;
  EXPECT_EQ(sg_tensor_create(ctx, "t", SG_DTYPE_FLOAT32, 2, dims, &t), SG_OK) << sg_last_error();
  return t;
}

// Destroys `handle` (SG_OK), then once more for each of `problems`: each
// time an error naming `call` and saying the problem.
template <typename Handle>
void expect_second_destroy_fails(sg_result (*destroy)(Handle), Handle handle, const std::string& call,
                                 std::initializer_list<const char*> problems) {
  ASSERT_SG_OK(destroy(handle));
  for (const char* problem : problems) expect_handle_error(destroy(handle), call, problem);
}

TEST(CapiHandlesTest, DoubleDestroyOfEachHandleTypeIsAnError) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_tensor t = make_tensor(ctx, 3, 4);
  sg_layer layer = make_linear(ctx, 4, 2);
  sg_tensor y = nullptr;
  sg_saved saved = nullptr;
  ASSERT_SG_OK(sg_layer_forward(layer, t, &y, &saved));
  sg_stream_scope scope = nullptr;
  ASSERT_SG_OK(sg_stream_scope_enter(ctx, 0, &scope));
  sg_graph_cache cache = nullptr;
  ASSERT_SG_OK(sg_graph_cache_create(1 << 20, &cache));
  sg_world world = nullptr;
  ASSERT_SG_OK(sg_world_init(SG_DEVICE_HOST, 10.0, &world));  // no launcher here: a world of one
  auto* training = new Training(ctx, 8);
  sg_graph graph = nullptr;
  ASSERT_SG_OK(sg_train_step_capture(training->step, SG_POOL_REPORT_ERROR, &graph));
  sg_layer model = training->model;
  sg_optimizer optimizer = training->optimizer;
  sg_train_step step = training->step;
  training->model = nullptr;  // destroyed here, twice; ~Training destroys NULL (SG_OK)
  training->optimizer = nullptr;
  training->step = nullptr;

  expect_second_destroy_fails(sg_stream_scope_exit, scope, "sg_stream_scope_exit",
                              {"stream scope handle", "was already destroyed"});
  expect_second_destroy_fails(sg_saved_destroy, saved, "sg_saved_destroy", {"was already destroyed"});
  expect_second_destroy_fails(sg_tensor_destroy, y, "sg_tensor_destroy", {"tensor handle", "was already destroyed"});
  expect_second_destroy_fails(sg_graph_destroy, graph, "sg_graph_destroy", {"graph handle", "was already destroyed"});
  expect_second_destroy_fails(sg_train_step_destroy, step, "sg_train_step_destroy", {"was already destroyed"});
  expect_second_destroy_fails(sg_optimizer_destroy, optimizer, "sg_optimizer_destroy", {"was already destroyed"});
  expect_second_destroy_fails(sg_layer_destroy, model, "sg_layer_destroy", {"was already destroyed"});
  expect_second_destroy_fails(sg_layer_destroy, layer, "sg_layer_destroy", {"layer handle"});
  expect_second_destroy_fails(sg_graph_cache_destroy, cache, "sg_graph_cache_destroy", {"was already destroyed"});
  expect_second_destroy_fails(sg_world_destroy, world, "sg_world_destroy", {"world handle", "was already destroyed"});
  expect_second_destroy_fails(sg_context_destroy, ctx, "sg_context_destroy",
                              {"context handle", "was already destroyed"});
  delete training;  // its tensors outlive the context handle (they hold the context)
  expect_second_destroy_fails(sg_tensor_destroy, t, "sg_tensor_destroy", {"was already destroyed"});
}

TEST(CapiHandlesTest, UseAfterDestroyIsAnErrorNamingTheCallAndTheHandle) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_tensor t = make_tensor(ctx, 2, 4);
  ASSERT_SG_OK(sg_tensor_destroy(t));
  int rank = 0;
  expect_handle_error(sg_tensor_rank(t, &rank), "sg_tensor_rank", "tensor handle 0x");
  expect_handle_error(sg_tensor_rank(t, &rank), "sg_tensor_rank", "(tensor) was destroyed");

  // A replay of a destroyed graph.
  Training training(ctx, 8);
  sg_graph graph = nullptr;
  ASSERT_SG_OK(sg_train_step_capture(training.step, SG_POOL_REPORT_ERROR, &graph));
  ASSERT_SG_OK(sg_graph_replay(graph, nullptr, nullptr, 0));
  ASSERT_SG_OK(sg_graph_destroy(graph));
  expect_handle_error(sg_graph_replay(graph, nullptr, nullptr, 0), "sg_graph_replay", "graph handle 0x");
  expect_handle_error(sg_graph_replay(graph, nullptr, nullptr, 0), "sg_graph_replay", "was destroyed");
  size_t outputs = 0;
  expect_handle_error(sg_graph_output_count(graph, &outputs), "sg_graph_output_count", "was destroyed");

  // A destroyed tensor inside an array argument names its place.
  sg_tensor a = make_tensor(ctx, 2, 4);
  sg_tensor b = make_tensor(ctx, 2, 4);
  ASSERT_SG_OK(sg_tensor_destroy(b));
  ASSERT_SG_OK(sg_train_step_capture(training.step, SG_POOL_REPORT_ERROR, &graph));
  expect_handle_error(sg_graph_replay(graph, &a, &b, 1), "sg_graph_replay", "(sources[0]) was destroyed");

  // A forward through a destroyed layer, and of a destroyed input.
  sg_layer layer = make_linear(ctx, 4, 3);
  sg_tensor y = nullptr;
  sg_saved saved = nullptr;
  expect_handle_error(sg_layer_forward(layer, b, &y, &saved), "sg_layer_forward", "(x) was destroyed");
  ASSERT_SG_OK(sg_layer_destroy(layer));
  expect_handle_error(sg_layer_forward(layer, a, &y, &saved), "sg_layer_forward", "layer handle");
  EXPECT_EQ(y, nullptr);

  // The slot of a destroyed handle is reused with a new generation: the old
  // value never reaches the new object.
  sg_tensor fresh = make_tensor(ctx, 5, 1);
  expect_handle_error(sg_tensor_rank(b, &rank), "sg_tensor_rank", "was destroyed");
  ASSERT_SG_OK(sg_tensor_rank(fresh, &rank));
  EXPECT_EQ(rank, 2);

  // A destroyed context makes no new objects; a destroyed optimizer takes no step.
  sg_context gone = make_context(SG_DEVICE_HOST);
  ASSERT_SG_OK(sg_context_destroy(gone));
  sg_tensor never = nullptr;
  const int64_t dims[] = {2};
  expect_handle_error(sg_tensor_create(gone, "n", SG_DTYPE_FLOAT32, 1, dims, &never), "sg_tensor_create",
                      "context handle 0x");
  EXPECT_EQ(never, nullptr);
  for (sg_tensor h : {a, fresh}) ASSERT_SG_OK(sg_tensor_destroy(h));
  ASSERT_SG_OK(sg_graph_destroy(graph));
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST(CapiHandlesTest, WrongTypeHandleIsAnErrorAndLeavesTheHandleAlone) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_tensor t = make_tensor(ctx, 2, 4);
  expect_handle_error(sg_graph_replay(reinterpret_cast<sg_graph>(t), nullptr, nullptr, 0), "sg_graph_replay",
                      "is a tensor handle, not a graph handle");
  expect_handle_error(sg_graph_destroy(reinterpret_cast<sg_graph>(t)), "sg_graph_destroy",
                      "is a tensor handle, not a graph handle");
  expect_handle_error(sg_context_destroy(reinterpret_cast<sg_context>(t)), "sg_context_destroy",
                      "is a tensor handle, not a context handle");
  int rank = 0;
  expect_handle_error(sg_tensor_rank(reinterpret_cast<sg_tensor>(ctx), &rank), "sg_tensor_rank",
                      "is a context handle, not a tensor handle");
  sg_layer layer = make_linear(ctx, 4, 2);
  sg_tensor y = nullptr;
  sg_saved saved = nullptr;
  expect_handle_error(sg_layer_forward(reinterpret_cast<sg_layer>(t), t, &y, &saved), "sg_layer_forward", "layer 0x");
  expect_handle_error(sg_layer_forward(layer, reinterpret_cast<sg_tensor>(layer), &y, &saved), "sg_layer_forward",
                      "x 0x");
  EXPECT_NE(std::string(sg_last_error()).find("is a layer handle, not a tensor handle"), std::string::npos);
  // A destroyed handle of another type says both.
  ASSERT_SG_OK(sg_layer_destroy(layer));
  expect_handle_error(sg_tensor_destroy(reinterpret_cast<sg_tensor>(layer)), "sg_tensor_destroy",
                      "is a layer handle (destroyed), not a tensor handle");
  // Worlds are checked like every other handle, also inside a config struct.
  sg_world world = nullptr;
  ASSERT_SG_OK(sg_world_init(SG_DEVICE_HOST, 10.0, &world));
  expect_handle_error(sg_world_rank(reinterpret_cast<sg_world>(t), &rank), "sg_world_rank",
                      "is a tensor handle, not a world handle");
  expect_handle_error(sg_context_synchronize(reinterpret_cast<sg_context>(world)), "sg_context_synchronize",
                      "is a world handle, not a context handle");
  Training training(ctx, 4);
  sg_train_step_config config;
  sg_train_step_config_default(&config);
  config.tokens = 4;
  config.world = reinterpret_cast<sg_world>(ctx);
  sg_train_step step = nullptr;
  expect_handle_error(sg_train_step_create(training.model, training.optimizer, &config, &step),
                      "sg_train_step_create", "config->world 0x");
  EXPECT_NE(std::string(sg_last_error()).find("is a context handle, not a world handle"), std::string::npos);
  EXPECT_EQ(step, nullptr);
  // The wrongly used handles still work.
  ASSERT_SG_OK(sg_world_rank(world, &rank));
  EXPECT_EQ(rank, 0);
  ASSERT_SG_OK(sg_world_destroy(world));
  ASSERT_SG_OK(sg_tensor_rank(t, &rank));
  EXPECT_EQ(rank, 2);
  ASSERT_SG_OK(sg_tensor_destroy(t));
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST(CapiHandlesTest, GarbageHandlesAreNotHandlesThisLibraryIssued) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_tensor t = make_tensor(ctx, 2, 2);
  int rank = 0;
  expect_handle_error(sg_tensor_rank(forged<sg_tensor>(0xdeadbeef), &rank), "sg_tensor_rank",
                      "tensor 0x00000000deadbeef is not a handle this library issued");
  expect_handle_error(sg_tensor_destroy(forged<sg_tensor>(0xdeadbeef)), "sg_tensor_destroy",
                      "is not a handle this library issued");
  expect_handle_error(sg_graph_replay(forged<sg_graph>(0xdeadbeef), nullptr, nullptr, 0), "sg_graph_replay",
                      "is not a handle this library issued");
  // An address (what a handle was before the table) is not a handle either.
  expect_handle_error(sg_context_synchronize(reinterpret_cast<sg_context>(&rank)), "sg_context_synchronize",
                      "is not a handle this library issued");
  // A handle's tag with a slot or a generation never issued.
  const auto value = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(t));
  expect_handle_error(sg_tensor_rank(forged<sg_tensor>(value + 1), &rank), "sg_tensor_rank",
                      "is not a handle this library issued");
  expect_handle_error(sg_tensor_rank(forged<sg_tensor>(value | (uint64_t{0xFFFFFF} << 32)), &rank), "sg_tensor_rank",
                      "is not a handle this library issued");
  std::mt19937_64 random(20240612);
  for (int i = 0; i < 2000; ++i) {
    const uint64_t garbage = random();
    sg_graph as_graph = forged<sg_graph>(garbage);
    expect_handle_error(sg_graph_replay(as_graph, nullptr, nullptr, 0), "sg_graph_replay",
                        "is not a handle this library issued");
    expect_handle_error(sg_graph_destroy(as_graph), "sg_graph_destroy", "is not a handle this library issued");
    expect_handle_error(sg_tensor_rank(forged<sg_tensor>(garbage), &rank), "sg_tensor_rank",
                        "is not a handle this library issued");
    if (HasFailure()) break;
  }
  ASSERT_SG_OK(sg_tensor_rank(t, &rank));
  ASSERT_SG_OK(sg_tensor_destroy(t));
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST(CapiHandlesTest, TensorsAndLayersKeepTheirContextAliveAfterItsDestroy) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_tensor t = make_tensor(ctx, 2, 4);
  sg_layer layer = make_linear(ctx, 4, 3);
  ASSERT_SG_OK(sg_context_destroy(ctx));
  const std::vector<float> in = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> out(8, 0.0f);
  ASSERT_SG_OK(sg_tensor_copy_from_host(t, in.data(), 32));
  ASSERT_SG_OK(sg_tensor_copy_to_host(t, out.data(), 32));
  EXPECT_EQ(out, in);
  sg_device device = SG_DEVICE_CUDA;
  ASSERT_SG_OK(sg_tensor_device(t, &device));
  EXPECT_EQ(device, SG_DEVICE_HOST);
  sg_tensor y = nullptr;
  sg_saved saved = nullptr;
  ASSERT_SG_OK(sg_layer_forward(layer, t, &y, &saved));
  int64_t numel = 0;
  ASSERT_SG_OK(sg_tensor_numel(y, &numel));
  EXPECT_EQ(numel, 6);
  // The context handle itself is gone.
  int streams = 0;
  expect_handle_error(sg_context_stream_count(ctx, &streams), "sg_context_stream_count", "was destroyed");
  ASSERT_SG_OK(sg_saved_destroy(saved));
  ASSERT_SG_OK(sg_layer_destroy(layer));
  ASSERT_SG_OK(sg_tensor_destroy(y));
  ASSERT_SG_OK(sg_tensor_destroy(t));  // the last user: the context goes now
}

struct GarbageOutputStep {
  static int run(void*, sg_tensor* outputs, size_t capacity, size_t* count) {
    if (capacity < 1) return 1;
    outputs[0] = forged<sg_tensor>(0xdeadbeef);
    *count = 1;
    return 0;
  }
};

TEST(CapiHandlesTest, StepFunctionOutputsAreCheckedHandles) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_graph graph = nullptr;
  expect_handle_error(sg_capture(ctx, &GarbageOutputStep::run, nullptr, SG_POOL_REPORT_ERROR, &graph), "sg_capture",
                      "the step function's output 0 0x00000000deadbeef is not a handle this library issued");
  EXPECT_EQ(graph, nullptr);
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST(CapiHandlesTest, HandlesAreThreadSafe) {
  sg_context ctx = make_context(SG_DEVICE_HOST);
  sg_tensor shared = make_tensor(ctx, 2, 2);
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int n = 0; n < 500; ++n) {
        sg_tensor copy = nullptr;
        int rank = 0;
        if (sg_tensor_retain(shared, &copy) != SG_OK || sg_tensor_rank(copy, &rank) != SG_OK || rank != 2 ||
            sg_tensor_destroy(copy) != SG_OK || sg_tensor_destroy(copy) != SG_ERROR_INVALID_ARGUMENT) {
          ++failures[i];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures, std::vector<int>(4, 0));
  ASSERT_SG_OK(sg_tensor_destroy(shared));
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

}  // namespace
