// The watchdog ends a rank whose phase outlives the timeout (status 3, a
// message naming the rank and the phase) and leaves a healthy one alone.
#include "trainer/watchdog.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

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
