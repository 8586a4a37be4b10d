// The watchdog ends a rank whose phase outlives the timeout (status 3, a
// message naming the rank and the phase) and leaves a healthy one alone.
#include "trainer/watchdog.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/host_world.h"

namespace stepgraph::trainer {
namespace {

using namespace std::chrono_literals;

TEST(WatchdogDeathTest, AStepPastTheTimeoutEndsTheRankNamingTheStep) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        HostWorld world(2);
        auto comm = world.communicator(1, "dp");
        Watchdog watchdog(*comm, 200ms, "the gradient all-reduces");
        watchdog.start("step 7");
        std::this_thread::sleep_for(5s);  // a peer that never comes
      },
      ::testing::ExitedWithCode(Watchdog::kExitStatus),
      "rank 1: step 7 did not finish within 0.2 s: a peer rank died or stalled in the step's collectives \\(the "
      "gradient all-reduces\\); aborting communicator 'dp'");
}

TEST(WatchdogDeathTest, AnAbortedCommunicatorEndsTheRank) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        HostWorld world(2);
        auto rank0 = world.communicator(0);
        auto rank1 = world.communicator(1);
        Watchdog watchdog(*rank0, 60s, "all-reduces");
        rank1->abort("rank 1 ran out of data");
        std::this_thread::sleep_for(5s);
      },
      ::testing::ExitedWithCode(Watchdog::kExitStatus), "rank 0: .*rank 1 ran out of data");
}

// A communicator whose abort never returns (ncclCommAbort waiting on a dead
// peer, Note [A bounded abort]); every collective is a test error.
class StuckAbortCommunicator final : public Communicator {
 public:
  StuckAbortCommunicator() : Communicator("stuck", 0, 2) {}
  Device device() const override { return Device::kHost; }
  void all_reduce(const void*, void*, std::int64_t, DType, ReduceOp, CUstream_st*) override { unused(); }
  void all_reduce_many(std::span<void* const>, std::span<const std::int64_t>, DType, ReduceOp,
                       CUstream_st*) override {
    unused();
  }
  void reduce_scatter(const void*, void*, std::int64_t, DType, ReduceOp, CUstream_st*) override { unused(); }
  void all_gather(const void*, void*, std::int64_t, DType, CUstream_st*) override { unused(); }
  void broadcast(const void*, void*, std::int64_t, DType, int, CUstream_st*) override { unused(); }
  void send(const void*, std::int64_t, DType, int, CUstream_st*) override { unused(); }
  void recv(void*, std::int64_t, DType, int, CUstream_st*) override { unused(); }
  void send_recv(const void*, int, void*, int, std::int64_t, DType, CUstream_st*) override { unused(); }
  std::vector<std::string> exchange(std::string_view, std::string_view) override {
    unused();
    return {};
  }
  void abort(std::string_view) noexcept override {
    for (;;) std::this_thread::sleep_for(1h);
  }
  void check_health() override {}

 private:
  static void unused() { ADD_FAILURE() << "the watchdog made a collective call"; }
};

TEST(WatchdogDeathTest, AnAbortThatNeverReturnsStillEndsTheRankInBoundedTime) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        StuckAbortCommunicator comm;
        const auto start = std::chrono::steady_clock::now();
        Watchdog watchdog(comm, 100ms, "all-reduces");
        watchdog.start("step 3");
        std::this_thread::sleep_for(30s);  // the death test fails if the rank is still here
        std::fprintf(stderr, "still alive after %f s\n",
                     std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      },
      ::testing::ExitedWithCode(Watchdog::kExitStatus),
      "rank 0: step 3 did not finish.*the communicator's abort did not return within 1.5 s; exiting without it");
}

TEST(WatchdogTest, FinishedPhasesAndAHealthyWorldLeaveTheRankAlone) {
  HostWorld world(1);
  auto comm = world.communicator(0);
  Watchdog watchdog(*comm, 150ms, "nothing");
  for (int step = 0; step < 5; ++step) {
    watchdog.start("step " + std::to_string(step));
    std::this_thread::sleep_for(50ms);
    watchdog.finish();
  }
  std::this_thread::sleep_for(300ms);  // idle between phases: no timeout
  SUCCEED();
}

}  // namespace
}  // namespace stepgraph::trainer
