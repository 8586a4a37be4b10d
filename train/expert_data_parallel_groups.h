// The groups of an expert x data-parallel world (TrainStep's GradientGroups)
// and the check that three communicators form one.
//
// Layout: a world of EP x DP ranks, expert parallelism innermost (as the
// trainer puts tensor parallelism innermost): world rank w is rank w % EP of
// the expert-parallel group of replica w / EP, and rank w / EP of its
// expert-data-parallel group, the DP ranks with the same EP rank, which hold
// the same experts. For EP = 2, DP = 2:
//   world ranks       0  1 | 2  3
//   EP groups        {0, 1} {2, 3}    (replica 0, replica 1)
//   EDP groups       {0, 2} {1, 3}    (experts of EP rank 0, of EP rank 1)
// Dense (replicated) gradients are summed over the world, the experts' over
// their EDP group (Megatron's expert-data-parallel layout).
#pragma once

#include <memory>
#include <string_view>

#include "engine/communicator.h"

namespace stepgraph {

struct ExpertDataParallelGroups {
  std::unique_ptr<Communicator> expert_parallel;       // this rank's EP group ("ep")
  std::unique_ptr<Communicator> expert_data_parallel;  // the ranks holding its experts ("edp")
};

// Splits `world` into the layout above; every rank of `world` calls it.
// An Error (on every rank) where `expert_parallel` does not divide the world.
ExpertDataParallelGroups split_expert_data_parallel(Communicator& world, int expert_parallel);

// An Error, on every rank alike, unless `expert_parallel` and
// `expert_data_parallel` are this rank's groups of `data_parallel` in the
// layout above: sizes EP x DP = the world's, each rank at its place in
// both, each group holding the ranks it should (none mixing replicas, or
// experts). `who` starts the messages ("TrainStep"), which name the
// arguments. Every rank of `data_parallel` calls it (host exchanges over
// the three communicators: not while a stream is captured).
void check_expert_data_parallel_layout(Communicator& data_parallel, Communicator& expert_parallel,
                                       Communicator& expert_data_parallel, std::string_view who);

}  // namespace stepgraph
