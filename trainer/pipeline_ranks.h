// The trainer's pipeline parallelism (--pp, --virtual-stages,
// --microbatches): where each rank sits, its groups, and each step's batch
// cut into the microbatches of its stage (LanguageModelStages).
//
// Note [Pipeline ranks in the trainer]
// The world is tp x pp x dp, tp innermost: world rank r is tensor-parallel
// rank r % tp of stage (r / tp) % pp of replica r / (tp pp). So the ranks of
// one stage's TP group are consecutive (as without --pp), the pipeline
// communicator of a replica joins the ranks of one TP index across the
// stages (each TP rank sends its own rows of the residual stream), and the
// data-parallel group of a rank joins its stage's same TP rank in every
// replica (LanguageModelStages' options.stage.data_parallel: only gradient
// sums of the same parameters are all-reduced).
//
// The data. Every rank draws the same global batch of --batch rows
// (sequences or examples); replica d takes rows [d B/dp, (d+1) B/dp), cut
// into --microbatches microbatches of consecutive rows, microbatch m its
// m-th; a TP rank holds its 1/tp of a microbatch's tokens (consecutive).
// Stage 0 loads the tokens, the last stage the labels; the other stages
// load nothing. The step's loss is the mean over the global batch, given to
// every rank (Note [The GPT in pipeline stages]).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/communicator.h"
#include "engine/context.h"
#include "train/language_model_stages.h"
#include "trainer/data_source.h"
#include "trainer/options.h"

namespace stepgraph::trainer {

struct PipelineRanks {
  int tp = 1, pp = 1, dp = 1;               // the group sizes
  int tp_rank = 0, stage = 0, dp_rank = 0;  // this rank's place
  std::int64_t microbatches = 1;
  std::int64_t microbatch_rows = 0;  // sequences (or examples) of a microbatch, all its TP ranks'
};

// This rank's place in a world of `ranks` for the resolved options `o`
// (o.pp > 1). Error(kInvalidArgument) naming the flags where the world or
// the batch do not divide as the layout needs.
PipelineRanks pipeline_ranks(const TrainerOptions& o, int rank, int ranks);

// The pipeline communicator of this rank and its stage's data-parallel
// group (null with one replica), split from `world` (the world itself where
// a group is all of it).
class PipelineGroups {
 public:
  PipelineGroups(Communicator& world, const PipelineRanks& ranks);
  Communicator& pipeline() const { return *pipeline_; }
  Communicator* data_parallel() const { return data_parallel_; }

 private:
  std::unique_ptr<Communicator> pipeline_group_;
  std::unique_ptr<Communicator> data_parallel_group_;
  Communicator* pipeline_ = nullptr;
  Communicator* data_parallel_ = nullptr;
};

// Writes this rank's share of `batch` (the global batch of `width`-token
// windows) into the stages' microbatch inputs: tokens on stage 0, labels on
// the last stage (the sequence model's labels are each token's next).
void load_microbatches(Context& ctx, const LanguageModelStages& stages, const Batch& batch, const PipelineRanks& ranks,
                       bool sequences, std::int64_t width);

// The setup line: "pipeline parallel: 2 stages (...), 1 chunk a rank, 4
// microbatches of 2 sequences, 1F1B; stage 0 holds blocks [0, 2) and the
// embedding, stage 1 blocks [2, 4), the final norm and the head; ...".
std::string pipeline_setup_line(const LanguageModelStages& stages, const PipelineRanks& ranks, std::int64_t layers,
                                bool sequences, const Communicator* data_parallel);

}  // namespace stepgraph::trainer
