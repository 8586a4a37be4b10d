// The capture uniformity check: NCCL matches collectives by their order
// alone, so ranks that record different collectives into their graphs hang
// at the first difference. Before anything is recorded, each rank sends the
// list of collectives its traced program makes, per communicator, to every
// other rank (Communicator::exchange) and compares:
//   - the collectives of the whole group (all-reduce, reduce-scatter, ...):
//     the same op, shapes, dtype, operator and root, in the same order;
//   - point to point: rank a's sends to b, in order, match b's receives from a.
// A difference is an Error, raised on every rank alike, naming the first
// collective that differs (its op and the value it reads) on both sides.
// CUDA-free.
#pragma once

#include <vector>

#include "engine/communicator.h"
#include "graphs/program.h"

namespace stepgraph {

// `communicators`: the groups whose ranks capture this step together; every
// one is checked, also where this rank's program makes no call on it (so a
// rank that skipped its collectives is named, not waited for). Communicators
// the program uses beyond them are checked after them, in order of first use.
// Returns the ids of the groups of more than one rank it checked, in that
// order: every rank of a group checked them alike.
std::vector<std::uint64_t> check_uniform_collectives(const Program& program,
                                                     const std::vector<Communicator*>& communicators);

}  // namespace stepgraph
