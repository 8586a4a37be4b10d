// One pipeline stage's iteration: L LayerNormMLP layers
// over M microbatches in 1F1B order, two ways on the same parameters and
// inputs:
//   graphed  GraphedLayers: one graph per layer, pass and microbatch,
//            replayed pass by pass (2 L M graph launches an iteration);
//   eager    LayerPipeline: the same layer code launched from the host.
// Median iteration time with min and max (device events around each
// iteration), the pool against the planner's lower bound and against the
// eager run's peak of transient memory, the capture time, and whether the
// last iteration's outputs and summed gradients are equal bit for bit.
//
//   pipeline_bench --hidden 1024 --tokens 2048 --layers 4 --microbatches 8 --warmup-passes 3 --out pipeline.json
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "engine/context.h"
#include "engine/device.h"
#include "engine/error.h"
#include "graphs/captured_step.h"
#include "layers/any_layer.h"
#include "train/graphed_layers.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"

namespace stepgraph {
namespace {

struct StageShape {
  std::int64_t hidden = 1024, tokens = 2048, layers = 4, microbatches = 8, warmup_passes = 3;
};

std::vector<std::unique_ptr<AnyLayerOf<LayerNormMLP>>> make_stage(Context& ctx, const StageShape& s) {
  std::vector<std::unique_ptr<AnyLayerOf<LayerNormMLP>>> out;
  for (std::int64_t i = 0; i < s.layers; ++i) {
    out.push_back(std::make_unique<AnyLayerOf<LayerNormMLP>>(
        ctx, "layer" + std::to_string(i), LayerNormMLPConfig{.hidden = s.hidden, .ffn = 4 * s.hidden},
        static_cast<std::uint32_t>(11 + i)));
  }
  return out;
}

std::vector<AnyLayer*> pointers(const std::vector<std::unique_ptr<AnyLayerOf<LayerNormMLP>>>& layers) {
  std::vector<AnyLayer*> out;
  for (const auto& layer : layers) out.push_back(layer.get());
  return out;
}

bool same_bytes(Context& ctx, const Tensor& a, const Tensor& b) {
  std::vector<std::uint8_t> x(static_cast<std::size_t>(a.bytes())), y(static_cast<std::size_t>(b.bytes()));
  ctx.copy_to_host(a, x.data(), x.size());
  ctx.copy_to_host(b, y.data(), y.size());
  return x == y;
}

nlohmann::json run(const StageShape& s, int warmup, int repeats) {
  Context ctx(Device::kCuda);
  const PipelineSchedule schedule = PipelineSchedule::one_f_one_b(s.microbatches, s.warmup_passes);
  const TensorMeta meta{Shape{s.tokens, s.hidden}, DType::kBFloat16};
  std::vector<Tensor> x, dy;
  std::mt19937 rng(5);
  for (std::int64_t m = 0; m < s.microbatches; ++m) {
    x.push_back(ctx.persistent("x" + std::to_string(m), meta));
    dy.push_back(ctx.persistent("dy" + std::to_string(m), meta));
    for (const Tensor& t : {x.back(), dy.back()}) {
      bench::DeviceBuffer random(static_cast<std::size_t>(t.bytes()));
      bench::fill_random_bf16(random, t.numel(), rng);
      cudaMemcpy(t.data(), random.get(), static_cast<std::size_t>(t.bytes()), cudaMemcpyDeviceToDevice);
    }
  }

  auto eager_layers = make_stage(ctx, s);
  LayerPipeline eager(ctx, pointers(eager_layers), s.microbatches);
  std::vector<Tensor> eager_out(static_cast<std::size_t>(s.microbatches));
  auto eager_iteration = [&] {
    for (const PipelinePass& pass : schedule.passes()) {
      const auto m = static_cast<std::size_t>(pass.microbatch);
      if (pass.kind == PipelinePass::Kind::kForward) eager_out[m] = eager.forward(ctx, pass.microbatch, x[m]);
      else (void)eager.backward(ctx, pass.microbatch, dy[m]);
    }
  };

  auto graphed_layers = make_stage(ctx, s);
  const auto start = std::chrono::steady_clock::now();
  const std::unique_ptr<GraphedLayers> graphed = GraphedLayers::capture(
      ctx, pointers(graphed_layers), std::vector<TensorMeta>(static_cast<std::size_t>(s.microbatches), meta), schedule);
  const double capture_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  auto graphed_iteration = [&] {
    for (const PipelinePass& pass : schedule.passes()) {
      const auto m = static_cast<std::size_t>(pass.microbatch);
      if (pass.kind == PipelinePass::Kind::kForward) (void)graphed->forward(pass.microbatch, x[m]);
      else (void)graphed->backward(pass.microbatch, dy[m]);
    }
  };

  cudaStream_t stream = ctx.cuda_stream(0);
  const bench::Summary graph_time = bench::time_launches(stream, warmup, repeats, graphed_iteration);
  const bench::Summary eager_time = bench::time_launches(stream, warmup, repeats, eager_iteration);
  ctx.synchronize();
  const MemoryStats memory = ctx.memory_stats();

  bool identical = true;
  for (std::int64_t m = 0; m < s.microbatches; ++m) identical &= same_bytes(ctx, graphed->output(m), eager_out[m]);
  for (std::size_t p = 0; p < eager.gradient_sums().size(); ++p) {
    identical &= same_bytes(ctx, graphed->gradient_sums()[p], eager.gradient_sums()[p]);
  }

  const StepPlan& plan = graphed->step().plan();
  // GEMM work of an iteration: fc1 and fc2, forward, dgrad and wgrad (2 flops a MAC).
  const double flops = 2.0 * 3.0 * 2.0 * static_cast<double>(s.tokens * s.microbatches) * s.hidden * 4 * s.hidden *
                       static_cast<double>(s.layers);
  std::cout << s.layers << " LayerNormMLP layers (hidden " << s.hidden << ", ffn " << 4 * s.hidden << ", bf16), "
            << s.microbatches << " microbatches of " << s.tokens << " tokens, order " << schedule.to_string() << ":\n"
            << "  graphed: median " << graph_time.median_us << " us (min " << graph_time.min_us << ", max "
            << graph_time.max_us << "), " << flops / (graph_time.median_us * 1e-6) / 1e12 << " TFLOP/s, "
            << graphed->graph_count() << " graphs captured in " << capture_ms << " ms\n"
            << "  eager:   median " << eager_time.median_us << " us (min " << eager_time.min_us << ", max "
            << eager_time.max_us << ")\n"
            << "  graphed / eager speedup " << eager_time.median_us / graph_time.median_us << "x; pool "
            << plan.pool_bytes << " bytes = " << plan.ratio_to_lower_bound() << "x its lower bound "
            << plan.lower_bound_bytes << "; eager transient peak " << memory.eager_peak_bytes << " bytes; "
            << (identical ? "outputs and gradient sums equal bit for bit" : "OUTPUTS DIFFER") << "\n";
  return {{"hidden", s.hidden},
          {"ffn", 4 * s.hidden},
          {"layers", s.layers},
          {"tokens_per_microbatch", s.tokens},
          {"microbatches", s.microbatches},
          {"order", schedule.to_string()},
          {"graphs", graphed->graph_count()},
          {"capture_ms", capture_ms},
          {"graphed", bench::to_json(graph_time)},
          {"eager", bench::to_json(eager_time)},
          {"speedup_graphed_over_eager", eager_time.median_us / graph_time.median_us},
          {"gemm_flops_per_iteration", flops},
          {"pool_bytes", plan.pool_bytes},
          {"pool_lower_bound_bytes", plan.lower_bound_bytes},
          {"pool_over_lower_bound", plan.ratio_to_lower_bound()},
          {"eager_transient_peak_bytes", memory.eager_peak_bytes},
          {"eager_equals_graph_bitwise", identical}};
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"One pipeline stage's 1F1B iteration: per-layer graphs against the eager schedule"};
  stepgraph::StageShape shape;
  int warmup = 3;
  int repeats = 20;
  std::string out;
  app.add_option("--hidden", shape.hidden, "hidden size (ffn is 4x)")->check(CLI::PositiveNumber);
  app.add_option("--tokens", shape.tokens, "tokens per microbatch")->check(CLI::PositiveNumber);
  app.add_option("--layers", shape.layers, "LayerNormMLP layers in the stage")->check(CLI::PositiveNumber);
  app.add_option("--microbatches", shape.microbatches, "microbatches per iteration")->check(CLI::PositiveNumber);
  app.add_option("--warmup-passes", shape.warmup_passes, "forwards ahead of the first backward (1F1B warmup)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", warmup, "untimed iterations first")->check(CLI::NonNegativeNumber);
  app.add_option("--repeats", repeats, "timed iterations")->check(CLI::PositiveNumber);
  app.add_option("--out", out, "JSON result file");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("pipeline_bench", [&] {
    const stepgraph::DeviceProperties device = stepgraph::device_properties(0);
    std::cout << "device: " << stepgraph::describe(device) << "\n";
    nlohmann::json result = stepgraph::run(shape, warmup, repeats);
    stepgraph::bench::write_json(out, {{"benchmark", "pipeline"},
                                       {"device", device.name},
                                       {"warmup", warmup},
                                       {"repeats", repeats},
                                       {"result", result}});
    return result["eager_equals_graph_bitwise"].get<bool>() ? EXIT_SUCCESS : EXIT_FAILURE;
  });
}
