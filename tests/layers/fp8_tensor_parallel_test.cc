// FP8 tensor parallelism (Note [FP8 Linear], Note [FP8 LayerNormMLP]):
// column- and row-parallel FP8 Linears, with and without sequence
// parallelism, and the sequence-parallel FP8 LayerNormMLP, on host thread
// worlds of 2 and 4 ranks against one rank's FP8 layer of the same recipe on
// the same global input, over two steps (the second quantizes with the scales
// delayed scaling kept from the first).
//
// What must be equal, and why: a sliced tensor's amax is max-all-reduced
// over the ranks, so every rank quantizes its slice with the scale one rank
// gives the whole tensor (block scales are local to their blocks anyway) and
// its FP8 bytes are the one-rank bytes of that slice. Every output that is
// the same dot products over the same bytes therefore equals the one-rank
// value bit for bit: a column layer's y, a row layer's dx, every weight and
// bias gradient, and delayed scaling's histories and scales. A tensor summed
// across ranks (a row layer's y, a column layer's dx, the norm's gamma and
// beta gradients) adds the ranks' partial results after rounding each to
// bf16, where one rank rounds once: within 2e-2 of the largest reference
// value (N partials, each off by half a bf16 ulp, 2^-9, of values that can
// exceed the sum). A slice quantized with its own amax instead is off by up
// to an E4M3 step, 6%, and fails the exact checks.
//
// The captured step, replayed, equals each rank's eager twin bit for bit,
// with the pool report set to fail on any tensor left in the pool. On the
// GPU, the FP8 LayerNormMLP on one NCCL rank (its collectives identities
// captured into the graph) equals the plain FP8 layer over 100 replays.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "engine/fp8_recipe.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "tests/layers/one_rank_parity.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::by_columns;
using testing::by_rows;
using testing::read_floats;
using testing::Slice;
using testing::whole;
using testing::write_floats;

// One forward and backward: y and dx, with the gradients and FP8 state written.
class Subject {
 public:
  virtual ~Subject() = default;
  virtual std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const = 0;
  virtual std::vector<Parameter*> parameters() = 0;
  virtual std::vector<StateTensor> state() = 0;
};

class OneLinear : public Subject {
 public:
  OneLinear(Context& ctx, const LinearConfig& config, Communicator* comm) : fc_(ctx, "fc", config, 21, comm) {}
  std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const override {
    const Linear::Forward f = fc_.forward(ctx, {x});
    return {f.y, fc_.backward(ctx, f.saved, {dy})};
  }
  std::vector<Parameter*> parameters() override { return fc_.parameters(); }
  std::vector<StateTensor> state() override { return fc_.state(); }

 private:
  Linear fc_;
};

class Mlp : public Subject {
 public:
  Mlp(Context& ctx, const LayerNormMLPConfig& config, Communicator* comm) : mlp_(ctx, "mlp", config, 23, comm) {}
  std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const override {
    const LayerNormMLP::Forward f = mlp_.forward(ctx, {x});
    return {f.y, mlp_.backward(ctx, f.saved, {dy})};
  }
  std::vector<Parameter*> parameters() override { return mlp_.parameters(); }
  std::vector<StateTensor> state() override { return state_of(mlp_.fp8_linears()); }

 private:
  LayerNormMLP mlp_;
};

struct Case {
  std::string name;
  Fp8Recipe recipe;
  int ranks;
  std::function<std::unique_ptr<Subject>(Context&, Communicator*)> make;
  Slice x, y;                // dx is sliced like x, dy like y
  Slice dx;                  // x's slicing, summed or not
  std::vector<Slice> grads;  // in parameters() order
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> cases() {
  using M = TensorParallelMode;
  std::vector<Case> out;
  auto add_for = [&](const Fp8Recipe& recipe, const std::string& recipe_name, int n) {
    const bool blocks = recipe.scaling == Fp8Scaling::kBlock;
    const std::int64_t t = blocks ? 256 : 32, in = blocks ? 256 : 64, o = in, ffn = 2 * in;
    auto linear = [recipe, in, o](M mode, bool sp) {
      return [=](Context& ctx, Communicator* comm) -> std::unique_ptr<Subject> {
        return std::make_unique<OneLinear>(ctx,
                                           LinearConfig{.in_features = in,
                                                        .out_features = o,
                                                        .tensor_parallel = comm != nullptr ? mode : M::kNone,
                                                        .sequence_parallel = comm != nullptr && sp,
                                                        .fp8 = recipe},
                                           comm);
      };
    };
    auto mlp = [recipe, in, ffn](Context& ctx, Communicator* comm) -> std::unique_ptr<Subject> {
      return std::make_unique<Mlp>(ctx, LayerNormMLPConfig{.hidden = in, .ffn = ffn, .fp8 = recipe}, comm);
    };
    const std::string suffix = "_" + recipe_name + "_tp" + std::to_string(n);
    const std::vector<Slice> column_grads{by_rows(o, in), by_rows(o, 1)};
    const std::vector<Slice> row_grads{by_columns(o, in), whole(o, 1)};
    const Slice x_whole = whole(t, in), x_rows = by_rows(t, in), x_cols = by_columns(t, in);
    out.push_back({"column" + suffix, recipe, n, linear(M::kColumn, false), x_whole, by_columns(t, o), x_whole.sum(),
                   column_grads});
    out.push_back({"column_sp" + suffix, recipe, n, linear(M::kColumn, true), x_rows, by_columns(t, o), x_rows.sum(),
                   column_grads});
    out.push_back({"row" + suffix, recipe, n, linear(M::kRow, false), x_cols, whole(t, o).sum(), x_cols, row_grads});
    out.push_back({"row_sp" + suffix, recipe, n, linear(M::kRow, true), x_cols, by_rows(t, o).sum(), x_cols,
                   row_grads});
    out.push_back({"layernorm_mlp" + suffix, recipe, n, mlp, x_rows, by_rows(t, in).sum(), x_rows.sum(),
                   {whole(in, 1).sum(), whole(in, 1).sum(), by_rows(ffn, in), by_rows(ffn, 1), by_columns(in, ffn),
                    whole(in, 1)}});
  };
  add_for(Fp8Recipe::current(), "current", 2);
  add_for(Fp8Recipe::current(), "current", 4);
  add_for(Fp8Recipe::delayed(4), "delayed", 2);
  add_for(Fp8Recipe::delayed(4), "delayed", 4);
  add_for(Fp8Recipe::block(), "block", 2);
  return out;
}

struct Result {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<float>> state;  // fp32 histories and scales
};

Result read(Context& ctx, Subject& subject, const std::pair<Tensor, Tensor>& out) {
  Result r{read_floats(ctx, out.first), read_floats(ctx, out.second), {}, {}};
  for (const Parameter* p : subject.parameters()) r.grads.push_back(read_floats(ctx, p->grad));
  for (const StateTensor& s : subject.state()) r.state.push_back(read_floats(ctx, s.tensor));
  return r;
}

Tensor bf16_tensor(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t rows,
                   std::int64_t cols) {
  const Tensor t = ctx.persistent(name, {Shape{rows, cols}, DType::kBFloat16});
  write_floats(ctx, t, values);
  return t;
}

void expect_slice(const std::vector<float>& got, const Slice& slice, const std::vector<float>& reference, int r,
                  int n, const std::string& what) {
  const std::vector<float> want = slice.of(reference, r, n);
  if (slice.summed) {
    testing::expect_close(got, want, what + " (summed across ranks)", 2e-2f, 1e-6f);
  } else {
    EXPECT_EQ(got, want) << what << ": not bit for bit the one-rank value";
  }
}

constexpr int kSteps = 2;

class Fp8TensorParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8TensorParallelTest, EveryRankMatchesOneRankAndItsGraphEqualsEager) {
  const Case& c = GetParam();
  const int n = c.ranks;
  const testing::TestSeed seed;
  const std::vector<float> x_all = testing::normal_values(seed.value(), c.x.rows * c.x.cols);
  std::vector<float> dy_all = testing::normal_values(seed.value() + 1, c.y.rows * c.y.cols);
  for (float& v : dy_all) v *= 0.01f;  // gradient-sized
  Result reference;
  {
    Context ctx(Device::kHost);
    const std::unique_ptr<Subject> plain = c.make(ctx, nullptr);
    const Tensor x = bf16_tensor(ctx, "x", x_all, c.x.rows, c.x.cols);
    const Tensor dy = bf16_tensor(ctx, "dy", dy_all, c.y.rows, c.y.cols);
    for (int step = 0; step < kSteps; ++step) reference = read(ctx, *plain, plain->step(ctx, x, dy));
  }
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    // GoogleTest's trace is per thread: the seed goes into every message here.
    const std::string who = c.name + ", rank " + std::to_string(r) + ", " + testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const std::unique_ptr<Subject> eager = c.make(ctx, &comm);
    const std::unique_ptr<Subject> graphed = c.make(ctx, &comm);
    const Tensor x = bf16_tensor(ctx, "x", c.x.of(x_all, r, n), c.x.local_rows(n), c.x.local_cols(n));
    const Tensor dy = bf16_tensor(ctx, "dy", c.y.of(dy_all, r, n), c.y.local_rows(n), c.y.local_cols(n));
    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const auto [y, dx] = graphed->step(ctx, x, dy);
                                         return std::vector<Tensor>{y, dx};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    Result got, replayed;
    for (int step = 0; step < kSteps; ++step) {
      got = read(ctx, *eager, eager->step(ctx, x, dy));
      graph->replay();
      replayed = read(ctx, *graphed, {graph->outputs()[0], graph->outputs()[1]});
    }
    expect_slice(got.y, c.y, reference.y, r, n, who + ": y");
    expect_slice(got.dx, c.dx, reference.dx, r, n, who + ": dx");
    const std::vector<Parameter*> params = eager->parameters();
    ASSERT_EQ(params.size(), c.grads.size()) << who;
    for (std::size_t i = 0; i < params.size(); ++i) {
      expect_slice(got.grads[i], c.grads[i], reference.grads[i], r, n, who + ": gradient of " + params[i]->name);
    }
    EXPECT_EQ(got.state, reference.state) << who << ": delayed scaling's histories and scales";
    EXPECT_EQ(got.state.size(), c.recipe.scaling == Fp8Scaling::kDelayed ? (c.name.find("mlp") != std::string::npos
                                                                                  ? 18u
                                                                                  : 9u)
                                                                            : 0u)
        << who;
    EXPECT_EQ(replayed.y, got.y) << who << ": graph y";
    EXPECT_EQ(replayed.dx, got.dx) << who << ": graph dx";
    EXPECT_EQ(replayed.grads, got.grads) << who << ": graph gradients";
    EXPECT_EQ(replayed.state, got.state) << who << ": graph FP8 state";
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Fp8TensorParallelTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(Fp8TensorParallelErrorsTest, ChunkedOverlapsAndUnevenSlicesSayWhatToDo) {
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(Linear(ctx, "fc",
                                 {.in_features = 64,
                                  .out_features = 64,
                                  .tensor_parallel = TensorParallelMode::kColumn,
                                  .sequence_parallel = true,
                                  .fprop_overlap = CommOverlap::kRingExchange,
                                  .fp8 = Fp8Recipe::current()},
                                 1, &comm),
                          "fprop_overlap ring_exchange with FP8", "none or bulk");
    EXPECT_ERROR_CONTAINS(
        Linear(ctx, "fc",
               {.in_features = 64, .out_features = 48, .tensor_parallel = TensorParallelMode::kColumn,
                .fp8 = Fp8Recipe::current()},
               1, &comm),
        "divisible by 16 on every rank", "64 and 24", "over 2 ranks");
    EXPECT_ERROR_CONTAINS(LayerNormMLP(ctx, "mlp",
                                       {.hidden = 64, .ffn = 128, .overlap = MLPOverlap::overlapped(),
                                        .fp8 = Fp8Recipe::delayed(4)},
                                       1, &comm),
                          "with FP8", "none or bulk");
  });
}

TEST(Fp8TensorParallelCudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainLayer) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  constexpr std::int64_t kTokens = 256, kHidden = 256, kFfn = 1024;
  const Tensor x = bf16_tensor(ctx, "x", testing::normal_values(5, kTokens * kHidden), kTokens, kHidden);
  std::vector<float> dy_values = testing::normal_values(6, kTokens * kHidden);
  for (float& v : dy_values) v *= 0.01f;
  const Tensor dy = bf16_tensor(ctx, "dy", dy_values, kTokens, kHidden);
  for (const Fp8Recipe& recipe : {Fp8Recipe::current(), Fp8Recipe::delayed(16), Fp8Recipe::block()}) {
    SCOPED_TRACE(recipe.to_string());
    const LayerNormMLPConfig config{.hidden = kHidden, .ffn = kFfn, .fp8 = recipe};
    Mlp split(ctx, config, comm.get());
    Mlp plain(ctx, config, nullptr);
    auto step = [&](Subject& mlp) {
      return [&] {
        const auto [y, dx] = mlp.step(ctx, x, dy);
        return std::vector<Tensor>{y, dx};
      };
    };
    const testing::ParityGraphs graphs(ctx, *comm, step(split), step(plain));
    graphs.replay(100);
    const Result a = read(ctx, split, {graphs.with->outputs()[0], graphs.with->outputs()[1]});
    const Result b = read(ctx, plain, {graphs.without->outputs()[0], graphs.without->outputs()[1]});
    EXPECT_EQ(a.y, b.y);
    EXPECT_EQ(a.dx, b.dx);
    EXPECT_EQ(a.grads, b.grads);
    EXPECT_EQ(a.state, b.state);
  }
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
