#include "launch/launch_env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <string>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using Vars = std::map<std::string, std::string, std::less<>>;

EnvLookup lookup(Vars vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    const auto found = vars.find(name);
    if (found == vars.end()) return std::nullopt;
    return found->second;
  };
}

LaunchInfo read(Vars vars) { return launch_info_from_env(lookup(std::move(vars))); }

const Vars kTorchrun{{"RANK", "1"},
                     {"WORLD_SIZE", "4"},
                     {"LOCAL_RANK", "1"},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "10.0.0.1"},
                     {"MASTER_PORT", "29500"}};
const Vars kSlurm{{"SLURM_PROCID", "3"},
                  {"SLURM_NTASKS", "8"},
                  {"SLURM_LOCALID", "1"},
                  {"SLURM_TASKS_PER_NODE", "2(x4)"},
                  {"SLURM_NODELIST", "gpu07,gpu08,gpu09,gpu10"}};
const Vars kMpirun{{"OMPI_COMM_WORLD_RANK", "2"},
                   {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                   {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};

Vars with(Vars vars, const Vars& changes) {
  for (const auto& [name, value] : changes) vars[name] = value;
  return vars;
}

Vars without(Vars vars, std::initializer_list<const char*> names) {
  for (const char* name : names) vars.erase(name);
  return vars;
}

// ---- what each launcher's variables give

struct LauncherCase {
  const char* name;
  Vars vars;
  LaunchInfo want;
  std::string description;
};

class LauncherTest : public ::testing::TestWithParam<LauncherCase> {};

TEST_P(LauncherTest, ReadsRankWorldLocalWorldAndRendezvous) {
  const LauncherCase& c = GetParam();
  const LaunchInfo info = read(c.vars);
  EXPECT_EQ(info.launcher, c.want.launcher);
  EXPECT_EQ(info.rank, c.want.rank);
  EXPECT_EQ(info.world_size, c.want.world_size);
  EXPECT_EQ(info.local_rank, c.want.local_rank);
  EXPECT_EQ(info.local_world_size, c.want.local_world_size);
  EXPECT_EQ(info.master_addr, c.want.master_addr);
  EXPECT_EQ(info.master_port, c.want.master_port);
  EXPECT_EQ(describe(info), c.description);
}

INSTANTIATE_TEST_SUITE_P(
    Launchers, LauncherTest,
    ::testing::Values(
        LauncherCase{"NoLauncherIsOneProcess", {}, LaunchInfo{}, "a single process (rank 0 of 1, no launcher)"},
        LauncherCase{"Torchrun",
                     kTorchrun,
                     {.rank = 1,
                      .world_size = 4,
                      .local_rank = 1,
                      .local_world_size = 2,
                      .master_addr = "10.0.0.1",
                      .master_port = 29500,
                      .launcher = "torchrun"},
                     "rank 1 of 4 (local 1 of 2) via torchrun, rendezvous 10.0.0.1:29500"},
        LauncherCase{"Slurm",
                     kSlurm,
                     {.rank = 3,
                      .world_size = 8,
                      .local_rank = 1,
                      .local_world_size = 2,
                      .master_addr = "gpu07",
                      .master_port = 29500,
                      .launcher = "slurm"},
                     "rank 3 of 8 (local 1 of 2) via slurm, rendezvous gpu07:29500"},
        LauncherCase{"Mpirun",
                     with(kMpirun, {{"MASTER_PORT", "31000"}}),
                     {.rank = 2,
                      .world_size = 4,
                      .local_rank = 2,
                      .local_world_size = 4,
                      .master_addr = "127.0.0.1",
                      .master_port = 31000,
                      .launcher = "mpirun"},
                     "rank 2 of 4 (local 2 of 4) via mpirun, rendezvous 127.0.0.1:31000"}),
    [](const ::testing::TestParamInfo<LauncherCase>& info) { return std::string(info.param.name); });

// ---- no launcher

TEST(LaunchEnvTest, OneProcessStillReadsTheRendezvousAddress) {
  const LaunchInfo info = read({{"MASTER_ADDR", "head"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(info.launcher, "none");
  EXPECT_EQ(info.master_addr, "head");
  EXPECT_EQ(info.master_port, 1234);
}

TEST(LaunchEnvTest, SallocOrSbatchAloneIsNoMultiProcessLaunch) {
  // An allocation sets these, but only srun sets SLURM_PROCID for each task.
  const LaunchInfo info = read({{"SLURM_NTASKS", "8"}, {"SLURM_NODELIST", "gpu[01-02]"}, {"SLURM_JOB_ID", "77"}});
  EXPECT_EQ(info.launcher, "none");
  EXPECT_EQ(info.world_size, 1);
}

TEST(LaunchEnvTest, ProcessEnvReadsTheEnvironment) {
  ASSERT_EQ(::setenv("STEPGRAPH_LAUNCH_ENV_TEST", "seven", 1), 0);
  ::unsetenv("STEPGRAPH_LAUNCH_ENV_TEST_UNSET");
  const EnvLookup env = process_env();
  EXPECT_EQ(env("STEPGRAPH_LAUNCH_ENV_TEST"), std::optional<std::string>("seven"));
  EXPECT_EQ(env("STEPGRAPH_LAUNCH_ENV_TEST_UNSET"), std::nullopt);
  ::unsetenv("STEPGRAPH_LAUNCH_ENV_TEST");
}

// ---- torchrun

// torchrun's agent keeps its store on MASTER_PORT (seen on the H100 machines):
// the rendezvous meets one port up; STEPGRAPH_RENDEZVOUS_PORT chooses outright.
TEST(LaunchEnvTest, TorchrunsAgentStoreMovesTheRendezvousOnePortUp) {
  Vars vars = kTorchrun;
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  EXPECT_EQ(read(vars).master_port, 29501);
  vars["MASTER_PORT"] = "65535";
  EXPECT_EQ(read(vars).master_port, 65534);
  vars["STEPGRAPH_RENDEZVOUS_PORT"] = "4000";
  EXPECT_EQ(read(vars).master_port, 4000);
  vars["STEPGRAPH_RENDEZVOUS_PORT"] = "70000";
  EXPECT_ERROR_CONTAINS(read(vars), "STEPGRAPH_RENDEZVOUS_PORT", "outside [1, 65535]");
}

TEST(LaunchEnvTest, TorchrunOnOneHostNeedsNoMasterAddr) {
  const LaunchInfo info = read(
      {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_PORT", "6000"}});
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, 6000);
}

TEST(LaunchEnvTest, TorchrunOnSeveralHostsNeedsMasterAddr) {
  EXPECT_ERROR_CONTAINS(read(without(kTorchrun, {"MASTER_ADDR"})), "MASTER_ADDR is not set", "several hosts",
                        "world size 4", "set MASTER_ADDR");
}

TEST(LaunchEnvTest, TorchrunPartlySetNamesWhatIsMissing) {
  EXPECT_ERROR_CONTAINS(read({{"RANK", "1"}}), "torchrun variables are partly set", "RANK='1'", "WORLD_SIZE",
                        "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  EXPECT_ERROR_CONTAINS(read(without(kTorchrun, {"RANK"})), "partly set", "WORLD_SIZE='4'", "but RANK is not");
  EXPECT_ERROR_CONTAINS(read({{"LOCAL_RANK", "0"}}), "partly set", "LOCAL_RANK='0'", "RANK, WORLD_SIZE");
  EXPECT_ERROR_CONTAINS(read(without(kTorchrun, {"LOCAL_WORLD_SIZE"})), "partly set", "LOCAL_WORLD_SIZE is not");
}

// ---- Slurm

TEST(LaunchEnvTest, SlurmNtasksPerNodeComesBeforeTasksPerNode) {
  EXPECT_EQ(read(with(kSlurm, {{"SLURM_NTASKS_PER_NODE", "4"}})).local_world_size, 4);
}

TEST(LaunchEnvTest, SlurmTasksPerNodeFirstNumber) {
  EXPECT_EQ(read(with(kSlurm, {{"SLURM_TASKS_PER_NODE", "2(x3),1"}})).local_world_size, 2);
  EXPECT_EQ(read(with(kSlurm, {{"SLURM_TASKS_PER_NODE", "2,2,2,2"}})).local_world_size, 2);
}

TEST(LaunchEnvTest, SlurmTasksPerNodeOfThisNodeWhenNodeIdIsSet) {
  // Nodes 0 and 1 hold 3 tasks each, node 2 holds 2: this task is local 1 on node 2.
  const Vars uneven = with(kSlurm, {{"SLURM_TASKS_PER_NODE", "3(x2),2"}, {"SLURM_PROCID", "7"}});
  EXPECT_EQ(read(with(uneven, {{"SLURM_NODEID", "2"}})).local_world_size, 2);
  EXPECT_EQ(read(with(uneven, {{"SLURM_NODEID", "1"}})).local_world_size, 3);
  EXPECT_ERROR_CONTAINS(read(with(uneven, {{"SLURM_NODEID", "3"}})), "SLURM_TASKS_PER_NODE='3(x2),2'", "3 nodes",
                        "SLURM_NODEID is 3");
}

TEST(LaunchEnvTest, SlurmStepNodelistComesBeforeNodelist) {
  EXPECT_EQ(read(with(kSlurm, {{"SLURM_STEP_NODELIST", "gpu09"}})).master_addr, "gpu09");
}

TEST(LaunchEnvTest, SlurmMasterAddrAndPortWin) {
  const LaunchInfo info = read(with(kSlurm, {{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "4000"}}));
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 4000);
  // With MASTER_ADDR set, a compressed node list does not matter.
  EXPECT_EQ(read(with(kSlurm, {{"MASTER_ADDR", "head"}, {"SLURM_NODELIST", "gpu[07-10]"}})).master_addr, "head");
}

TEST(LaunchEnvTest, SlurmCompressedNodelistNeedsMasterAddr) {
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_NODELIST", "gpu[07-10]"}})), "MASTER_ADDR is not set",
                        "SLURM_NODELIST='gpu[07-10]'", "no plain hostname", "set MASTER_ADDR",
                        "scontrol show hostnames");
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_STEP_NODELIST", "gpu[07-08],gpu11"}})),
                        "SLURM_STEP_NODELIST='gpu[07-08],gpu11'", "set MASTER_ADDR");
  EXPECT_ERROR_CONTAINS(read(without(kSlurm, {"SLURM_NODELIST"})), "neither SLURM_STEP_NODELIST nor SLURM_NODELIST",
                        "set MASTER_ADDR");
}

TEST(LaunchEnvTest, SlurmPartlySetNamesWhatIsMissing) {
  EXPECT_ERROR_CONTAINS(read({{"SLURM_PROCID", "0"}}), "Slurm variables are partly set", "SLURM_PROCID='0'",
                        "SLURM_NTASKS, SLURM_LOCALID", "srun");
  EXPECT_ERROR_CONTAINS(read(without(kSlurm, {"SLURM_TASKS_PER_NODE"})), "partly set",
                        "neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE", "srun");
}

TEST(LaunchEnvTest, SlurmBadTaskList) {
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_TASKS_PER_NODE", "2(3)"}})), "SLURM_TASKS_PER_NODE='2(3)'",
                        "like '2(x3),1'");
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_TASKS_PER_NODE", "many"}})), "SLURM_TASKS_PER_NODE='many'");
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_TASKS_PER_NODE", "0(x4)"}})), "SLURM_TASKS_PER_NODE='0(x4)'",
                        "below 1");
}

TEST(LaunchEnvTest, SlurmRanksOutOfRange) {
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_PROCID", "8"}})), "SLURM_PROCID='8'", "outside [0, 8)",
                        "SLURM_NTASKS='8'");
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_LOCALID", "2"}})), "SLURM_LOCALID='2'", "outside [0, 2)",
                        "SLURM_TASKS_PER_NODE='2(x4)'");
}

// ---- Open MPI

TEST(LaunchEnvTest, MpirunOnSeveralHosts) {
  const Vars two_hosts = with(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  EXPECT_ERROR_CONTAINS(read(two_hosts), "MASTER_ADDR is not set", "mpirun", "several hosts");
  EXPECT_EQ(read(with(two_hosts, {{"MASTER_ADDR", "node0"}})).master_addr, "node0");
}

TEST(LaunchEnvTest, MpirunPartlySet) {
  EXPECT_ERROR_CONTAINS(read(without(kMpirun, {"OMPI_COMM_WORLD_SIZE"})), "mpirun variables are partly set",
                        "OMPI_COMM_WORLD_RANK='2'", "OMPI_COMM_WORLD_SIZE is not");
}

TEST(LaunchEnvTest, MpirunRankOutOfRange) {
  EXPECT_ERROR_CONTAINS(read(with(kMpirun, {{"OMPI_COMM_WORLD_RANK", "-1"}})), "OMPI_COMM_WORLD_RANK='-1'",
                        "outside [0, 4)", "OMPI_COMM_WORLD_SIZE='4'");
}

// ---- precedence

TEST(LaunchEnvTest, TorchrunComesBeforeSlurmAndMpirun) {
  // torchrun started by srun on each node: the torchrun variables say where this process stands.
  Vars all = with(with(kSlurm, kMpirun), kTorchrun);
  EXPECT_EQ(read(all).launcher, "torchrun");
  EXPECT_EQ(read(all).rank, 1);
}

TEST(LaunchEnvTest, SlurmComesBeforeMpirun) {
  const LaunchInfo info = read(with(kSlurm, kMpirun));
  EXPECT_EQ(info.launcher, "slurm");
  EXPECT_EQ(info.rank, 3);
}

TEST(LaunchEnvTest, PartlySetTorchrunIsAnErrorEvenUnderSlurm) {
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"RANK", "0"}})), "torchrun variables are partly set", "RANK='0'");
}

// ---- every inconsistency

TEST(LaunchEnvTest, NonIntegersAreErrors) {
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"RANK", "one"}})), "RANK='one'", "not an integer");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"WORLD_SIZE", "4.0"}})), "WORLD_SIZE='4.0'", "not an integer");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"LOCAL_RANK", " 1"}})), "LOCAL_RANK=' 1'", "not an integer");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"LOCAL_WORLD_SIZE", ""}})), "LOCAL_WORLD_SIZE=''", "not an integer");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"RANK", "99999999999999"}})), "RANK='99999999999999'", "not an integer");
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"SLURM_NTASKS", "8x"}})), "SLURM_NTASKS='8x'", "not an integer");
  EXPECT_ERROR_CONTAINS(read(with(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "four"}})),
                        "OMPI_COMM_WORLD_LOCAL_SIZE='four'", "not an integer");
  EXPECT_ERROR_CONTAINS(read({{"MASTER_PORT", "http"}}), "MASTER_PORT='http'", "not an integer");
}

TEST(LaunchEnvTest, RankOutsideTheWorldIsAnError) {
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"RANK", "4"}})), "RANK='4'", "outside [0, 4)", "WORLD_SIZE='4'");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"RANK", "-1"}})), "RANK='-1'", "outside [0, 4)");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"WORLD_SIZE", "0"}})), "WORLD_SIZE='0'", "at least 1");
}

TEST(LaunchEnvTest, LocalRankOutsideTheLocalWorldIsAnError) {
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"LOCAL_RANK", "2"}})), "LOCAL_RANK='2'", "outside [0, 2)",
                        "LOCAL_WORLD_SIZE='2'");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"LOCAL_RANK", "-3"}})), "LOCAL_RANK='-3'", "outside [0, 2)");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "8"}})), "LOCAL_WORLD_SIZE='8'", "outside [1, 4]",
                        "WORLD_SIZE='4'");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "0"}})), "LOCAL_WORLD_SIZE='0'", "outside [1, 4]");
}

TEST(LaunchEnvTest, PortOutsideTheRangeIsAnError) {
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"MASTER_PORT", "0"}})), "MASTER_PORT='0'", "outside [1, 65535]");
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"MASTER_PORT", "65536"}})), "MASTER_PORT='65536'", "outside [1, 65535]");
  EXPECT_ERROR_CONTAINS(read(with(kSlurm, {{"MASTER_PORT", "-80"}})), "MASTER_PORT='-80'", "outside [1, 65535]");
  EXPECT_EQ(read(with(kTorchrun, {{"MASTER_PORT", "65535"}})).master_port, 65535);
  EXPECT_EQ(read(with(kTorchrun, {{"MASTER_PORT", "1"}})).master_port, 1);
}

TEST(LaunchEnvTest, EmptyMasterAddrIsAnError) {
  EXPECT_ERROR_CONTAINS(read(with(kTorchrun, {{"MASTER_ADDR", ""}})), "MASTER_ADDR is set but empty");
}

TEST(LaunchEnvTest, ErrorsAreInvalidArgument) {
  try {
    (void)read(with(kTorchrun, {{"RANK", "x"}}));
    FAIL() << "accepted RANK=x";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace stepgraph
