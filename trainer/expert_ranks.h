// The trainer's expert parallelism (--ep, with --dp beside it): where each
// rank sits, which experts it holds, its groups, and the setup line that says
// so.
//
// Note [Expert parallelism in the trainer]
// The world is --ep N x --dp M ranks (--dp 0: world / N), expert
// parallelism innermost (train/expert_data_parallel_groups.h): world rank w
// is EP rank w % N of replica w / N. Every rank builds the whole GPT (or
// window model) over its replica's N ranks as its expert-parallel
// communicator (Note [Expert-parallel ResidualStack] in
// layers/residual_stack.h): the embedding, attention, norms, routers, dense
// blocks and head are replicated on every rank, and every MoE block holds
// experts [r E/N, (r + 1) E/N) on EP rank r, so ranks w and w + N hold the
// same experts. Each rank trains its own rows of every step's global batch
// as a data-parallel rank does (world rank w: rows [w B/(N M), (w + 1)
// B/(N M))); inside the step each MoE block sends its tokens to their
// experts' ranks of its replica and back (Note [Expert-parallel MoE] in
// layers/moe_mlp.h). TrainStep's data-parallel group is the world: the
// replicated parameters' gradients are all-reduced over all N M ranks and
// the loss averaged; the experts' gradients are all-reduced over their
// expert-data-parallel group, the M ranks holding the same experts (none at
// M = 1: they are whole on their rank). Not with --tp, --cp, --pp or ZeRO-1
// (options.cc refuses them, naming the flags). Host processes cannot split
// a world, so they run M = 1 only; thread worlds and NCCL run any M.
//
// So each EP rank holds state no other EP rank of its replica holds (its
// experts and their AdamW moments), and every rank writes its own checkpoint
// part (trainer/checkpoint_layout.h). The M replicas' parts hold the same
// bits; keeping all of them costs disk but keeps every rank's resume a read
// of its own part, at any M, exact.
//
// What equals what: each expert's outputs are the ones one rank computes on
// the global batch, bit for bit (the exchange keeps the rows' order); the
// gradients are sums of the ranks' partial sums, the same fp32 terms added in
// another order, so the losses equal one rank without --ep to fp32 rounding
// (tests/trainer/expert_parallel_trainer_test.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/communicator.h"
#include "trainer/options.h"

namespace stepgraph::trainer {

struct ExpertRanks {
  int ep = 1;                      // ranks of an expert-parallel group (a replica)
  int dp = 1;                      // replicas: ranks holding the same experts
  int rank = 0;                    // this rank of the world
  std::int64_t experts = 0;        // every MoE block's, all ranks'
  std::int64_t local_experts = 0;  // experts / ep
  std::int64_t rows = 0;           // this rank's sequences (or examples) of the global batch

  int ep_rank() const { return rank % ep; }
  int replica() const { return rank / ep; }
};

// This rank's place for the resolved options `o` (o.ep > 1) in a world of
// `ranks`. Error(kInvalidArgument) naming --ep and --dp where the world is
// not --ep x --dp ranks, and --batch where the ranks' rows do not divide it.
ExpertRanks expert_ranks(const TrainerOptions& o, int rank, int ranks);

// The model's expert-parallel communicator and TrainStep's expert-data-
// parallel group; the world and none at dp 1.
struct ExpertGroups {
  Communicator* expert_parallel = nullptr;
  Communicator* expert_data_parallel = nullptr;
  std::unique_ptr<Communicator> owned_expert_parallel;
  std::unique_ptr<Communicator> owned_expert_data_parallel;
};

// Every rank of `world` calls it. Error(kInvalidArgument) naming --ep and
// --dp where `world` cannot split (host processes).
ExpertGroups expert_groups(Communicator& world, const ExpertRanks& ranks);

// The setup line: "expert parallel: 2 ranks (...), experts [0, 4) on rank 0,
// [4, 8) on rank 1 in each of the 2 MoE blocks; ...; the exchange: ...", or
// with replicas "expert x data parallel: 4 ranks (...), 2 expert-parallel x 2
// replicas; ...". `moe_blocks` the model's MoE blocks, `tokens` the rows an
// MoE block routes on each rank (tokens of the sequence model, examples of
// the window model), `topk` the experts of each.
std::string expert_setup_line(const ExpertRanks& ranks, const ExpertGroups& groups, const Communicator& world,
                              std::int64_t moe_blocks, std::int64_t tokens, std::int64_t topk, bool sequences);

}  // namespace stepgraph::trainer
