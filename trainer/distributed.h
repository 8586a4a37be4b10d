// The trainer's ranks: one process per GPU (NCCL's model), started by the
// trainer itself (--nproc-per-node N) or by the launchers people use
// (torchrun, Slurm srun, Open MPI mpirun: launch/launch_env.h).
//
//   trainer --nproc-per-node 2 ...            # this host, 2 ranks
//   torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 trainer ...   (or srun / mpirun)
//
// Every rank meets at MASTER_ADDR:MASTER_PORT (launch/rendezvous.h):
// rank 0's NCCL unique id reaches the others there, and the ranks compare
// their flags before any work, so ranks started differently stop at once
// with an error naming the flag. On the host backend the ranks' collectives
// run over the same rendezvous (a host communicator), so every multi-rank
// path of the trainer runs without a GPU.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/device_kind.h"
#include "launch/launch_env.h"

namespace stepgraph::trainer {

// Set in the workers --nproc-per-node starts (they must not start workers).
inline constexpr const char* kLocalWorkerVariable = "STEPGRAPH_LOCAL_WORKER";
// How many times the workers were started again after a failure (0 on the
// first start): --max-restarts sets it, torchrun's TORCHELASTIC_RESTART_COUNT
// counts the same.
inline constexpr const char* kRestartVariable = "STEPGRAPH_RESTART_COUNT";
// The exit status of a run refused for its flags (never restarted).
inline constexpr int kInvalidArgumentExit = 2;

// Starts `nproc` copies of this program with `args` (the worker's command
// line: --nproc-per-node removed) as ranks 0..nproc-1 of a local world, on a
// free port of 127.0.0.1, with a fresh rendezvous secret (from the OS's
// random source) in their environment (STEPGRAPH_RENDEZVOUS_SECRET, never in
// argv) and NVLink multicast kept off. Waits for all; once one fails, the others get `timeout` to
// end on their own (they notice the dead rank) before they are killed.
// Then, up to `max_restarts` times, starts every rank again (Note [Elastic
// restarts]); a run refused for its flags is not restarted. Returns the last
// start's first failure's exit code (0 when every rank succeeded).
int run_local_workers(int nproc, const std::vector<std::string>& args, std::chrono::milliseconds timeout,
                      int max_restarts, std::ostream& err);

// Note [Elastic restarts]
// A rank that dies ends the run's other ranks (the watchdog); a launcher with
// restarts (--max-restarts with --nproc-per-node, torchrun --max-restarts)
// then starts every rank again. A restarted trainer with --checkpoint
// resumes from it where it exists (the newest complete save: checkpoints are
// written atomically and per-rank parts commit through their manifest) and
// starts over where none was saved yet. Training is deterministic (Note
// [Deterministic algorithm choice] in engine/algorithm_choice.h), so the
// finished run equals an uninterrupted one bit for bit.
//
// The restart count of this process (kRestartVariable, else torchrun's
// TORCHELASTIC_RESTART_COUNT; 0 without either). An Error for a value that
// is not a count.
int restart_count_from_env();

struct World {
  LaunchInfo launch;
  std::unique_ptr<Communicator> comm;  // null for a single process
  int rank() const { return launch.rank; }
  int size() const { return launch.world_size; }
};

// Joins the world the launcher's variables describe. On cuda the rank drives
// GPU `local_rank` (made current here, before any Context exists) over NCCL;
// on host its collectives run over the rendezvous.
World join_world(Device device, std::chrono::milliseconds timeout);

// Every rank's configuration must equal rank 0's: otherwise an Error on
// every rank naming the first flag that differs and both values.
// `config`: "config.<flag>" -> value (trainer/train_state.h's RunConfig).
void check_same_flags(Communicator& comm, const std::map<std::string, std::string>& config);

}  // namespace stepgraph::trainer
