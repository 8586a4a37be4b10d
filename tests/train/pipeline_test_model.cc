#include "tests/train/pipeline_test_model.h"

#include "tests/layers/tensor_io.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"

namespace stepgraph::pipeline_testing {

MlpStack::MlpStack(Context& ctx, std::size_t layers, std::int64_t hidden, std::int64_t ffn,
                   Communicator* tensor_parallel) {
  for (std::size_t i = 0; i < layers; ++i) {
    owned.push_back(std::make_unique<AnyLayerOf<LayerNormMLP>>(
        ctx, "mlp." + std::to_string(i), LayerNormMLPConfig{.hidden = hidden, .ffn = ffn, .dtype = DType::kFloat32},
        static_cast<std::uint32_t>(i + 1), tensor_parallel));
  }
}

std::vector<AnyLayer*> MlpStack::layers() const {
  std::vector<AnyLayer*> out;
  for (const auto& layer : owned) out.push_back(layer.get());
  return out;
}

Batches draw_batches(std::mt19937& rng, int iterations, std::int64_t microbatches, std::int64_t values) {
  Batches b;
  for (int it = 0; it < iterations; ++it) {
    b.x.emplace_back();
    b.dy.emplace_back();
    for (std::int64_t m = 0; m < microbatches; ++m) {
      b.x.back().push_back(testing::random_values(values, rng, 1.0f));
      b.dy.back().push_back(testing::random_values(values, rng, 0.1f));
    }
  }
  return b;
}

std::vector<Results> one_rank_reference(std::size_t layer_count, std::int64_t microbatches,
                                        const TensorMeta& activation, const Batches& batches) {
  Context ctx(Device::kHost);
  MlpStack stack(ctx, layer_count);
  LayerPipeline pipeline(ctx, stack.layers(), microbatches);
  const PipelineSchedule schedule = PipelineSchedule::one_f_one_b(microbatches, 0);
  std::vector<Results> out(batches.x.size());
  for (std::size_t it = 0; it < out.size(); ++it) {
    Results& r = out[it];
    r.outputs.resize(microbatches);
    r.grad_inputs.resize(microbatches);
    for (const PipelinePass& pass : schedule.passes()) {
      const auto m = static_cast<std::size_t>(pass.microbatch);
      Tensor in = ctx.persistent("in", activation);
      if (pass.kind == PipelinePass::Kind::kForward) {
        testing::write_floats(ctx, in, batches.x[it][m]);
        r.outputs[m] = testing::read_floats(ctx, pipeline.forward(ctx, pass.microbatch, in));
      } else {
        testing::write_floats(ctx, in, batches.dy[it][m]);
        r.grad_inputs[m] = testing::read_floats(ctx, pipeline.backward(ctx, pass.microbatch, in));
      }
    }
    for (std::size_t p = 0; p < pipeline.parameters().size(); ++p) {
      r.gradient_sums[pipeline.parameters()[p]->name] = testing::read_floats(ctx, pipeline.gradient_sums()[p]);
    }
  }
  return out;
}

const char* mode_name(Mode mode) { return mode == Mode::kEager ? "eager" : "graphed"; }

}  // namespace stepgraph::pipeline_testing
