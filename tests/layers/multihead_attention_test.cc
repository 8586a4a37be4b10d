// MultiheadAttention (LayerNorm + QKV, rotary embedding, causal attention over
// packed sequences, output projection): gradients against finite
// differences, packed sequences against the same sequences one by one, and a
// captured fwd+bwd step replayed with a different packing every replay
// against eager, bit for bit (host, and 100 replays on the GPU).
#include "layers/multihead_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "graphs/captured_step.h"
#include "tests/layers/gradient_check.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::GradientCheck;
using testing::read_floats;
using testing::write_floats;
using testing::write_values;

MultiheadAttentionConfig small_config(DType dtype) {
  return {.hidden = 16, .heads = 4, .kv_heads = 2, .dtype = dtype};
}

Tensor packing(Context& ctx, const std::vector<std::int32_t>& cu) {
  const Tensor t = ctx.persistent("cu_seqlens", {Shape{static_cast<std::int64_t>(cu.size())}, DType::kInt32});
  write_values(ctx, t, cu);
  return t;
}

TEST(MultiheadAttentionHostTest, GradientsMatchFiniteDifferencesFp32) {
  Context ctx(Device::kHost);
  GradientCheck check(ctx);
  MultiheadAttention layer(ctx, "attn", small_config(DType::kFloat32), 11);
  // Non-trivial norm parameters so their gradients are exercised.
  for (Parameter* p : layer.parameters()) {
    if (p->master.shape().rank() == 1) {
      const std::vector<float> values = check.random_values(p->master.numel());
      ctx.copy_from_host(p->master, values.data(), values.size() * sizeof(float));
    }
  }
  constexpr std::int64_t kTokens = 7, kHidden = 16;
  const Tensor cu = packing(ctx, {0, 3, 7});
  const Tensor x = check.random_tensor("x", Shape{kTokens, kHidden});
  const std::vector<float> r = check.random_values(kTokens * kHidden);
  const Tensor dy = ctx.persistent("dy", {Shape{kTokens, kHidden}, DType::kFloat32});
  write_values(ctx, dy, r);
  auto forward = [&] { return layer.forward(ctx, {x, cu}).y; };
  const MultiheadAttention::Forward f = layer.forward(ctx, {x, cu});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  check.expect_matches("dx", x, read_floats(ctx, dx), forward, r, {}, 1e-3f);
  for (Parameter* p : layer.parameters()) {
    check.expect_matches(p->name, p->master, read_floats(ctx, p->grad), forward, r, {}, 1e-3f);
  }
}

// Three sequences packed (one of them empty) give each sequence's rows as the
// sequence alone does, forward and backward: no token sees another sequence.
TEST(MultiheadAttentionHostTest, PackedSequencesEqualTheSequencesOneByOne) {
  testing::SeededRng rng;
  Context ctx(Device::kHost);
  MultiheadAttention layer(ctx, "attn", small_config(DType::kFloat32), 5);
  constexpr std::int64_t kHidden = 16;
  const std::vector<std::int32_t> cu{0, 5, 5, 12};
  const std::vector<float> xs = testing::uniform_values(12 * kHidden, rng, -1.0f, 1.0f);
  const std::vector<float> dys = testing::uniform_values(12 * kHidden, rng, -1.0f, 1.0f);
  auto run = [&](std::int64_t first, std::int64_t tokens, const std::vector<std::int32_t>& pack) {
    const Tensor x = ctx.persistent("x", {Shape{tokens, kHidden}, DType::kFloat32});
    const Tensor dy = ctx.persistent("dy", {Shape{tokens, kHidden}, DType::kFloat32});
    write_floats(ctx, x, {xs.begin() + first * kHidden, xs.begin() + (first + tokens) * kHidden});
    write_floats(ctx, dy, {dys.begin() + first * kHidden, dys.begin() + (first + tokens) * kHidden});
    const MultiheadAttention::Forward f = layer.forward(ctx, {x, packing(ctx, pack)});
    std::vector<float> y = read_floats(ctx, f.y);
    const std::vector<float> dx = read_floats(ctx, layer.backward(ctx, f.saved, {dy}));
    y.insert(y.end(), dx.begin(), dx.end());
    return y;  // y, then dx
  };
  const std::vector<float> packed = run(0, 12, cu);
  for (const auto& [first, tokens] : {std::pair<std::int64_t, std::int64_t>{0, 5}, {5, 7}}) {
    const std::vector<float> alone = run(first, tokens, {0, static_cast<std::int32_t>(tokens)});
    for (std::int64_t i = 0; i < tokens * kHidden; ++i) {
      ASSERT_NEAR(alone[i], packed[first * kHidden + i], 1e-5) << "y of sequence at " << first << ", element " << i;
      ASSERT_NEAR(alone[tokens * kHidden + i], packed[(12 + first) * kHidden + i], 1e-5)
          << "dx of sequence at " << first << ", element " << i;
    }
  }
}

// A random packing of `tokens` into `sequences` (empty sequences allowed).
std::vector<std::int32_t> random_packing(std::mt19937& rng, std::int32_t tokens, int sequences) {
  std::uniform_int_distribution<std::int32_t> cut(0, tokens);
  std::vector<std::int32_t> cu{0};
  std::vector<std::int32_t> cuts;
  for (int s = 1; s < sequences; ++s) cuts.push_back(cut(rng));
  std::sort(cuts.begin(), cuts.end());
  cu.insert(cu.end(), cuts.begin(), cuts.end());
  cu.push_back(tokens);
  return cu;
}

// One fwd+bwd step captured once; every replay gets new inputs and a new
// packing of the same tokens, written into the bound cu_seqlens; the eager
// step on the same inputs gives the same bits.
void expect_graph_equals_eager(Device device, DType dtype, const MultiheadAttentionConfig& config,
                               std::int64_t tokens, int sequences, int replays) {
  Context ctx(device);
  MultiheadAttention layer(ctx, "attn", config, 3);
  const Tensor x = ctx.persistent("x", {Shape{tokens, config.hidden}, dtype});
  const Tensor dy = ctx.persistent("dy", {Shape{tokens, config.hidden}, dtype});
  const Tensor cu = ctx.persistent("cu_seqlens", {Shape{sequences + 1}, DType::kInt32});
  auto step = [&] {
    const MultiheadAttention::Forward f = layer.forward(ctx, {x, cu});
    return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
  };
  testing::SeededRng rng;
  write_values(ctx, cu, random_packing(rng, static_cast<std::int32_t>(tokens), sequences));
  auto captured = CapturedStep::capture(ctx, step, {.pool_report_policy = PoolReportPolicy::kError});
  auto bytes_of = [&](const Tensor& t) { return testing::raw_bytes(ctx, t); };
  auto grads = [&] { return testing::grad_bytes(ctx, layer); };
  for (int replay = 0; replay < replays; ++replay) {
    const std::vector<float> xs = testing::uniform_values(tokens * config.hidden, rng, -2.0f, 2.0f);
    const std::vector<float> dys = testing::uniform_values(tokens * config.hidden, rng, -2.0f, 2.0f);
    write_floats(ctx, x, xs);
    write_floats(ctx, dy, dys);
    write_values(ctx, cu, random_packing(rng, static_cast<std::int32_t>(tokens), sequences));
    const std::vector<Tensor> eager = step();
    const std::vector<std::vector<std::uint8_t>> eager_grads = grads();
    captured->replay();
    const std::vector<Tensor>& graph = captured->outputs();
    ASSERT_EQ(bytes_of(eager[0]), bytes_of(graph[0])) << "y differs at replay " << replay;
    ASSERT_EQ(bytes_of(eager[1]), bytes_of(graph[1])) << "dx differs at replay " << replay;
    ASSERT_EQ(eager_grads, grads()) << "parameter gradients differ at replay " << replay;
  }
}

TEST(MultiheadAttentionHostTest, GraphedStepEqualsEagerAcrossPackings) {
  expect_graph_equals_eager(Device::kHost, DType::kFloat32, small_config(DType::kFloat32), 13, 3, 4);
}

TEST(MultiheadAttentionGpuTest, GraphedStepEqualsEagerAcross100PackingsBf16) {
  SG_SKIP_WITHOUT_GPU();
  const MultiheadAttentionConfig config{.hidden = 256, .heads = 4, .kv_heads = 2, .dtype = DType::kBFloat16};
  expect_graph_equals_eager(Device::kCuda, DType::kBFloat16, config, 509, 4, 100);
}

TEST(MultiheadAttentionGpuTest, GraphedStepEqualsEagerFp32PlainKernels) {
  SG_SKIP_WITHOUT_GPU();
  const MultiheadAttentionConfig config{.hidden = 96, .heads = 3, .dtype = DType::kFloat32};  // head_dim 32
  expect_graph_equals_eager(Device::kCuda, DType::kFloat32, config, 77, 3, 10);
}

TEST(MultiheadAttentionHostTest, BadConfigsAndInputsAreErrors) {
  Context ctx(Device::kHost);
  EXPECT_ERROR_CONTAINS(MultiheadAttention(ctx, "a", {.hidden = 10, .heads = 4}, 1),
                        "MultiheadAttention 'a': hidden (10) must be a multiple of heads (4)");
  EXPECT_ERROR_CONTAINS(MultiheadAttention(ctx, "b", {.hidden = 16, .heads = 4, .kv_heads = 3}, 1),
                        "MultiheadAttention 'b': kv_heads (3) must divide heads (4)");
  MultiheadAttention layer(ctx, "c", small_config(DType::kFloat32), 1);
  const Tensor x = ctx.persistent("x", {Shape{4, 16}, DType::kFloat32});
  const Tensor cu64 = ctx.persistent("cu", {Shape{2}, DType::kInt64});
  EXPECT_ERROR_CONTAINS(layer.forward(ctx, {x, cu64}), "cu_seqlens must be [sequences + 1] int32");
}

}  // namespace
}  // namespace stepgraph
