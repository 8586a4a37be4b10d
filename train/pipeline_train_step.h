// PipelineTrainStep: one training step of the GPT in pipeline stages
// (LanguageModelStages): the iteration's passes, then AdamW over this
// stage's parameters from their gradients summed over the microbatches (and
// the data-parallel replicas). Like TrainStep, the same call runs eager or
// is traced into one captured step:
//
//   LanguageModelStages stages(ctx, pp, config, /*batch=*/2, /*microbatches=*/4);
//   AdamW optimizer(ctx, stages.parameters(), hyper);
//   PipelineTrainStep step(stages, optimizer);
//   CaptureOptions options;
//   options.communicators = stages.communicators();
//   auto graph = CapturedStep::capture(ctx, [&] { return step(ctx); }, options);
//   // write the microbatches' tokens and labels (LanguageModelStages), then:
//   graph->replay();  // graph->outputs()[0]: the step's loss, on every rank
//
// AdamW reads each parameter's gradient (Parameter::grad), which every
// microbatch's backward overwrites; the sums live beside it (Note
// [Gradients summed over microbatches]), so the step copies each sum into
// its gradient before the update: one pass over the stage's gradients.
// Every stage updates its own parameters only; no value crosses stages.
#pragma once

#include <vector>

#include "engine/context.h"
#include "optim/adamw.h"
#include "train/language_model_stages.h"

namespace stepgraph {

class PipelineTrainStep {
 public:
  // `optimizer` must update exactly stages.parameters(), with persistent
  // gradients; its non-finite skip, loss scaling and ZeRO-1 sharding are
  // not supported here yet (Errors). Both must outlive the step.
  PipelineTrainStep(LanguageModelStages& stages, AdamW& optimizer);

  // One step: returns what the stages' iteration returns ({loss, ...}).
  std::vector<Tensor> operator()(Context& ctx) const;

 private:
  LanguageModelStages& stages_;
  AdamW& optimizer_;
};

}  // namespace stepgraph
