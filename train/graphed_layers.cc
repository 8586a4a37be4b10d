#include "train/graphed_layers.h"

#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph {

GraphedLayers::GraphedLayers(Context& ctx, std::vector<AnyLayer*> layers, const PipelineSchedule& schedule,
                             const GraphedLayersOptions& options)
    : ctx_(ctx), schedule_(schedule), pipeline_(ctx, std::move(layers), schedule.microbatches(), options.pipeline) {}

std::unique_ptr<GraphedLayers> GraphedLayers::capture(Context& ctx, std::vector<AnyLayer*> layers,
                                                      std::vector<TensorMeta> inputs,
                                                      const PipelineSchedule& schedule,
                                                      const GraphedLayersOptions& options) {
  SG_CHECK(static_cast<std::int64_t>(inputs.size()) == schedule.microbatches(), "GraphedLayers: ", inputs.size(),
           " input shape(s) for a schedule of ", schedule.microbatches(), " microbatch(es); give one per microbatch");
  std::unique_ptr<GraphedLayers> self(new GraphedLayers(ctx, std::move(layers), schedule, options));
  const auto microbatches = static_cast<std::size_t>(schedule.microbatches());
  self->outputs_.resize(microbatches);
  self->grad_inputs_.resize(microbatches);
  self->grad_outputs_.resize(microbatches);
  for (std::size_t m = 0; m < microbatches; ++m) {
    self->inputs_.push_back(ctx.persistent("pipeline.input." + std::to_string(m), inputs[m]));
  }
  GraphedLayers& g = *self;
  CaptureOptions capture_options;
  capture_options.pool_report_policy = options.pool_report_policy;
  g.step_ = CapturedStep::capture(
      ctx,
      [&] {
        std::vector<Tensor> results;
        for (const PipelinePass& pass : g.schedule_.passes()) {
          const auto m = static_cast<std::size_t>(pass.microbatch);
          if (pass.kind == PipelinePass::Kind::kForward) {
            g.outputs_[m] = g.pipeline_.forward(ctx, pass.microbatch, g.inputs_[m]);
            // The output gradient's shape is known now: it becomes a fixed
            // address like the input.
            g.grad_outputs_[m] = ctx.persistent("pipeline.grad_output." + std::to_string(m), g.outputs_[m].meta());
            results.push_back(g.outputs_[m]);
          } else {
            g.grad_inputs_[m] = g.pipeline_.backward(ctx, pass.microbatch, g.grad_outputs_[m]);
            if (g.grad_inputs_[m].defined()) results.push_back(g.grad_inputs_[m]);
          }
        }
        return results;
      },
      capture_options);
  // Each layer's part of each pass must be its own graph: a part that
  // records nothing would merge into its neighbour and shift the indices.
  const std::vector<Segment> segments = g.step_->program().segments();
  const std::size_t layer_count = g.pipeline_.layer_count();
  SG_CHECK(segments.size() == schedule.passes().size() * layer_count, "GraphedLayers: ", segments.size(),
           " graphs recorded for ", schedule.passes().size(), " passes of ", layer_count,
           " layers; a layer whose forward or backward launches nothing cannot be graphed on its own");
  for (std::size_t p = 0; p < schedule.passes().size(); ++p) {
    for (std::size_t k = 0; k < layer_count; ++k) {
      const PipelinePass& pass = schedule.passes()[p];
      const std::size_t layer = pass.kind == PipelinePass::Kind::kForward ? k : layer_count - 1 - k;
      SG_CHECK_CODE(segments[g.graph_index(p, layer)].name == g.pipeline_.segment_name(pass, layer),
                    ErrorCode::kInternal, "GraphedLayers: graph ", g.graph_index(p, layer), " is '",
                    segments[g.graph_index(p, layer)].name, "', expected '", g.pipeline_.segment_name(pass, layer),
                    "'");
    }
  }
  const StepPlan& plan = g.step_->plan();
  logger().info("graphed {} layer(s) over {} microbatch(es) ({}): {} graphs, pool {} bytes ({:.3f}x its lower bound)",
                layer_count, microbatches, schedule.to_string(), segments.size(), plan.pool_bytes,
                plan.ratio_to_lower_bound());
  return self;
}

std::size_t GraphedLayers::graph_index(std::size_t pass, std::size_t layer) const {
  const std::size_t layer_count = pipeline_.layer_count();
  const bool forward = schedule_.passes()[pass].kind == PipelinePass::Kind::kForward;
  return pass * layer_count + (forward ? layer : layer_count - 1 - layer);
}

std::size_t GraphedLayers::pass_index(const PipelinePass& pass) const {
  const auto& passes = schedule_.passes();
  for (std::size_t p = 0; p < passes.size(); ++p) {
    if (passes[p] == pass) return p;
  }
  SG_CHECK(false, "GraphedLayers: the schedule (", schedule_.to_string(), ") has no pass ", pass.to_string());
  return 0;
}

std::string GraphedLayers::next_graph() const { return step_->program().segments()[next_].name; }

// See Note [Per-layer graphs run in the captured order].
void GraphedLayers::replay_layer(const PipelinePass& pass, std::size_t layer, const Tensor& source,
                                 std::span<CUstream_st* const> source_streams) {
  const std::size_t layer_count = pipeline_.layer_count();
  SG_CHECK(layer < layer_count, "GraphedLayers: layer ", layer, " is outside [0, ", layer_count, ")");
  const std::size_t index = graph_index(pass_index(pass), layer);
  SG_CHECK_CODE(index == next_, ErrorCode::kInvalidState, "GraphedLayers: '", pipeline_.segment_name(pass, layer),
                "' is not the schedule's next graph, '", next_graph(),
                "': the pool was planned for the captured order (Note [Per-layer graphs run in the captured order])");
  const auto m = static_cast<std::size_t>(pass.microbatch);
  std::vector<InputBinding> bindings;
  if (source.defined()) {
    const bool forward = pass.kind == PipelinePass::Kind::kForward;
    SG_CHECK(forward ? layer == 0 : layer == layer_count - 1, "GraphedLayers: ", pass.to_string(), " layer ", layer,
             " takes no source; bind the input to layer 0's forward and the output gradient to layer ",
             layer_count - 1, "'s backward");
    bindings.push_back({forward ? inputs_[m] : grad_outputs_[m], source});
  }
  step_->replay_segment(index, bindings, source_streams);
  next_ = (next_ + 1) % step_->segment_count();
}

const Tensor& GraphedLayers::forward(std::int64_t m, const Tensor& x, std::span<CUstream_st* const> source_streams) {
  const PipelinePass pass{PipelinePass::Kind::kForward, m};
  for (std::size_t layer = 0; layer < pipeline_.layer_count(); ++layer) {
    replay_layer(pass, layer, layer == 0 ? x : Tensor{}, source_streams);  // streams wait only on a binding
  }
  return output(m);
}

const Tensor& GraphedLayers::backward(std::int64_t m, const Tensor& dy,
                                      std::span<CUstream_st* const> source_streams) {
  const PipelinePass pass{PipelinePass::Kind::kBackward, m};
  for (std::size_t layer = pipeline_.layer_count(); layer-- > 0;) {
    replay_layer(pass, layer, layer + 1 == pipeline_.layer_count() ? dy : Tensor{}, source_streams);
  }
  return grad_input(m);
}

namespace {
const Tensor& at(const std::vector<Tensor>& tensors, std::int64_t m, const char* what) {
  SG_CHECK(m >= 0 && m < static_cast<std::int64_t>(tensors.size()), "GraphedLayers ", what, ": microbatch ", m,
           " is outside [0, ", tensors.size(), ")");
  return tensors[static_cast<std::size_t>(m)];
}
}  // namespace

const Tensor& GraphedLayers::input(std::int64_t m) const { return at(inputs_, m, "input"); }
const Tensor& GraphedLayers::grad_output(std::int64_t m) const { return at(grad_outputs_, m, "grad_output"); }
const Tensor& GraphedLayers::output(std::int64_t m) const { return at(outputs_, m, "output"); }
const Tensor& GraphedLayers::grad_input(std::int64_t m) const { return at(grad_inputs_, m, "grad_input"); }

}  // namespace stepgraph
