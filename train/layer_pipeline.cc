#include "train/layer_pipeline.h"

#include "engine/error.h"
#include "ops/elementwise_ops.h"

namespace stepgraph {

LayerPipeline::LayerPipeline(Context& ctx, std::vector<AnyLayer*> layers, std::int64_t microbatches,
                             const LayerPipelineOptions& options)
    : layers_(std::move(layers)), microbatches_(microbatches), options_(options) {
  SG_CHECK(!layers_.empty(), "LayerPipeline: the list of layers is empty");
  SG_CHECK(microbatches_ > 0, "LayerPipeline: microbatches must be positive, got ", microbatches_);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    SG_CHECK(layers_[i] != nullptr, "LayerPipeline: layer ", i, " is null");
    for (std::size_t j = 0; j < i; ++j) {
      SG_CHECK(layers_[j] != layers_[i], "LayerPipeline: layers ", j, " and ", i, " are the same ", layers_[i]->kind(),
               " layer; its second backward would overwrite the first's gradients");
    }
    first_parameter_.push_back(parameters_.size());
    for (Parameter* parameter : layers_[i]->parameters()) parameters_.push_back(parameter);
  }
  first_parameter_.push_back(parameters_.size());
  for (Parameter* parameter : parameters_) {
    gradient_sums_.push_back(options_.accumulate_gradients
                                 ? ctx.persistent(parameter->grad.name() + ".sum", parameter->grad.meta())
                                 : parameter->grad);
  }
  saved_.resize(static_cast<std::size_t>(microbatches_));
}

void LayerPipeline::check_microbatch(std::int64_t m, const char* pass) const {
  SG_CHECK(m >= 0 && m < microbatches_, "LayerPipeline ", pass, ": microbatch ", m, " is outside [0, ", microbatches_,
           ")");
}

std::string LayerPipeline::segment_name(const PipelinePass& pass, std::size_t layer) const {
  return pass.to_string() + " layer " + std::to_string(layer) + " (" + std::string(layers_.at(layer)->kind()) + ")";
}

Tensor LayerPipeline::forward(Context& ctx, std::int64_t m, const Tensor& x) {
  check_microbatch(m, "forward");
  std::vector<std::any>& saved = saved_[static_cast<std::size_t>(m)];
  SG_CHECK(saved.empty(), "LayerPipeline forward: microbatch ", m,
           "'s forward ran already and its backward has not; a schedule runs each once per iteration");
  SG_CHECK(x.defined(), "LayerPipeline forward: microbatch ", m, "'s input is undefined");
  Tensor h = x;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    ctx.begin_segment(segment_name({PipelinePass::Kind::kForward, m}, i));
    auto [y, state] = layers_[i]->forward(ctx, h);
    saved.push_back(std::move(state));
    h = std::move(y);
  }
  return h;
}

Tensor LayerPipeline::backward(Context& ctx, std::int64_t m, const Tensor& dy) {
  check_microbatch(m, "backward");
  std::vector<std::any>& saved = saved_[static_cast<std::size_t>(m)];
  SG_CHECK(!saved.empty(), "LayerPipeline backward: microbatch ", m, "'s forward has not run in this iteration");
  SG_CHECK(dy.defined(), "LayerPipeline backward: microbatch ", m, "'s output gradient is undefined");
  Tensor grad = dy;
  for (std::size_t i = layers_.size(); i-- > 0;) {
    ctx.begin_segment(segment_name({PipelinePass::Kind::kBackward, m}, i));
    grad = layers_[i]->backward(ctx, saved[i], grad);
    accumulate(ctx, i);
    SG_CHECK(grad.defined() || i == 0, "LayerPipeline backward: layer ", i, " (", layers_[i]->kind(),
             ") returned no input gradient, but layer ", i - 1, " needs one; only the first layer may skip dgrad");
  }
  saved.clear();  // the saved tensors go now, so the planner can reuse their memory
  if (++backwards_this_iteration_ == microbatches_) backwards_this_iteration_ = 0;
  return grad;
}

// See Note [Gradients summed over microbatches].
void LayerPipeline::accumulate(Context& ctx, std::size_t layer) {
  if (!options_.accumulate_gradients) return;
  for (std::size_t p = first_parameter_[layer]; p < first_parameter_[layer + 1]; ++p) {
    if (backwards_this_iteration_ == 0) {
      ops::copy_(ctx, gradient_sums_[p], parameters_[p]->grad);
    } else {
      ops::axpy_(ctx, gradient_sums_[p], parameters_[p]->grad, 1.0f);
    }
  }
}

}  // namespace stepgraph
