// A test step of 24 ops on two streams, written once and run eager, traced,
// captured and replayed on cuda or host. It reads a step input `x`, two
// parameters, and updates a persistent accumulator in place (as an optimizer
// would), so successive steps differ.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "engine/context.h"
#include "ops/elementwise_ops.h"

namespace stepgraph::testing {

struct TwoStreamState {
  Tensor x;   // step input
  Tensor w1;  // parameters
  Tensor w2;
  Tensor acc;  // updated in place every step
};

inline TensorMeta f32(std::int64_t rows, std::int64_t cols) { return {Shape{rows, cols}, DType::kFloat32}; }

// Values in [-1, 1] from `seed`.
inline std::vector<float> random_values(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = uniform(rng);
  return out;
}

inline TwoStreamState make_two_stream_state(Context& ctx, const TensorMeta& meta, std::uint32_t seed,
                                            const char* prefix) {
  auto make = [&](const char* name, std::uint32_t offset) {
    Tensor t = ctx.persistent(std::string(prefix) + name, meta);
    const std::vector<float> values = random_values(meta.numel(), seed + offset);
    ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
    return t;
  };
  return {make("x", 0), make("w1", 1), make("w2", 2), make("acc", 3)};
}

// Returns {loss (scalar), y (like x)}.
inline std::vector<Tensor> two_stream_step(Context& ctx, const TwoStreamState& s) {
  using namespace ops;  // NOLINT(google-build-using-namespace): test brevity
  Tensor a = mul(ctx, s.x, s.w1).set_name("a");
  Tensor b = add(ctx, a, s.w2).set_name("b");
  Tensor side_out;
  {
    StreamScope side(ctx, 1);  // overlaps with the main stream's work below
    Tensor c = axpy(ctx, s.x, s.w2, 0.5f).set_name("c");
    Tensor d = mul(ctx, c, c).set_name("d");
    Tensor e = add(ctx, d, s.w1).set_name("e");
    Tensor f = axpy(ctx, e, c, -0.25f).set_name("f");
    side_out = mul(ctx, f, s.x).set_name("side_out");
  }
  Tensor g = mul(ctx, b, b).set_name("g");
  Tensor h = axpy(ctx, g, a, 2.0f).set_name("h");
  Tensor i = add(ctx, h, side_out).set_name("i");  // joins the side stream's result
  Tensor j = copy(ctx, i).set_name("j");
  Tensor k = fill(ctx, s.x.meta(), 0.125f).set_name("k");
  Tensor l = mul(ctx, j, k).set_name("l");
  Tensor m = add(ctx, l, s.acc).set_name("m");
  {
    StreamScope side(ctx, 1);
    Tensor n = mul(ctx, m, s.w2).set_name("n");
    Tensor o = axpy(ctx, n, s.w1, 1.5f).set_name("o");
    axpy_(ctx, s.acc, o, 0.01f);  // in place on the side stream
  }
  Tensor p = add(ctx, m, b).set_name("p");
  Tensor q = mul(ctx, p, a).set_name("q");
  Tensor y = axpy(ctx, q, j, -1.0f).set_name("y");
  Tensor r = mul(ctx, y, y).set_name("r");
  Tensor loss = sum(ctx, r).set_name("loss");
  Tensor side_sum = sum(ctx, side_out).set_name("side_sum");
  Tensor total = add(ctx, loss, side_sum).set_name("total");
  return {total, y};
}

}  // namespace stepgraph::testing
