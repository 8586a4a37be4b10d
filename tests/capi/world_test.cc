// Worlds through the C API, on the host: sg_world_init reads the launcher's
// variables (none: a world of one, no socket), the versioned
// sg_train_step_config, the context's communication stream, and a
// data-parallel step of two ranks in forked processes (torchrun's variables on
// 127.0.0.1) that equals one process on the whole batch, with the world handle
// destroyed before the step is captured (the step keeps the world alive).
// Handle misuse of worlds is in capi_test.cc with every other handle's.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "capi/stepgraph.h"
#include "tests/capi/capi_test_support.h"

namespace {

constexpr int64_t kGlobalTokens = 16;
constexpr int64_t kHidden = 16;
constexpr int64_t kVocab = 24;
constexpr int kSteps = 4;

const char* const kLauncherVariables[] = {"RANK",
                                          "WORLD_SIZE",
                                          "LOCAL_RANK",
                                          "LOCAL_WORLD_SIZE",
                                          "MASTER_ADDR",
                                          "MASTER_PORT",
                                          "SLURM_PROCID",
                                          "SLURM_NTASKS",
                                          "SLURM_LOCALID",
                                          "SLURM_NODEID",
                                          "SLURM_NTASKS_PER_NODE",
                                          "SLURM_TASKS_PER_NODE",
                                          "OMPI_COMM_WORLD_RANK",
                                          "OMPI_COMM_WORLD_SIZE",
                                          "OMPI_COMM_WORLD_LOCAL_RANK",
                                          "OMPI_COMM_WORLD_LOCAL_SIZE",
                                          "TORCHELASTIC_USE_AGENT_STORE",
                                          "STEPGRAPH_RENDEZVOUS_PORT"};

// Clears every launcher variable for the test's life (and after it).
class WorldTest : public ::testing::Test {
 protected:
  void SetUp() override { clear_launcher(); }
  void TearDown() override { clear_launcher(); }
  static void clear_launcher() {
    for (const char* name : kLauncherVariables) ::unsetenv(name);
  }
};

void set_torchrun(int rank, int size, int port) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(size).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(size).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

std::string describe(sg_world world) {
  char buffer[256];
  size_t length = 0;
  EXPECT_EQ(sg_world_describe(world, buffer, sizeof(buffer), &length), SG_OK) << sg_last_error();
  return buffer;
}

// The global batch of step `s` (two batches, alternating), the same in every process.
void global_batch(int s, std::vector<float>& x, std::vector<int32_t>& labels) {
  x.resize(kGlobalTokens * kHidden);
  labels.resize(kGlobalTokens);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i) + static_cast<float>(s % 2));
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<int32_t>((i * 7 + s % 2) % kVocab);
}

// What one process's training gives: the losses and every parameter's fp32 master.
struct Trained {
  std::vector<float> losses;
  std::vector<float> parameters;
  std::string error;  // the first failing call's message, empty when all went well
};

#define TRY(call)                                              \
  do {                                                         \
    if ((call) != SG_OK) {                                     \
      out.error = std::string(#call) + ": " + sg_last_error(); \
      return out;                                              \
    }                                                          \
  } while (false)

// kSteps captured steps of one fp32 model on this rank's rows of each global
// batch (the whole batch with no world); destroys `world` (if given) right
// after making the step, before capturing it.
Trained train(sg_world world, int rank, int size) {
  Trained out;
  const int64_t rows = kGlobalTokens / size;
  sg_context ctx = nullptr;
  TRY(sg_context_create(SG_DEVICE_HOST, 2, &ctx));
  TRY(sg_context_set_communication_stream(ctx, 2));
  sg_residual_stack_config config;
  sg_residual_stack_config_default(&config);
  config.hidden = kHidden;
  config.ffn = 32;
  config.layers = 2;
  config.vocab = kVocab;
  config.dtype = SG_DTYPE_FLOAT32;
  config.seed = 9;
  sg_layer model = nullptr;
  TRY(sg_residual_stack_create(ctx, &config, &model));
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  options.adamw.lr = 1e-2f;
  sg_optimizer optimizer = nullptr;
  TRY(sg_optimizer_create(ctx, &model, 1, &options, &optimizer));
  sg_train_step_config step_config = SG_TRAIN_STEP_CONFIG_INITIALIZER;
  step_config.tokens = rows;
  step_config.world = world;
  sg_train_step step = nullptr;
  TRY(sg_train_step_create(model, optimizer, &step_config, &step));
  TRY(sg_world_destroy(world));  // the step keeps the world alive
  sg_graph graph = nullptr;
  TRY(sg_train_step_capture(step, SG_POOL_REPORT_ERROR, &graph));
  sg_tensor x = nullptr;
  sg_tensor labels = nullptr;
  TRY(sg_train_step_inputs(step, &x, &labels));
  std::vector<float> xs;
  std::vector<int32_t> ls;
  for (int s = 0; s < kSteps; ++s) {
    global_batch(s, xs, ls);
    TRY(sg_tensor_copy_from_host(x, xs.data() + rank * rows * kHidden, rows * kHidden * sizeof(float)));
    TRY(sg_tensor_copy_from_host(labels, ls.data() + rank * rows, rows * sizeof(int32_t)));
    TRY(sg_graph_replay(graph, nullptr, nullptr, 0));
    sg_tensor loss = nullptr;
    TRY(sg_graph_output(graph, 0, &loss));
    float value = 0;
    TRY(sg_tensor_copy_to_host(loss, &value, sizeof(value)));
    out.losses.push_back(value);
    TRY(sg_tensor_destroy(loss));
  }
  TRY(sg_train_step_check_errors(step));
  int64_t count = 0;
  TRY(sg_layer_parameter_count(model, &count));
  for (int64_t i = 0; i < count; ++i) {
    sg_tensor master = nullptr;
    TRY(sg_layer_parameter(model, i, nullptr, 0, nullptr, &master, nullptr, nullptr));
    int64_t numel = 0;
    TRY(sg_tensor_numel(master, &numel));
    std::vector<float> values(static_cast<size_t>(numel));
    TRY(sg_tensor_copy_to_host(master, values.data(), values.size() * sizeof(float)));
    out.parameters.insert(out.parameters.end(), values.begin(), values.end());
    TRY(sg_tensor_destroy(master));
  }
  for (sg_tensor t : {x, labels}) TRY(sg_tensor_destroy(t));
  TRY(sg_graph_destroy(graph));
  TRY(sg_train_step_destroy(step));
  TRY(sg_optimizer_destroy(optimizer));
  TRY(sg_layer_destroy(model));
  TRY(sg_context_destroy(ctx));
  return out;
}

#undef TRY

TEST_F(WorldTest, NoLauncherVariablesMakeAWorldOfOne) {
  sg_world world = nullptr;
  ASSERT_SG_OK(sg_world_init(SG_DEVICE_HOST, 1.0, &world));
  int rank = -1;
  int size = -1;
  int local_rank = -1;
  ASSERT_SG_OK(sg_world_rank(world, &rank));
  ASSERT_SG_OK(sg_world_size(world, &size));
  ASSERT_SG_OK(sg_world_local_rank(world, &local_rank));
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(size, 1);
  EXPECT_EQ(local_rank, 0);
  EXPECT_EQ(describe(world), "a single process (rank 0 of 1, no launcher)");
  ASSERT_SG_OK(sg_world_destroy(world));
  // A cuda world of one needs no GPU either: nothing is opened.
  ASSERT_SG_OK(sg_world_init(SG_DEVICE_CUDA, 1.0, &world));
  ASSERT_SG_OK(sg_world_destroy(world));
  ASSERT_SG_OK(sg_world_destroy(nullptr));
}

TEST_F(WorldTest, LauncherErrorsNameTheCallAndTheVariable) {
  set_torchrun(3, 2, 29500);
  sg_world world = nullptr;
  EXPECT_EQ(sg_world_init(SG_DEVICE_HOST, 1.0, &world), SG_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(world, nullptr);
  const std::string message = sg_last_error();
  EXPECT_EQ(message.rfind("[invalid_argument] sg_world_init: ", 0), 0u) << message;
  EXPECT_NE(message.find("RANK"), std::string::npos) << message;
  // Rank 1 of 2 with nobody at MASTER_PORT: an I/O error within the timeout, not a hang.
  set_torchrun(1, 2, free_port());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(sg_world_init(SG_DEVICE_HOST, 0.3, &world), SG_ERROR_IO);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(std::string(sg_last_error()).find("sg_world_init: "), std::string::npos) << sg_last_error();
  EXPECT_NE(std::string(sg_last_error()).find("rank 0"), std::string::npos) << sg_last_error();
  // Timeouts outside [1 ms, a week] are refused before anything is read.
  for (const double timeout : {0.0, -1.0, 1e-4, 1e9, std::nan(""), HUGE_VAL}) {
    EXPECT_EQ(sg_world_init(SG_DEVICE_HOST, timeout, &world), SG_ERROR_INVALID_ARGUMENT) << timeout;
    EXPECT_NE(std::string(sg_last_error()).find("sg_world_init: timeout_seconds must be in [0.001, 604800]"),
              std::string::npos)
        << sg_last_error();
  }
}

TEST_F(WorldTest, TrainStepConfigIsVersioned) {
  sg_train_step_config config;
  std::memset(&config, 0xab, sizeof(config));
  sg_train_step_config_default(&config);
  const sg_train_step_config initializer = SG_TRAIN_STEP_CONFIG_INITIALIZER;
  EXPECT_EQ(config.size, sizeof(sg_train_step_config));
  EXPECT_EQ(config.magic, SG_TRAIN_STEP_CONFIG_MAGIC);
  EXPECT_EQ(config.version, static_cast<uint32_t>(SG_TRAIN_STEP_CONFIG_VERSION));
  EXPECT_EQ(config.tokens, 0);
  EXPECT_EQ(config.world, nullptr);
  // The initializer and the function agree field by field (padding bytes may differ).
  EXPECT_EQ(initializer.size, config.size);
  EXPECT_EQ(initializer.magic, config.magic);
  EXPECT_EQ(initializer.version, config.version);
  EXPECT_EQ(initializer.tokens, config.tokens);
  EXPECT_EQ(initializer.world, config.world);
  EXPECT_EQ(initializer.sequences, 0);
  EXPECT_EQ(config.sequences, 0);
  EXPECT_EQ(initializer.zero1, 0);
  EXPECT_EQ(config.zero1, 0);
  sg_train_step_config_default(nullptr);  // like the other *_default calls: nothing to fill

  sg_context ctx = nullptr;
  ASSERT_SG_OK(sg_context_create(SG_DEVICE_HOST, 0, &ctx));
  const sg_residual_stack_config model_config = small_fp32_stack_config();
  sg_layer model = nullptr;
  ASSERT_SG_OK(sg_residual_stack_create(ctx, &model_config, &model));
  sg_optimizer_config options = SG_OPTIMIZER_CONFIG_INITIALIZER;
  sg_optimizer optimizer = nullptr;
  ASSERT_SG_OK(sg_optimizer_create(ctx, &model, 1, &options, &optimizer));
  sg_train_step step = nullptr;
  auto expect_refused = [&](sg_train_step_config bad, const std::string& words) {
    EXPECT_EQ(sg_train_step_create(model, optimizer, &bad, &step), SG_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(step, nullptr);
    const std::string message = sg_last_error();
    EXPECT_NE(message.find("sg_train_step_create: " + words), std::string::npos) << message;
  };
  config.tokens = 4;
  sg_train_step_config bad = config;
  bad.magic = 0;
  expect_refused(bad, "config (sg_train_step_config) was not initialised");
  bad = config;
  bad.version = SG_TRAIN_STEP_CONFIG_VERSION + 1;
  expect_refused(bad, "config (sg_train_step_config) version 3 is newer than this library reads (1 to 2): the "
                      "caller was built against a newer stepgraph.h");
  bad = config;
  bad.version = 0;
  expect_refused(bad, "config (sg_train_step_config) version 0");
  bad = config;
  bad.size = sizeof(sg_train_step_config) + 8;  // a newer caller's struct with the old version number
  expect_refused(bad, "config (sg_train_step_config) size");
  bad = config;
  bad.zero1 = 1;  // without a world of several ranks
  expect_refused(bad, "config->zero1 shards the optimizer over a data-parallel world");
  {
    // A caller built against version 1 of the header: its struct ends before `sequences`, whose
    // bytes here are garbage; the library reads the version-1 fields and defaults the rest.
    sg_train_step_config old_caller = config;
    old_caller.version = 1;
    old_caller.size = offsetof(sg_train_step_config, sequences);
    old_caller.sequences = -7;
    old_caller.zero1 = 5;
    ASSERT_SG_OK(sg_train_step_create(model, optimizer, &old_caller, &step));
    ASSERT_SG_OK(sg_train_step_destroy(step));
    step = nullptr;
  }
  EXPECT_EQ(sg_train_step_create(model, optimizer, nullptr, &step), SG_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sg_last_error()).find("config is NULL"), std::string::npos);

  ASSERT_SG_OK(sg_train_step_create(model, optimizer, &config, &step));
  sg_tensor x = nullptr;
  ASSERT_SG_OK(sg_train_step_inputs(step, &x, nullptr));
  int64_t dims[2] = {};
  ASSERT_SG_OK(sg_tensor_dims(x, dims, 2));
  EXPECT_EQ(dims[0], 4);
  EXPECT_EQ(dims[1], 8);
  ASSERT_SG_OK(sg_tensor_destroy(x));
  ASSERT_SG_OK(sg_train_step_destroy(step));
  ASSERT_SG_OK(sg_optimizer_destroy(optimizer));
  ASSERT_SG_OK(sg_layer_destroy(model));
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST_F(WorldTest, CommunicationStreamIsASideStream) {
  sg_context ctx = nullptr;
  ASSERT_SG_OK(sg_context_create(SG_DEVICE_HOST, 2, &ctx));
  int index = 0;
  ASSERT_SG_OK(sg_context_communication_stream(ctx, &index));
  EXPECT_EQ(index, -1);
  ASSERT_SG_OK(sg_context_set_communication_stream(ctx, 2));
  ASSERT_SG_OK(sg_context_communication_stream(ctx, &index));
  EXPECT_EQ(index, 2);
  for (const int bad : {0, 3, -2}) {
    EXPECT_EQ(sg_context_set_communication_stream(ctx, bad), SG_ERROR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(sg_last_error()).find("communication stream must be a side stream in [1, 3)"),
              std::string::npos)
        << sg_last_error();
  }
  ASSERT_SG_OK(sg_context_communication_stream(ctx, &index));
  EXPECT_EQ(index, 2) << "a refused index changes nothing";
  ASSERT_SG_OK(sg_context_set_communication_stream(ctx, -1));
  ASSERT_SG_OK(sg_context_destroy(ctx));
}

TEST_F(WorldTest, AWorldOfOneTrainsLikeNoWorldBitForBit) {
  const Trained alone = train(nullptr, 0, 1);
  ASSERT_EQ(alone.error, "");
  sg_world world = nullptr;
  ASSERT_SG_OK(sg_world_init(SG_DEVICE_HOST, 1.0, &world));
  const Trained with_world = train(world, 0, 1);
  ASSERT_EQ(with_world.error, "");
  EXPECT_EQ(alone.losses, with_world.losses);
  EXPECT_EQ(alone.parameters, with_world.parameters);
  EXPECT_LT(alone.losses[2], alone.losses[0]) << "the model did not train";
}

// Each rank in a forked child: joins the world from torchrun's variables,
// trains, and writes its losses and parameters to `path`. Exit code 0 when
// all went well; otherwise the message is in the file.
[[noreturn]] void run_rank(int rank, int port, const std::string& path) {
  set_torchrun(rank, 2, port);
  int code = 0;
  std::string text;
  sg_world world = nullptr;
  if (sg_world_init(SG_DEVICE_HOST, 30.0, &world) != SG_OK) {
    text = std::string("sg_world_init: ") + sg_last_error();
    code = 2;
  } else {
    int size = 0;
    sg_world_size(world, &size);
    const Trained trained = train(world, rank, size);
    if (!trained.error.empty()) {
      text = trained.error;
      code = 3;
    } else {
      for (const std::vector<float>* values : {&trained.losses, &trained.parameters}) {
        text.append(reinterpret_cast<const char*>(values->data()), values->size() * sizeof(float));
      }
    }
  }
  std::ofstream(path, std::ios::binary) << text;
  std::_Exit(code);
}

TEST_F(WorldTest, TwoRanksInProcessesEqualOneProcessOnTheWholeBatch) {
  const int port = free_port();
  ASSERT_NE(port, 0);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  std::vector<std::string> paths;
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    paths.push_back(dir + "/world_test_rank" + std::to_string(rank) + "_" + std::to_string(::getpid()));
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) run_rank(rank, port, paths.back());
    pids.push_back(pid);
  }
  // Children that outlive a minute have hung: kill them, and fail.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::vector<int> codes(2, -1);
  for (int rank = 0; rank < 2; ++rank) {
    int status = 0;
    while (::waitpid(pids[rank], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (const pid_t pid : pids) ::kill(pid, SIGKILL);
        ::waitpid(pids[rank], &status, 0);
        ADD_FAILURE() << "rank " << rank << " hung";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    codes[rank] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  std::vector<std::string> outputs;
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    outputs.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    std::remove(path.c_str());
  }
  for (int rank = 0; rank < 2; ++rank) ASSERT_EQ(codes[rank], 0) << "rank " << rank << ": " << outputs[rank];
  // Every rank reports the global mean loss and ends with the same parameters, bit for bit.
  EXPECT_EQ(outputs[0], outputs[1]);

  const Trained alone = train(nullptr, 0, 1);  // after the forks: no engine state was copied into them
  ASSERT_EQ(alone.error, "");
  const std::size_t floats = alone.losses.size() + alone.parameters.size();
  ASSERT_EQ(outputs[0].size(), floats * sizeof(float));
  std::vector<float> ranked(floats);
  std::memcpy(ranked.data(), outputs[0].data(), outputs[0].size());
  double worst_loss = 0;
  for (std::size_t i = 0; i < alone.losses.size(); ++i) {
    worst_loss = std::max(worst_loss, std::abs(double{ranked[i]} - alone.losses[i]) / std::abs(alone.losses[i]));
  }
  EXPECT_LT(worst_loss, 1e-5) << "largest relative loss difference to one process";
  double worst_parameter = 0;
  for (std::size_t i = 0; i < alone.parameters.size(); ++i) {
    const double a = alone.parameters[i];
    worst_parameter = std::max(worst_parameter, std::abs(ranked[alone.losses.size() + i] - a) / (std::abs(a) + 1e-3));
  }
  EXPECT_LT(worst_parameter, 1e-5) << "largest parameter difference to one process";
}

}  // namespace
