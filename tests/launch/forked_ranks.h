// The fork-the-ranks harness of the launch tests (rendezvous_test,
// rendezvous_communicator_test): each test forks one child per rank on
// 127.0.0.1 (a free port picked by binding port 0). A child reports by exit
// code: 0 when every check held, otherwise it prints why to stderr and exits
// non-zero. The parent kills children that outlive a limit, so a hang fails
// the test instead of stalling it.
#pragma once

#include <chrono>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "engine/error.h"
#include "launch/launch_env.h"

namespace stepgraph::testing {

// The harness's and its tests' time words.
using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

inline constexpr int kTimedOut = 124;  // the parent killed the child
inline constexpr int kUncaught = 101;  // the child raised where it should not

// A port nobody listens on now.
int free_port();

// Rank `rank` of a torchrun world of `world_size` processes on 127.0.0.1:`port`, all on this host.
LaunchInfo rank_info(int rank, int world_size, int port);

// Runs body(i) in `count` child processes; returns their exit codes (kTimedOut for one killed after `limit`,
// 128 + signal for one ended by a signal).
std::vector<int> run_processes(int count, const std::function<int(int)>& body, milliseconds limit = seconds(9));

// Fails (non-fatally) for each process whose exit code is not 0.
void expect_all_succeeded(const std::vector<int>& codes);

// In a child: 0 when `call` raises a stepgraph::Error with `code` whose message has every word; 1 (and why) if not.
int expect_error(const std::function<void()>& call, ErrorCode code, std::initializer_list<std::string_view> words);

}  // namespace stepgraph::testing

// In a child: a check that prints where it failed and ends the child with 1.
#define CHILD_CHECK(cond, ...)                                                        \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: check failed: %s %s\n", __FILE__, __LINE__, #cond, \
                   ::stepgraph::detail::concat(__VA_ARGS__).c_str());                 \
      return 1;                                                                       \
    }                                                                                 \
  } while (false)
