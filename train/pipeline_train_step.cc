#include "train/pipeline_train_step.h"

#include <unordered_set>

#include "engine/error.h"
#include "ops/elementwise_ops.h"

namespace stepgraph {

PipelineTrainStep::PipelineTrainStep(LanguageModelStages& stages, AdamW& optimizer)
    : stages_(stages), optimizer_(optimizer) {
  // An optimizer over any other set would train another model, or nothing, without a word.
  const std::vector<Parameter*>& mine = stages.parameters();
  const std::unordered_set<const Parameter*> in_stage(mine.begin(), mine.end());
  for (const Parameter* p : optimizer.parameters()) {
    SG_CHECK(in_stage.count(p) > 0, "PipelineTrainStep: the optimizer updates parameter '", p->name,
             "', which is not a parameter of stage ", stages.stage(),
             "; build the AdamW over this stage's parameters (LanguageModelStages::parameters())");
  }
  SG_CHECK(optimizer.parameter_count() == mine.size(), "PipelineTrainStep: the optimizer updates ",
           optimizer.parameter_count(), " parameter(s), stage ", stages.stage(), " holds ", mine.size(),
           "; build the AdamW over this stage's parameters (LanguageModelStages::parameters())");
  SG_CHECK_CODE(!optimizer.step_scoped_gradients() && !optimizer.skips_nonfinite() && !optimizer.scales_loss() &&
                    !optimizer.sharded(),
                ErrorCode::kUnsupported,
                "PipelineTrainStep: the optimizer's step-scoped gradients, non-finite skip, loss scaling or ZeRO-1 "
                "sharding are not supported with pipeline stages yet; build a plain AdamW (persistent gradients)");
}

std::vector<Tensor> PipelineTrainStep::operator()(Context& ctx) const {
  std::vector<Tensor> out = stages_(ctx);
  ctx.begin_segment("optimizer");
  const std::vector<Parameter*>& parameters = stages_.parameters();
  const std::vector<Tensor> sums = stages_.gradient_sums();
  for (std::size_t i = 0; i < parameters.size(); ++i) ops::copy_(ctx, parameters[i]->grad, sums[i]);
  optimizer_.step(ctx);
  return out;
}

}  // namespace stepgraph
