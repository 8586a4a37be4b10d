// Column- and row-parallel Linear, with and without sequence parallelism,
// the column + row pair of an MLP, and LayerNormLinear before a
// column-parallel linear (Note [Column- and row-parallel Linear]), on host
// thread worlds of 2 and 4 ranks against one rank's plain layers on the same
// global input: each rank's output and input gradient (its rows, columns or
// the whole, as the mode says) and each weight-gradient slice equal the
// one-rank layer's. Eager equals graph bit for bit on every rank. On the GPU,
// one rank through real NCCL, captured and replayed, equals the plain layers.
//
// Tolerance: fp32 layers. Where a reduction is split across ranks (a
// row-parallel output's partial sums over in / N features, a column-parallel
// dx's over out / N, the norm's gamma and beta over T / N tokens) the ranks'
// partial results are summed by the collective after their own GEMMs, where
// one rank sums all terms in one GEMM: the same terms in another fp32 order,
// a few ulp of the O(1) values here (about 1e-7 relative). Everything else
// is the same dot product in the same order and comes out equal. We allow
// 1e-5 of the largest reference value (at least 1e-5): a doubled bias
// (|b| up to 1 / sqrt(in) = 0.35), a wrong slice or a missing reduction is
// off by 1e-2 or more; the test checks that a doubled row-parallel bias
// exceeds the tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/layernorm_linear.h"
#include "layers/linear.h"
#include "tests/layers/one_rank_parity.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/layers/shard_values.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::by_columns;
using testing::by_rows;
using testing::normal_values;
using testing::Slice;
using testing::whole;

constexpr std::int64_t kTokens = 16;
constexpr std::int64_t kIn = 8;
constexpr std::int64_t kOut = 16;  // also the pair's ffn
constexpr std::uint32_t kSeed = 33;

// The layers under test, plain (no communicator) or tensor-parallel: one
// forward and backward gives y and dx and writes every gradient.
class Subject {
 public:
  virtual ~Subject() = default;
  virtual std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const = 0;
  virtual std::vector<Parameter*> parameters() = 0;
};

LinearConfig linear_config(std::int64_t in, std::int64_t out, TensorParallelMode mode, bool sp, Communicator* comm) {
  return {.in_features = in,
          .out_features = out,
          .bias = true,
          .dtype = DType::kFloat32,
          .tensor_parallel = comm != nullptr ? mode : TensorParallelMode::kNone,
          .sequence_parallel = comm != nullptr && sp};
}

class OneLinear : public Subject {
 public:
  OneLinear(Context& ctx, const LinearConfig& config, Communicator* comm) : fc_(ctx, "fc", config, kSeed, comm) {}
  std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const override {
    const Linear::Forward f = fc_.forward(ctx, {x});
    return {f.y, fc_.backward(ctx, f.saved, {dy})};
  }
  std::vector<Parameter*> parameters() override { return fc_.parameters(); }

 private:
  Linear fc_;
};

// fc1 column-parallel, fc2 row-parallel: no collective between them.
class Pair : public Subject {
 public:
  Pair(Context& ctx, DType dtype, std::int64_t hidden, std::int64_t ffn, bool sp, Communicator* comm)
      : fc1_(ctx, "fc1", with(linear_config(hidden, ffn, TensorParallelMode::kColumn, sp, comm), dtype), kSeed, comm),
        fc2_(ctx, "fc2", with(linear_config(ffn, hidden, TensorParallelMode::kRow, sp, comm), dtype), kSeed + 2, comm) {
  }
  std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const override {
    const Linear::Forward f1 = fc1_.forward(ctx, {x});
    const Linear::Forward f2 = fc2_.forward(ctx, {f1.y});
    const Tensor d1 = fc2_.backward(ctx, f2.saved, {dy});
    return {f2.y, fc1_.backward(ctx, f1.saved, {d1})};
  }
  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out = fc1_.parameters();
    for (Parameter* p : fc2_.parameters()) out.push_back(p);
    return out;
  }

 private:
  static LinearConfig with(LinearConfig config, DType dtype) {
    config.dtype = dtype;
    return config;
  }
  Linear fc1_;
  Linear fc2_;
};

class NormThenLinear : public Subject {
 public:
  NormThenLinear(Context& ctx, DType dtype, std::int64_t in, std::int64_t out, bool sp, Communicator* comm)
      : layer_(ctx, "qkv", {.linear = config(in, out, dtype, sp, comm)}, kSeed, comm) {}
  std::pair<Tensor, Tensor> step(Context& ctx, const Tensor& x, const Tensor& dy) const override {
    const LayerNormLinear::Forward f = layer_.forward(ctx, {x});
    return {f.y, layer_.backward(ctx, f.saved, {dy})};
  }
  std::vector<Parameter*> parameters() override { return layer_.parameters(); }

 private:
  static LinearConfig config(std::int64_t in, std::int64_t out, DType dtype, bool sp, Communicator* comm) {
    LinearConfig c = linear_config(in, out, TensorParallelMode::kColumn, sp, comm);
    c.dtype = dtype;
    return c;
  }
  LayerNormLinear layer_;
};

// One case: the subject, and how each rank's tensors are slices of one rank's.
struct Case {
  std::string name;
  std::function<std::unique_ptr<Subject>(Context&, Communicator*)> make;
  Slice x, y;                   // dx is sliced like x, dy like y
  std::vector<Slice> grads;     // in parameters() order
  int row_bias = -1;            // the row-parallel bias's index in parameters(), if any
};

std::vector<Case> cases() {
  using M = TensorParallelMode;
  const Slice w_rows = by_rows(kOut, kIn), b_rows = by_rows(kOut, 1);
  const Slice w_cols = by_columns(kOut, kIn), b_whole = whole(kOut, 1);
  auto linear = [](M mode, bool sp) {
    return [mode, sp](Context& ctx, Communicator* comm) -> std::unique_ptr<Subject> {
      return std::make_unique<OneLinear>(ctx, linear_config(kIn, kOut, mode, sp, comm), comm);
    };
  };
  auto pair = [](bool sp) {
    return [sp](Context& ctx, Communicator* comm) -> std::unique_ptr<Subject> {
      return std::make_unique<Pair>(ctx, DType::kFloat32, kIn, kOut, sp, comm);
    };
  };
  auto norm_linear = [](bool sp) {
    return [sp](Context& ctx, Communicator* comm) -> std::unique_ptr<Subject> {
      return std::make_unique<NormThenLinear>(ctx, DType::kFloat32, kIn, kOut, sp, comm);
    };
  };
  const std::vector<Slice> pair_grads{w_rows, b_rows, by_columns(kIn, kOut), whole(kIn, 1)};
  const std::vector<Slice> norm_linear_grads{whole(kIn, 1), whole(kIn, 1), w_rows, b_rows};
  return {
      {"column", linear(M::kColumn, false), whole(kTokens, kIn), by_columns(kTokens, kOut), {w_rows, b_rows}},
      {"column_sp", linear(M::kColumn, true), by_rows(kTokens, kIn), by_columns(kTokens, kOut), {w_rows, b_rows}},
      {"row", linear(M::kRow, false), by_columns(kTokens, kIn), whole(kTokens, kOut), {w_cols, b_whole}, 1},
      {"row_sp", linear(M::kRow, true), by_columns(kTokens, kIn), by_rows(kTokens, kOut), {w_cols, b_whole}, 1},
      {"column_row_pair", pair(false), whole(kTokens, kIn), whole(kTokens, kIn), pair_grads, 3},
      {"column_row_pair_sp", pair(true), by_rows(kTokens, kIn), by_rows(kTokens, kIn), pair_grads, 3},
      {"layernorm_linear", norm_linear(false), whole(kTokens, kIn), by_columns(kTokens, kOut), norm_linear_grads},
      {"layernorm_linear_sp", norm_linear(true), by_rows(kTokens, kIn), by_columns(kTokens, kOut), norm_linear_grads},
  };
}

struct Result {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;
};

Result read(Context& ctx, Subject& subject, const std::pair<Tensor, Tensor>& out) {
  Result r{ctx.to_vector<float>(out.first), ctx.to_vector<float>(out.second), {}};
  for (const Parameter* p : subject.parameters()) r.grads.push_back(ctx.to_vector<float>(p->grad));
  return r;
}

Tensor tensor_of(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t rows,
                 std::int64_t cols) {
  const Tensor t = ctx.persistent(name, {Shape{rows, cols}, DType::kFloat32});
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

float tolerance(const std::vector<float>& want) {
  float scale = 1.0f;
  for (float v : want) scale = std::max(scale, std::abs(v));
  return 1e-5f * scale;
}

float worst_difference(const std::vector<float>& got, const std::vector<float>& want) {
  float worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return worst;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_LE(worst_difference(got, want), tolerance(want))
      << what << ": largest difference " << worst_difference(got, want);
}

// y with one more copy of the bias [cols] in every row: what a row-parallel
// layer gives when two ranks add its bias.
std::vector<float> with_bias_again(std::vector<float> y, const std::vector<float>& bias) {
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += bias[i % bias.size()];
  return y;
}

struct World {
  int ranks;
  Case c;
};
void PrintTo(const World& w, std::ostream* os) { *os << w.c.name << " on " << w.ranks << " ranks"; }

class TensorParallelLinearTest : public ::testing::TestWithParam<World> {};

TEST_P(TensorParallelLinearTest, EveryRankMatchesOneRankAndItsGraphEqualsEager) {
  const int n = GetParam().ranks;
  const Case& c = GetParam().c;
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), c.x.rows * c.x.cols);
  const std::vector<float> dy_all = normal_values(seed.value() + 1, c.y.rows * c.y.cols);
  Result reference;
  {
    Context ctx(Device::kHost);
    const std::unique_ptr<Subject> plain = c.make(ctx, nullptr);
    const Tensor x = tensor_of(ctx, "x", x_all, c.x.rows, c.x.cols);
    const Tensor dy = tensor_of(ctx, "dy", dy_all, c.y.rows, c.y.cols);
    reference = read(ctx, *plain, plain->step(ctx, x, dy));
  }
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    // GoogleTest's trace is per thread: the seed goes into every message here.
    const std::string who =
        c.name + ", rank " + std::to_string(r) + " of " + std::to_string(n) + ", " + testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const std::unique_ptr<Subject> eager = c.make(ctx, &comm);
    const std::unique_ptr<Subject> graphed = c.make(ctx, &comm);
    const Tensor x = tensor_of(ctx, "x", c.x.of(x_all, r, n), c.x.local_rows(n), c.x.local_cols(n));
    const Tensor dy = tensor_of(ctx, "dy", c.y.of(dy_all, r, n), c.y.local_rows(n), c.y.local_cols(n));
    const Result got = read(ctx, *eager, eager->step(ctx, x, dy));
    expect_close(got.y, c.y.of(reference.y, r, n), who + ": y");
    expect_close(got.dx, c.x.of(reference.dx, r, n), who + ": dx");
    const std::vector<Parameter*> params = eager->parameters();
    ASSERT_EQ(params.size(), c.grads.size()) << who;
    for (std::size_t i = 0; i < params.size(); ++i) {
      expect_close(got.grads[i], c.grads[i].of(reference.grads[i], r, n), who + ": gradient of " + params[i]->name);
    }
    if (c.row_bias >= 0) {  // the tolerance catches a row-parallel bias added twice
      const std::vector<float> bias = ctx.to_vector<float>(params[static_cast<std::size_t>(c.row_bias)]->value);
      const std::vector<float> want = c.y.of(reference.y, r, n);
      EXPECT_GT(worst_difference(with_bias_again(got.y, bias), want), tolerance(want)) << who << ": doubled bias";
    }

    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const auto [y, dx] = graphed->step(ctx, x, dy);
                                         return std::vector<Tensor>{y, dx};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    graph->replay();
    EXPECT_EQ(ctx.to_vector<float>(graph->outputs()[0]), got.y) << who << ": graph y";
    EXPECT_EQ(ctx.to_vector<float>(graph->outputs()[1]), got.dx) << who << ": graph dx";
    const std::vector<Parameter*> graph_params = graphed->parameters();
    for (std::size_t i = 0; i < graph_params.size(); ++i) {
      EXPECT_EQ(ctx.to_vector<float>(graph_params[i]->grad), got.grads[i])
          << who << ": graph gradient of " << graph_params[i]->name;
    }
  });
}

std::vector<World> worlds() {
  std::vector<World> out;
  for (int n : {2, 4}) {
    for (const Case& c : cases()) out.push_back({n, c});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelLinearTest, ::testing::ValuesIn(worlds()),
                         [](const auto& info) { return info.param.c.name + "_tp" + std::to_string(info.param.ranks); });

// Plain layers stay what they were: no communicator, the same draw and ops.
TEST(TensorParallelLinearWorldOfOneTest, EqualsThePlainLayerBitForBit) {
  const testing::TestSeed seed;
  for (const Case& c : cases()) {
    const std::vector<float> x_all = normal_values(seed.value(), c.x.rows * c.x.cols);
    const std::vector<float> dy_all = normal_values(seed.value() + 1, c.y.rows * c.y.cols);
    Context ctx(Device::kHost);
    const Tensor x = tensor_of(ctx, "x", x_all, c.x.rows, c.x.cols);
    const Tensor dy = tensor_of(ctx, "dy", dy_all, c.y.rows, c.y.cols);
    const std::unique_ptr<Subject> plain = c.make(ctx, nullptr);
    const Result want = read(ctx, *plain, plain->step(ctx, x, dy));
    HostWorld::run(1, [&](Communicator& comm) {
      Context rank_ctx(Device::kHost);
      const std::unique_ptr<Subject> parallel = c.make(rank_ctx, &comm);
      const Tensor rx = tensor_of(rank_ctx, "x", x_all, c.x.rows, c.x.cols);
      const Tensor rdy = tensor_of(rank_ctx, "dy", dy_all, c.y.rows, c.y.cols);
      const Result got = read(rank_ctx, *parallel, parallel->step(rank_ctx, rx, rdy));
      EXPECT_EQ(got.y, want.y) << c.name;
      EXPECT_EQ(got.dx, want.dx) << c.name;
      EXPECT_EQ(got.grads, want.grads) << c.name;
    });
  }
}

TEST(TensorParallelLinearErrorsTest, BadConfigurationsSayWhatToDo) {
  using M = TensorParallelMode;
  Context plain_ctx(Device::kHost);
  EXPECT_ERROR_CONTAINS(
      Linear(plain_ctx, "fc",
             {.in_features = kIn, .out_features = kOut, .dtype = DType::kFloat32, .tensor_parallel = M::kColumn},
             kSeed),
      "Linear 'fc': config.tensor_parallel is column but no communicator was given",
      "pass the tensor-parallel group's Communicator");
  EXPECT_ERROR_CONTAINS(
      Linear(plain_ctx, "fc",
             {.in_features = kIn, .out_features = kOut, .dtype = DType::kFloat32, .sequence_parallel = true}, kSeed),
      "Linear 'fc': sequence_parallel needs a tensor-parallel layer");
  HostWorld::run(3, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(
        Linear(ctx, "fc", {.in_features = 9, .out_features = 8, .dtype = DType::kFloat32}, kSeed, &comm),
        "Linear 'fc': got a tensor-parallel communicator", "config.tensor_parallel is none");
    EXPECT_ERROR_CONTAINS(Linear(ctx, "fc", linear_config(9, 8, M::kColumn, false, &comm), kSeed, &comm),
                          "a column-parallel layer splits out_features 8 over the 3 ranks",
                          "make out_features a multiple of 3");
    EXPECT_ERROR_CONTAINS(Linear(ctx, "fc", linear_config(8, 9, M::kRow, false, &comm), kSeed, &comm),
                          "a row-parallel layer splits in_features 8 over the 3 ranks",
                          "make in_features a multiple of 3");
    EXPECT_ERROR_CONTAINS(
        LayerNormLinear(ctx, "qkv", {.linear = linear_config(9, 9, M::kRow, false, &comm)}, kSeed, &comm),
        "LayerNormLinear 'qkv': the linear cannot be row-parallel", "use kColumn");
    // A sequence-parallel row-parallel output is 1/N of the tokens each.
    const Linear row(ctx, "fc2", linear_config(9, 6, M::kRow, true, &comm), kSeed, &comm);
    const Tensor x = ctx.persistent("x", {Shape{4, 3}, DType::kFloat32});
    EXPECT_ERROR_CONTAINS(row.forward(ctx, {x}), "Linear 'fc2' forward: a sequence-parallel row-parallel layer",
                          "its 4 tokens over the 3 ranks", "give it a multiple of 3 tokens");
    // A row-parallel input is this rank's [tokens, in / N] columns.
    const Tensor whole = ctx.persistent("whole", {Shape{3, 9}, DType::kFloat32});
    EXPECT_ERROR_CONTAINS(row.forward(ctx, {whole}), "Linear 'fc2' forward: input must be [tokens, 3] fp32",
                          "got [3, 9] fp32");
  });
}

// On the GPU, one rank through real NCCL: the column + row pair and the
// LayerNormLinear, both sequence-parallel, run their all-gathers,
// reduce-scatters and norm-gradient all-reduce as identities captured into
// the graph; replayed, the bf16 layers equal the plain ones bit for bit.
TEST(TensorParallelLinearCudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainLayers) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  constexpr std::int64_t kHidden = 256;
  constexpr std::int64_t kFfn = 1024;
  const TensorMeta meta{Shape{128, kHidden}, DType::kBFloat16};
  const Tensor x = ctx.persistent("x", meta);
  const Tensor dy_pair = ctx.persistent("dy_pair", meta);
  const Tensor dy_qkv = ctx.persistent("dy_qkv", {Shape{128, kFfn}, DType::kBFloat16});
  for (const Tensor& t : {x, dy_pair, dy_qkv}) {
    const std::vector<float> normal = normal_values(7 + static_cast<std::uint32_t>(t.numel() % 5), t.numel());
    std::vector<std::uint16_t> values(normal.size());
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = float_to_bf16(normal[i]);
    ctx.copy_from_host(t, values.data(), values.size() * 2);
  }
  Pair pair_tp(ctx, DType::kBFloat16, kHidden, kFfn, /*sp=*/true, comm.get());
  Pair pair_plain(ctx, DType::kBFloat16, kHidden, kFfn, /*sp=*/true, nullptr);
  NormThenLinear qkv_tp(ctx, DType::kBFloat16, kHidden, kFfn, /*sp=*/true, comm.get());
  NormThenLinear qkv_plain(ctx, DType::kBFloat16, kHidden, kFfn, /*sp=*/true, nullptr);
  auto step = [&](Subject& pair, Subject& qkv) {
    return [&] {
      const auto [y1, dx1] = pair.step(ctx, x, dy_pair);
      const auto [y2, dx2] = qkv.step(ctx, x, dy_qkv);
      return std::vector<Tensor>{y1, dx1, y2, dx2};
    };
  };
  const testing::ParityGraphs graphs(ctx, *comm, step(pair_tp, qkv_tp), step(pair_plain, qkv_plain));
  graphs.replay(100);
  for (std::size_t o = 0; o < 4; ++o) {
    EXPECT_EQ(ctx.to_vector<std::uint16_t>(graphs.with->outputs()[o]),
              ctx.to_vector<std::uint16_t>(graphs.without->outputs()[o]))
        << "output " << o;
  }
  for (auto [a, b] : {std::pair<Subject*, Subject*>{&pair_tp, &pair_plain}, {&qkv_tp, &qkv_plain}}) {
    const std::vector<Parameter*> pa = a->parameters();
    const std::vector<Parameter*> pb = b->parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (std::size_t i = 0; i < pa.size(); ++i) {
      EXPECT_EQ(ctx.to_vector<float>(pa[i]->grad), ctx.to_vector<float>(pb[i]->grad)) << pa[i]->name;
    }
  }
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
