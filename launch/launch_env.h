// LaunchInfo: where this process stands in a multi-process run (one process
// per GPU, NCCL's model), read from the environment the launcher set up.
//
//   const LaunchInfo info = launch_info_from_env();
//   logger().info("{}", describe(info));  // "rank 1 of 4 (local 1 of 2) via torchrun, rendezvous ..."
//
// The launchers people use, in this order of precedence:
//   torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (all four), MASTER_ADDR, MASTER_PORT;
//   Slurm     srun's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NTASKS_PER_NODE or
//             SLURM_TASKS_PER_NODE; the rendezvous is MASTER_ADDR/MASTER_PORT if set, else the
//             first host of SLURM_STEP_NODELIST / SLURM_NODELIST when it is a plain hostname;
//   Open MPI  mpirun's OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE; MASTER_ADDR/MASTER_PORT.
// None of them set: a single process (rank 0 of 1, launcher "none").
//
// Every inconsistency is a stepgraph::Error (kInvalidArgument) naming the
// variable and its value: a value that is no integer, a rank outside
// [0, world), a local rank outside [0, local world), a port outside
// [1, 65535], a launcher's variables partly set (RANK without WORLD_SIZE...),
// a run over several hosts with no MASTER_ADDR to meet at, a rendezvous
// secret that is too short or whose file others may read.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace stepgraph {

struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // this process's index among the processes of its host: its GPU
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // where rank 0 listens for the rendezvous
  int master_port = 29500;  // where rank 0 listens: MASTER_PORT (+1 under torchrun's agent store; see launch_env.cc)
  std::string launcher = "none";  // "torchrun", "slurm", "mpirun", or "none" (a single process)
  // The run's rendezvous secret (rendezvous_secret.h): STEPGRAPH_RENDEZVOUS_SECRET or the file
  // STEPGRAPH_RENDEZVOUS_SECRET_FILE names; empty when neither is set. Never printed.
  std::string secret;
};

// A lookup of environment variables: nullopt when the variable is not set.
// Tests pass a map; process_env() reads the process environment.
using EnvLookup = std::function<std::optional<std::string>(std::string_view)>;
EnvLookup process_env();

[[nodiscard]] LaunchInfo launch_info_from_env(const EnvLookup& env = process_env());

// "rank 1 of 4 (local 1 of 2) via torchrun, rendezvous 10.0.0.1:29500";
// "a single process (rank 0 of 1, no launcher)" for launcher "none".
std::string describe(const LaunchInfo& info);

}  // namespace stepgraph
