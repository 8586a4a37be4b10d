// The trainer's expert parallelism (--ep): where each rank sits, which
// experts it holds, and the setup line that says so.
//
// Note [Expert parallelism in the trainer]
// The world is --ep N ranks (expert parallelism alone for now: no --tp,
// --cp, --pp or --dp beside it). Every rank builds the whole GPT (or window
// model) over the world as its expert-parallel communicator (Note
// [Expert-parallel ResidualStack] in layers/residual_stack.h): the
// embedding, attention, norms, routers, dense blocks and head are
// replicated, and every MoE block holds experts [r E/N, (r + 1) E/N) on rank
// r. Each rank trains its own rows of every step's global batch as a
// data-parallel rank does (rank r: rows [r B/N, (r + 1) B/N)); inside the
// step each MoE block sends its tokens to their experts' ranks and back
// (Note [Expert-parallel MoE] in layers/moe_mlp.h). TrainStep's data-parallel
// group is the world: the replicated parameters' gradients are all-reduced
// over it and the loss averaged, the experts' gradients are whole on their
// rank and never summed.
//
// So each rank holds state no other rank holds (its experts and their AdamW
// moments), and writes its own checkpoint part (trainer/checkpoint_layout.h).
//
// What equals what: each expert's outputs and gradients are the ones one
// rank computes on the global batch, bit for bit (the exchange keeps the
// rows' order); the replicated gradients are the sums of the ranks' partial
// sums, the same fp32 terms added in another order, so the losses equal one
// rank without --ep to fp32 rounding (tests/trainer/expert_parallel_trainer_test.cc).
#pragma once

#include <cstdint>
#include <string>

#include "engine/communicator.h"
#include "trainer/options.h"

namespace stepgraph::trainer {

struct ExpertRanks {
  int ep = 1;                      // the world
  int rank = 0;                    // this rank
  std::int64_t experts = 0;        // every MoE block's, all ranks'
  std::int64_t local_experts = 0;  // experts / ep
  std::int64_t rows = 0;           // this rank's sequences (or examples) of the global batch
};

// This rank's place for the resolved options `o` (o.ep > 1) in a world of
// `ranks`. Error(kInvalidArgument) naming --ep where the world is not --ep
// ranks.
ExpertRanks expert_ranks(const TrainerOptions& o, int rank, int ranks);

// The setup line: "expert parallel: 2 ranks (...), experts [0, 4) on rank 0,
// [4, 8) on rank 1 in each of the 2 MoE blocks; ...; the exchange: ...".
// `moe_blocks` the model's MoE blocks, `tokens` the rows an MoE block routes
// on each rank (tokens of the sequence model, examples of the window model),
// `topk` the experts of each.
std::string expert_setup_line(const ExpertRanks& ranks, const Communicator& ep, std::int64_t moe_blocks,
                              std::int64_t tokens, std::int64_t topk, bool sequences);

}  // namespace stepgraph::trainer
