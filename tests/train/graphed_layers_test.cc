// Per-layer graphs for pipeline schedules: a list of
// layers captured as one graph per layer, pass and microbatch in a 1F1B
// order, sharing one pool plan, equals the same schedule run eagerly bit
// for bit (outputs, input gradients, gradients summed over microbatches),
// over several iterations from one capture, with a pool within 1.10x of its
// lower bound. On the host and on the GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "layers/any_layer.h"
#include "train/graphed_layers.h"
#include "train/layer_pipeline.h"
#include "train/pipeline_schedule.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::read_floats;
using testing::write_floats;

// A pipeline stage of three layers of different kinds: norm -> linear, an
// MLP, a linear; bf16 with fp32 gradients. The same seeds give the same weights.
struct Stage {
  static constexpr std::int64_t kHidden = 64;
  Stage(Context& ctx)
      : qkv(ctx, "stage.proj", LayerNormLinearConfig{.linear = {.in_features = kHidden, .out_features = kHidden}}, 3),
        mlp(ctx, "stage.mlp", LayerNormMLPConfig{.hidden = kHidden, .ffn = 2 * kHidden}, 5),
        out(ctx, "stage.out", LinearConfig{.in_features = kHidden, .out_features = kHidden}, 7) {}
  std::vector<AnyLayer*> layers() { return {&qkv, &mlp, &out}; }

  AnyLayerOf<LayerNormLinear> qkv;
  AnyLayerOf<LayerNormMLP> mlp;
  AnyLayerOf<Linear> out;
};

void expect_graphed_schedule_equals_eager(Device device) {
  testing::SeededRng rng;
  Context ctx(device);
  const std::vector<std::int64_t> tokens = {32, 48, 32, 64};  // microbatches may differ in shape
  const PipelineSchedule schedule = PipelineSchedule::one_f_one_b(4, 2);
  ASSERT_EQ(schedule.to_string(), "F0 F1 F2 B0 F3 B1 B2 B3");

  Stage eager_stage(ctx);
  LayerPipeline eager(ctx, eager_stage.layers(), 4);
  Stage graphed_stage(ctx);
  std::vector<TensorMeta> metas;
  for (std::int64_t t : tokens) metas.push_back({Shape{t, Stage::kHidden}, DType::kBFloat16});
  const std::unique_ptr<GraphedLayers> graphed = GraphedLayers::capture(ctx, graphed_stage.layers(), metas, schedule);

  ASSERT_EQ(graphed->graph_count(), schedule.passes().size() * 3);
  const StepPlan& plan = graphed->step().plan();
  EXPECT_LE(plan.ratio_to_lower_bound(), 1.10) << plan.pool_bytes << " bytes against a lower bound of "
                                               << plan.lower_bound_bytes;
  EXPECT_EQ(graphed->next_graph(), "F0 layer 0 (layernorm_linear)");
  const std::int64_t recordings = CapturedStep::total_recordings();

  for (int iteration = 0; iteration < 3; ++iteration) {
    SCOPED_TRACE("iteration " + std::to_string(iteration));
    std::vector<Tensor> x, dy;
    for (std::size_t m = 0; m < tokens.size(); ++m) {
      x.push_back(ctx.persistent("x" + std::to_string(m), metas[m]));
      dy.push_back(ctx.persistent("dy" + std::to_string(m), metas[m]));
      write_floats(ctx, x[m], testing::random_values(x[m].numel(), rng, 1.0f));
      write_floats(ctx, dy[m], testing::random_values(dy[m].numel(), rng, 0.1f));
    }
    for (const PipelinePass& pass : schedule.passes()) {
      const std::int64_t m = pass.microbatch;
      const auto i = static_cast<std::size_t>(m);
      SCOPED_TRACE(pass.to_string());
      if (pass.kind == PipelinePass::Kind::kForward) {
        const Tensor want = eager.forward(ctx, m, x[i]);
        const Tensor& got = graphed->forward(m, x[i]);
        EXPECT_EQ(testing::bits(read_floats(ctx, got)), testing::bits(read_floats(ctx, want)));
      } else {
        const Tensor want = eager.backward(ctx, m, dy[i]);
        const Tensor& got = graphed->backward(m, dy[i]);
        EXPECT_EQ(testing::bits(read_floats(ctx, got)), testing::bits(read_floats(ctx, want)));
      }
    }
    const auto& want_sums = eager.gradient_sums();
    const auto& got_sums = graphed->gradient_sums();
    ASSERT_EQ(got_sums.size(), want_sums.size());
    for (std::size_t p = 0; p < want_sums.size(); ++p) {
      EXPECT_EQ(testing::bits(read_floats(ctx, got_sums[p])), testing::bits(read_floats(ctx, want_sums[p])))
          << want_sums[p].name();
    }
  }
  EXPECT_EQ(CapturedStep::total_recordings(), recordings) << "a replay recorded a graph again";
  EXPECT_EQ(graphed->next_graph(), "F0 layer 0 (layernorm_linear)");
}

TEST(GraphedLayersTest, OneFOneBEqualsEagerBitwiseOnHost) { expect_graphed_schedule_equals_eager(Device::kHost); }

TEST(GraphedLayersTest, OneFOneBEqualsEagerBitwiseOnGpu) {
  SG_SKIP_WITHOUT_GPU();
  expect_graphed_schedule_equals_eager(Device::kCuda);
}

// The sums are the per-microbatch gradients added in the schedule's order
// of backwards, not the last backward's gradient.
TEST(GraphedLayersTest, GradientsAreSummedOverMicrobatches) {
  testing::SeededRng rng;
  Context ctx(Device::kHost);
  AnyLayerOf<Linear> layer(ctx, "lin", LinearConfig{.in_features = 16, .out_features = 8, .dtype = DType::kFloat32},
                           3);
  LayerPipeline pipeline(ctx, {&layer}, 3);
  const TensorMeta x_meta{Shape{4, 16}, DType::kFloat32};
  const TensorMeta dy_meta{Shape{4, 8}, DType::kFloat32};
  std::vector<std::vector<float>> want(2);  // weight, bias
  const PipelineSchedule schedule = PipelineSchedule::one_f_one_b(3, 1);
  for (const PipelinePass& pass : schedule.passes()) {
    const std::int64_t m = pass.microbatch;
    if (pass.kind == PipelinePass::Kind::kForward) {
      Tensor x = ctx.persistent("x", x_meta);
      write_floats(ctx, x, testing::random_values(x.numel(), rng, 1.0f));
      (void)pipeline.forward(ctx, m, x);
      continue;
    }
    Tensor dy = ctx.persistent("dy", dy_meta);
    write_floats(ctx, dy, testing::random_values(dy.numel(), rng, 1.0f));
    (void)pipeline.backward(ctx, m, dy);
    for (std::size_t p = 0; p < 2; ++p) {
      const std::vector<float> grad = read_floats(ctx, pipeline.parameters()[p]->grad);
      if (want[p].empty()) want[p] = grad;
      else
        for (std::size_t i = 0; i < grad.size(); ++i) want[p][i] += grad[i];
    }
  }
  for (std::size_t p = 0; p < 2; ++p) {
    EXPECT_EQ(testing::bits(read_floats(ctx, pipeline.gradient_sums()[p])), testing::bits(want[p]))
        << "parameter " << p;
    EXPECT_NE(testing::bits(want[p]), testing::bits(read_floats(ctx, pipeline.parameters()[p]->grad)));
  }
}

TEST(GraphedLayersTest, ReplaysOutOfTheCapturedOrderAreErrors) {
  Context ctx(Device::kHost);
  AnyLayerOf<Linear> first(ctx, "a", LinearConfig{.in_features = 16, .out_features = 16, .dtype = DType::kFloat32}, 1);
  AnyLayerOf<Linear> second(ctx, "b", LinearConfig{.in_features = 16, .out_features = 16, .dtype = DType::kFloat32},
                            2);
  const TensorMeta meta{Shape{8, 16}, DType::kFloat32};
  auto graphed = GraphedLayers::capture(ctx, {&first, &second}, {meta, meta}, PipelineSchedule::one_f_one_b(2, 0));
  EXPECT_ERROR_CONTAINS(graphed->backward(0), "'B0 layer 1 (linear)' is not the schedule's next graph",
                        "'F0 layer 0 (linear)'");
  EXPECT_ERROR_CONTAINS(graphed->replay_layer({PipelinePass::Kind::kForward, 0}, 1), "next graph");
  graphed->replay_layer({PipelinePass::Kind::kForward, 0}, 0);
  EXPECT_ERROR_CONTAINS(graphed->replay_layer({PipelinePass::Kind::kForward, 0}, 1, graphed->input(0)),
                        "takes no source");
  graphed->replay_layer({PipelinePass::Kind::kForward, 0}, 1);
  EXPECT_EQ(graphed->next_graph(), "B0 layer 1 (linear)");
  EXPECT_ERROR_CONTAINS(graphed->forward(5), "no pass F5");
  EXPECT_ERROR_CONTAINS(GraphedLayers::capture(ctx, {&first}, {meta}, PipelineSchedule::one_f_one_b(2, 0)),
                        "1 input shape(s)", "2 microbatch(es)");
  EXPECT_ERROR_CONTAINS(LayerPipeline(ctx, {&first, &first}, 2), "layers 0 and 1 are the same");
}

TEST(PipelineScheduleTest, OneFOneBAndTheSignedForm) {
  EXPECT_EQ(PipelineSchedule::one_f_one_b(4, 1).to_string(), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(PipelineSchedule::one_f_one_b(3, 0).to_string(), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(PipelineSchedule::one_f_one_b(2, 7).to_string(), "F0 F1 B0 B1");  // warmup clamped
  EXPECT_EQ(PipelineSchedule::all_forward_all_backward(2).to_string(), "F0 F1 B0 B1");
  EXPECT_EQ(PipelineSchedule::from_signed({1, 2, -1, 3, -2, 4, -3, -4}).passes(),
            PipelineSchedule::one_f_one_b(4, 1).passes());
  EXPECT_ERROR_CONTAINS(PipelineSchedule::from_signed({-1, 1}), "backward before its forward");
  EXPECT_ERROR_CONTAINS(PipelineSchedule::from_signed({1, 1}), "forward a second time");
  EXPECT_ERROR_CONTAINS(PipelineSchedule::from_signed({1, 0}), "entry 1 is 0");
  EXPECT_ERROR_CONTAINS(PipelineSchedule::from_signed({1, -1, 2}), "3 passes");
  EXPECT_ERROR_CONTAINS(PipelineSchedule::from_signed({1, 3, -1, -3}), "microbatch 2, outside [0, 2)");
  EXPECT_ERROR_CONTAINS(PipelineSchedule::one_f_one_b(0, 0), "microbatches must be positive");
}

}  // namespace
}  // namespace stepgraph
