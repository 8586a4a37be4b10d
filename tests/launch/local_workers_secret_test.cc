// --nproc-per-node's ranks get a fresh rendezvous secret in their
// environment, never on their command line: run_local_workers starts this
// test binary again as two workers, which check what they were given and
// meet through an authenticated rendezvous.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "launch/launch_env.h"
#include "launch/rendezvous.h"
#include "trainer/distributed.h"

namespace stepgraph {
namespace {

bool in_worker() { return std::getenv(trainer::kLocalWorkerVariable) != nullptr; }

// The worker's side: runs only in the processes run_local_workers starts.
TEST(LocalWorkersSecretTest, WorkerSide) {
  if (!in_worker()) return;  // runs in the workers LocalWorkersGetASecretInTheirEnvironment starts
  const char* secret = std::getenv("STEPGRAPH_RENDEZVOUS_SECRET");
  ASSERT_NE(secret, nullptr) << "no STEPGRAPH_RENDEZVOUS_SECRET in the worker's environment";
  EXPECT_EQ(std::string(secret).size(), 64u);
  EXPECT_EQ(std::getenv("STEPGRAPH_RENDEZVOUS_SECRET_FILE"), nullptr) << "the parent's secret file leaked through";
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  const std::string argv((std::istreambuf_iterator<char>(cmdline)), std::istreambuf_iterator<char>());
  EXPECT_EQ(argv.find(secret), std::string::npos) << "the secret is on the command line";

  const LaunchInfo info = launch_info_from_env();
  EXPECT_EQ(info.secret, secret);
  auto rendezvous = Rendezvous::connect(info, "local-workers", std::chrono::seconds(10));
  const std::vector<std::string> ranks = rendezvous->all_gather(std::to_string(info.rank), "ranks");
  EXPECT_EQ(ranks, (std::vector<std::string>{"0", "1"}));
}

TEST(LocalWorkersSecretTest, LocalWorkersGetASecretInTheirEnvironment) {
  if (in_worker()) return;  // the parent's side
  // A secret file in the parent's environment is not what the workers use.
  ::setenv("STEPGRAPH_RENDEZVOUS_SECRET_FILE", "/no/such/file", 1);
  const int status = trainer::run_local_workers(2, {"--gtest_filter=LocalWorkersSecretTest.WorkerSide"},
                                                std::chrono::seconds(10), /*max_restarts=*/0, std::cerr);
  ::unsetenv("STEPGRAPH_RENDEZVOUS_SECRET_FILE");
  EXPECT_EQ(status, 0) << "a worker failed; its output is above";
}

}  // namespace
}  // namespace stepgraph
