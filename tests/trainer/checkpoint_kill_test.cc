// A training run SIGKILLed at any moment, saving every step, leaves a
// checkpoint that resumes exactly: the resumed losses equal an uninterrupted
// run's bit for bit. The run is a forked child killed at fractions of a full
// run's time, so kills land in steps and in saves alike (the points of a
// save are each hit deterministically in checkpoint_crash_test.cc). One
// process with one file, and two ranks with per-rank parts and a manifest.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/host_world.h"
#include "tests/trainer/small_model.h"
#include "tests/trainer/test_support.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace stepgraph::trainer {
namespace {

using testing::fresh_path;
using Clock = std::chrono::steady_clock;

constexpr std::int64_t kSteps = 30;
constexpr int kKills = 15;

// Saving every step to `checkpoint` (none where empty).
TrainerOptions options(bool zero1, const std::string& checkpoint) {
  // The window model: two ranks need no attention.
  TrainerOptions o = testing::small_model_flags(
      testing::SmallModel::kWindow, {.steps = kSteps, .log_every = 1000, .dtype = DType::kFloat32, .seed = 3});
  o.checkpoint = checkpoint;
  o.save_every = checkpoint.empty() ? 0 : 1;
  if (zero1) {
    o.dp_mode = DataParallelMode::kZero1;
    o.skip_nonfinite = false;
  }
  return resolve_defaults(o, Device::kHost);
}

// Every rank's losses; one rank without a world.
std::vector<std::vector<float>> train_world(const TrainerOptions& o, int ranks, std::int64_t* first_step = nullptr) {
  std::vector<std::vector<float>> losses(static_cast<std::size_t>(ranks));
  if (ranks == 1) {
    std::ostringstream log;
    const TrainResult result = train(o, Device::kHost, log);
    losses[0] = result.losses;
    if (first_step != nullptr) *first_step = result.first_step;
    return losses;
  }
  std::mutex mutex;
  HostWorld::run(ranks, [&](Communicator& comm) {
    std::ostringstream log;
    const TrainResult result = train(o, Device::kHost, log, &comm);
    const std::lock_guard<std::mutex> lock(mutex);
    losses[static_cast<std::size_t>(comm.rank())] = result.losses;
    if (first_step != nullptr) *first_step = result.first_step;
  });
  return losses;
}

// Runs `o` in a child, killed after `delay` (or left to finish when
// negative); returns the run's wall time.
std::chrono::duration<double> run_child(const TrainerOptions& o, int ranks, std::chrono::duration<double> delay) {
  const auto start = Clock::now();
  const pid_t child = ::fork();
  if (child == 0) {
    try {
      train_world(o, ranks);
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  EXPECT_GT(child, 0);
  if (delay.count() >= 0) {
    std::this_thread::sleep_for(delay);
    ::kill(child, SIGKILL);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 0))
      << "the child failed by itself (exit " << WEXITSTATUS(status) << ")";
  return Clock::now() - start;
}

void expect_killed_runs_resume_exactly(bool zero1, int ranks, const std::string& name) {
  // The children run first: this process forks before it starts any thread.
  const std::chrono::duration<double> full = run_child(options(zero1, fresh_path(name + ".timed.safetensors").string()),
                                                       ranks, std::chrono::duration<double>(-1));
  std::vector<std::string> paths;
  for (int k = 0; k < kKills; ++k) {
    paths.push_back(fresh_path(name + ".killed" + std::to_string(k) + ".safetensors").string());
    run_child(options(zero1, paths.back()), ranks, full * (k + 1) / (kKills + 1));
  }

  const std::vector<std::vector<float>> uninterrupted = train_world(options(zero1, ""), ranks);
  int resumed = 0;
  for (const std::string& path : paths) {
    if (!std::filesystem::exists(path)) continue;  // killed before its first save
    TrainerOptions rest = options(zero1, path);
    rest.resume = true;
    std::int64_t first = 0;
    std::vector<std::vector<float>> losses;
    try {
      losses = train_world(rest, ranks, &first);
    } catch (const Error& error) {
      if (error.message().find("nothing to resume") != std::string::npos) continue;  // it had finished
      ADD_FAILURE() << path << ": " << error.message();
      continue;
    }
    ++resumed;
    for (int r = 0; r < ranks; ++r) {
      const std::vector<float>& want = uninterrupted[static_cast<std::size_t>(r)];
      const std::vector<float>& got = losses[static_cast<std::size_t>(r)];
      ASSERT_EQ(got.size(), static_cast<std::size_t>(kSteps - first + 1)) << path;
      EXPECT_EQ(0, std::memcmp(got.data(), want.data() + (first - 1), got.size() * sizeof(float)))
          << path << ": rank " << r << " resumed at step " << first << " differs";
    }
  }
  std::printf("%s: %d of %d killed runs resumed exactly (a full run took %.0f ms)\n", name.c_str(), resumed, kKills,
              full.count() * 1e3);
  EXPECT_GE(resumed, kKills / 2) << "too few kills landed after the first save";
}

TEST(CheckpointKillTest, OneFileResumesExactlyAfterAKillAnywhere) {
  expect_killed_runs_resume_exactly(false, 1, "single");
}

TEST(CheckpointKillTest, PerRankPartsResumeExactlyAfterAKillAnywhere) {
  expect_killed_runs_resume_exactly(true, 2, "zero1");
}

}  // namespace
}  // namespace stepgraph::trainer
