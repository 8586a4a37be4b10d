// Tensor and sequence parallelism of LayerNormMLP (Note [Sequence-parallel
// LayerNormMLP]) on host thread worlds of 2 and 4 ranks, against one rank:
// each rank's output and input-gradient rows, its weight-gradient slices and
// the replicated gradients equal the one-rank layer's.
//
// Tolerance: the ranks' fc2 partial products (and fc1's data gradients) are
// summed by the reduce-scatter after their own GEMMs, where one rank sums the
// whole ffn in one GEMM: the same terms in another fp32 order, about 1e-7
// relative. We allow 1e-5 of the largest reference value; a missing or
// doubled bias, a wrong slice or a missing reduction is off by 1e-2 or more.
// Eager equals graph bit for bit on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/layernorm_mlp.h"
#include "tests/support/gpu.h"
#include "tests/layers/one_rank_parity.h"
#include "tests/layers/shard_values.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::normal_values;
using testing::rows;
using testing::columns;
using testing::expect_close;

constexpr std::int64_t kTokens = 16;
constexpr std::int64_t kHidden = 8;
constexpr std::int64_t kFfn = 32;
constexpr std::uint32_t kSeed = 21;

LayerNormMLPConfig config() { return {.hidden = kHidden, .ffn = kFfn, .dtype = DType::kFloat32}; }

// What one forward and backward gives: y, dx and every parameter's gradient.
struct Result {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;  // norm gamma, beta, fc1 weight, bias, fc2 weight, bias
};

Result run(Context& ctx, LayerNormMLP& layer, const Tensor& x, const Tensor& dy) {
  const LayerNormMLP::Forward f = layer.forward(ctx, {x});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  Result r{ctx.to_vector<float>(f.y), ctx.to_vector<float>(dx), {}};
  for (const Parameter* p : layer.parameters()) r.grads.push_back(ctx.to_vector<float>(p->grad));
  return r;
}

Tensor tensor_of(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t rows_) {
  const Tensor t = ctx.persistent(name, {Shape{rows_, kHidden}, DType::kFloat32});
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

class TensorParallelTest : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelTest, EveryRankMatchesOneRankAndItsGraphEqualsEager) {
  const int n = GetParam();
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  const std::vector<float> dy_all = normal_values(seed.value() + 1, kTokens * kHidden);
  Result reference;
  {
    Context ctx(Device::kHost);
    LayerNormMLP layer(ctx, "mlp", config(), kSeed);
    reference = run(ctx, layer, tensor_of(ctx, "x", x_all, kTokens), tensor_of(ctx, "dy", dy_all, kTokens));
  }
  const std::int64_t t = kTokens / n;
  const std::int64_t f = kFfn / n;
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LayerNormMLP eager(ctx, "mlp", config(), kSeed, &comm);
    LayerNormMLP graphed(ctx, "mlp", config(), kSeed, &comm);
    const Tensor x = tensor_of(ctx, "x", rows(x_all, kHidden, r * t, t), t);
    const Tensor dy = tensor_of(ctx, "dy", rows(dy_all, kHidden, r * t, t), t);
    const Result got = run(ctx, eager, x, dy);
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
    expect_close(got.y, rows(reference.y, kHidden, r * t, t), who + " y");
    expect_close(got.dx, rows(reference.dx, kHidden, r * t, t), who + " dx");
    expect_close(got.grads[0], reference.grads[0], who + " gamma grad (all-reduced)");
    expect_close(got.grads[1], reference.grads[1], who + " beta grad (all-reduced)");
    expect_close(got.grads[2], rows(reference.grads[2], kHidden, r * f, f), who + " fc1 weight grad rows");
    expect_close(got.grads[3], rows(reference.grads[3], 1, r * f, f), who + " fc1 bias grad slice");
    expect_close(got.grads[4], columns(reference.grads[4], kHidden, kFfn, r * f, f), who + " fc2 weight grad columns");
    expect_close(got.grads[5], reference.grads[5], who + " fc2 bias grad");

    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const LayerNormMLP::Forward fw = graphed.forward(ctx, {x});
                                         const Tensor dx = graphed.backward(ctx, fw.saved, {dy});
                                         return std::vector<Tensor>{fw.y, dx};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    graph->replay();
    EXPECT_EQ(ctx.to_vector<float>(graph->outputs()[0]), got.y) << who;
    EXPECT_EQ(ctx.to_vector<float>(graph->outputs()[1]), got.dx) << who;
    const std::vector<Parameter*> params = graphed.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(ctx.to_vector<float>(params[i]->grad), got.grads[i]) << who << " gradient " << params[i]->name;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelTest, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// TransformerEngine once left the column-parallel layer's grad_output alive in
// the graph pool ("N tensor(s) in the cudagraph pool not tracked as
// outputs"). Here a TP+SP step's pool report is empty, and a reference the
// caller holds to the gathered gradient is reported with its name and the op
// that made it.
TEST(TensorParallelPoolReportTest, TheStepLeavesNothingAndAHeldGatheredGradientIsNamed) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LayerNormMLP layer(ctx, "mlp", config(), kSeed, &comm);
    const Tensor x = ctx.persistent("x", {Shape{kTokens / 2, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{kTokens / 2, kHidden}, DType::kFloat32});
    auto clean = CapturedStep::capture(ctx,
                                       [&] {
                                         const LayerNormMLP::Forward f = layer.forward(ctx, {x});
                                         return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    EXPECT_TRUE(clean->report().empty()) << clean->report().to_string();

    Tensor held;  // a handle the caller keeps: the all-gathered input of fc1, made by all_gather
    auto leaky = CapturedStep::capture(ctx,
                                       [&] {
                                         const LayerNormMLP::Forward f = layer.forward(ctx, {x});
                                         held = f.saved.fc1.x;
                                         held.set_name("mlp.fc1_input_gathered");
                                         return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kWarn, .communicators = {&comm}});
    ASSERT_EQ(leaky->report().entries.size(), 1u) << leaky->report().to_string();
    const std::string text = leaky->report().to_string();
    EXPECT_NE(text.find("'mlp.fc1_input_gathered' [16, 8] fp32"), std::string::npos) << text;
    EXPECT_NE(text.find("made by all_gather"), std::string::npos) << text;
  });
}

// On the GPU, one rank through real NCCL: the layer's all-gathers,
// reduce-scatters and norm-gradient all-reduce are identities, captured into
// the graph; replayed, the bf16 layer equals the plain layer bit for bit.
TEST(TensorParallelCudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainLayer) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const LayerNormMLPConfig bf16{.hidden = 256, .ffn = 1024, .dtype = DType::kBFloat16};
  LayerNormMLP parallel(ctx, "mlp", bf16, kSeed, comm.get());
  LayerNormMLP plain(ctx, "mlp", bf16, kSeed);
  const TensorMeta meta{Shape{128, 256}, DType::kBFloat16};
  const Tensor x = ctx.persistent("x", meta);
  const Tensor dy = ctx.persistent("dy", meta);
  std::vector<std::uint16_t> values(static_cast<std::size_t>(meta.numel()));
  const std::vector<float> normal = normal_values(7, meta.numel());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = float_to_bf16(normal[i]);
  ctx.copy_from_host(x, values.data(), values.size() * 2);
  ctx.copy_from_host(dy, values.data(), values.size() * 2);
  testing::OneRankParity steps(ctx, *comm, parallel, plain, x, dy);
  for (int i = 0; i < 100; ++i) steps.replay();
  steps.expect_equal();
  comm->check_health();
}

TEST(TensorParallelErrorsTest, FfnMustDivideByTheRanks) {
  EXPECT_THROW(HostWorld::run(3,
                              [](Communicator& comm) {
                                Context ctx(Device::kHost);
                                LayerNormMLP layer(ctx, "mlp", config(), kSeed, &comm);
                              }),
               Error);
}

}  // namespace
}  // namespace stepgraph
