// The overlap modes of a sequence-parallel LayerNormMLP (Note
// [Communication-GEMM overlap]) on host thread worlds of 2 and 4 ranks: each
// mode against `none` on the same inputs, eager against graph, and the
// schedules they record; the modes as values (parse, check, graph key); on
// the GPU, GEMMs over row windows against the whole GEMM, and every mode at
// one NCCL rank equal to the plain layer.
//
// Exactness: ring_exchange multiplies row windows of the gathered input, the
// same arithmetic per row as the whole GEMM on the host reference, so it
// equals none bit for bit. pipelined sums a block's parts in ring order
// (r+1, ..., r) where the reduce-scatter sums them in rank order: the same
// with 2 ranks (a + b == b + a), with 4 a different fp32 order, about 1e-7
// relative; we allow 1e-5 of the largest value (a dropped or doubled block is
// off by O(1)). In bf16, a chunked fc2 data gradient takes fc1's bias gradient
// from fc1's fp32 weight-gradient epilogue instead of the bf16 DGELU_BGRAD
// epilogue: that gradient then differs by bf16 rounding (allowed 1e-2
// relative); everything else stays bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "graphs/program.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/layernorm_mlp.h"
#include "layers/linear.h"
#include "ops/gemm_ops.h"
#include "ops/row_ops.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/layers/shard_values.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::normal_values;
using testing::rows;

constexpr std::int64_t kTokens = 16;  // all ranks together
constexpr std::int64_t kHidden = 8;
constexpr std::int64_t kFfn = 32;
constexpr std::uint32_t kSeed = 5;

// A tensor of `dtype` holding `values` (rounded to bf16 where asked).
Tensor tensor_of(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t rows,
                 DType dtype) {
  const Tensor t = ctx.persistent(name, {Shape{rows, kHidden}, dtype});
  if (dtype == DType::kFloat32) {
    ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  } else {
    std::vector<std::uint16_t> bits(values.size());
    for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = float_to_bf16(values[i]);
    ctx.copy_from_host(t, bits.data(), bits.size() * 2);
  }
  return t;
}

std::vector<float> as_floats(Context& ctx, const Tensor& t) {
  if (t.dtype() == DType::kFloat32) return ctx.to_vector<float>(t);
  std::vector<float> out;
  for (std::uint16_t b : ctx.to_vector<std::uint16_t>(t)) out.push_back(bf16_to_float(b));
  return out;
}

// y, dx and every gradient (norm gamma, beta, fc1 weight, bias, fc2 weight, bias).
struct Result {
  std::vector<std::vector<float>> values;
};

Result collect(Context& ctx, const LayerNormMLP& layer, const Tensor& y, const Tensor& dx,
               const std::vector<Parameter*>& params) {
  Result r{{as_floats(ctx, y), as_floats(ctx, dx)}};
  for (const Parameter* p : params) r.values.push_back(ctx.to_vector<float>(p->grad));
  return r;
}

const char* kWhat[] = {"y", "dx", "gamma grad", "beta grad", "fc1 weight grad", "fc1 bias grad", "fc2 weight grad",
                       "fc2 bias grad"};

float largest_difference(const std::vector<float>& a, const std::vector<float>& b, float* scale) {
  float worst = 0;
  *scale = 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]));
    *scale = std::max(*scale, std::abs(b[i]));
  }
  return worst;
}

int count_ops(const Program& program, std::string_view name) {
  return static_cast<int>(std::count_if(program.instructions().begin(), program.instructions().end(),
                                        [&](const Instruction& i) { return i.op->name == name; }));
}

struct Case {
  int ranks;
  DType dtype;
  const char* overlap;
  // Captured rings by copies into the peers' pools (Note [The pool as
  // symmetric memory]), or through the mailbox as NCCL does where peers are
  // out of reach.
  bool peer_copies = true;
};

class OverlapModesTest : public ::testing::TestWithParam<Case> {};

// Every rank's layer under `overlap` equals the same layer under none, eager
// and graphed; the graph holds the schedule the mode promises.
TEST_P(OverlapModesTest, EqualsNoneAndItsGraphEqualsEager) {
  const Case c = GetParam();
  const MLPOverlap overlap = MLPOverlap::parse(c.overlap);
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  const std::vector<float> dy_all = normal_values(seed.value() + 1, kTokens * kHidden);
  const std::int64_t t = kTokens / c.ranks;
  HostWorld::run(c.ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(c.ranks) + ", " + c.overlap +
                            (c.peer_copies ? ", peer copies" : ", mailbox") + ", seed " + std::to_string(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const LayerNormMLPConfig base{.hidden = kHidden, .ffn = kFfn, .dtype = c.dtype};
    LayerNormMLPConfig mode = base;
    mode.overlap = overlap;
    LayerNormMLP none(ctx, "mlp", {.hidden = kHidden, .ffn = kFfn, .dtype = c.dtype, .overlap = MLPOverlap::uniform(CommOverlap::kNone)}, kSeed, &comm);
    LayerNormMLP eager(ctx, "mlp", mode, kSeed, &comm);
    LayerNormMLP graphed(ctx, "mlp", mode, kSeed, &comm);
    const Tensor x = tensor_of(ctx, "x", {x_all.begin() + r * t * kHidden, x_all.begin() + (r + 1) * t * kHidden},
                               t, c.dtype);
    const Tensor dy = tensor_of(
        ctx, "dy", {dy_all.begin() + r * t * kHidden, dy_all.begin() + (r + 1) * t * kHidden}, t, c.dtype);
    auto run_eager = [&](LayerNormMLP& layer) {
      const LayerNormMLP::Forward f = layer.forward(ctx, {x});
      const Tensor dx = layer.backward(ctx, f.saved, {dy});
      return collect(ctx, layer, f.y, dx, layer.parameters());
    };
    const Result want = run_eager(none);
    const Result got = run_eager(eager);
    const bool exact_sums = c.ranks <= 2 || overlap.fc2_fprop != CommOverlap::kPipelined;
    const bool exact_dsums = c.ranks <= 2 || overlap.fc1_dgrad != CommOverlap::kPipelined;
    for (std::size_t i = 0; i < want.values.size(); ++i) {
      float scale = 0;
      const float worst = largest_difference(got.values[i], want.values[i], &scale);
      // y from fc2's sums; dx and the norm's grads from fc1's data-gradient sums.
      bool exact = i == 0 ? exact_sums : (i <= 3 ? exact_dsums : true);
      float tolerance = 1e-5f;
      if (i == 5 && c.dtype == DType::kBFloat16 && overlap.fc2_dgrad == CommOverlap::kRingExchange) {
        exact = false;  // fc1's bias gradient from the fp32 wgrad epilogue
        tolerance = 1e-2f;
      }
      if (exact) {
        EXPECT_EQ(worst, 0.0f) << who << ": " << kWhat[i] << " differs from none by " << worst;
      } else {
        EXPECT_LE(worst, tolerance * scale) << who << ": " << kWhat[i] << " differs from none by " << worst << " of "
                                            << scale;
      }
    }

    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const LayerNormMLP::Forward f = graphed.forward(ctx, {x});
                                         return std::vector<Tensor>{f.y, graphed.backward(ctx, f.saved, {dy})};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    int rings = 0;
    for (CommOverlap m : {overlap.fc1_fprop, overlap.fc2_fprop, overlap.fc2_dgrad, overlap.fc1_dgrad}) {
      rings += m == CommOverlap::kRingExchange || m == CommOverlap::kPipelined;
    }
    // Three replays: the flags of every slot return to zero after each, so
    // the same graph runs again with the same bits.
    for (int replay = 0; replay < 3; ++replay) {
      const std::int64_t transfers = comm.window_transfers();
      graph->replay();
      EXPECT_EQ(comm.window_transfers() - transfers, c.peer_copies ? rings * (c.ranks - 1) : 0)
          << who << ": ring steps by peer copy in replay " << replay;
      const Result replayed = collect(ctx, graphed, graph->outputs()[0], graph->outputs()[1], graphed.parameters());
      for (std::size_t i = 0; i < got.values.size(); ++i) {
        EXPECT_EQ(replayed.values[i], got.values[i]) << who << ": graph != eager for " << kWhat[i] << " in replay "
                                                     << replay;
      }
    }
    // The schedule: a ring step per shard but the last, per chunked pair.
    const Program& program = graph->program();
    EXPECT_EQ(count_ops(program, "send_recv"), rings * (c.ranks - 1)) << who;
    EXPECT_EQ(count_ops(program, "all_gather"),
              (overlap.fc1_fprop != CommOverlap::kRingExchange) + (overlap.fc2_dgrad != CommOverlap::kRingExchange))
        << who;
    EXPECT_EQ(count_ops(program, "reduce_scatter"),
              (overlap.fc2_fprop != CommOverlap::kPipelined) + (overlap.fc1_dgrad != CommOverlap::kPipelined))
        << who;
  }, HostWorld::kDefaultTimeout, c.peer_copies);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string overlap = info.param.overlap;
  std::replace(overlap.begin(), overlap.end(), ',', '_');
  return "tp" + std::to_string(info.param.ranks) + "_" + std::string(dtype_name(info.param.dtype)) + "_" + overlap +
         (info.param.peer_copies ? "" : "_mailbox");
}

INSTANTIATE_TEST_SUITE_P(
    Modes, OverlapModesTest,
    ::testing::Values(Case{2, DType::kFloat32, "bulk"}, Case{2, DType::kFloat32, "overlap"},
                      Case{4, DType::kFloat32, "bulk"}, Case{4, DType::kFloat32, "overlap"},
                      Case{4, DType::kFloat32, "ring_exchange,bulk,ring_exchange,none"},
                      Case{4, DType::kFloat32, "none,pipelined,bulk,pipelined"},
                      Case{2, DType::kBFloat16, "overlap"}, Case{4, DType::kBFloat16, "ring_exchange,none,ring_exchange,bulk"},
                      Case{2, DType::kFloat32, "overlap", false}, Case{4, DType::kFloat32, "overlap", false}),
    case_name);

// A column-parallel then a row-parallel sequence-parallel Linear (an MLP
// without its activation), each collective chunked: the column layer's
// all-gather by ring_exchange and its dgrad's reduce-scatter pipelined, the
// row layer's reduce-scatter pipelined and its dgrad's all-gather by
// ring_exchange; against the same pair with every collective bulk.
// Exactness as for LayerNormMLP above: only the pipelined sums (y and dx) may
// round differently, and only with more than 2 ranks.
class LinearOverlapTest : public ::testing::TestWithParam<int> {};

TEST_P(LinearOverlapTest, ChunkedCollectivesEqualBulkAndTheGraphEqualsEager) {
  const int n = GetParam();
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  const std::vector<float> dy_all = normal_values(seed.value() + 1, kTokens * kHidden);
  const std::int64_t t = kTokens / n;
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    struct Pair {
      std::unique_ptr<Linear> column, row;
    };
    auto make = [&](bool chunked) {
      LinearConfig c{.in_features = kHidden, .out_features = kFfn, .dtype = DType::kFloat32,
                     .tensor_parallel = TensorParallelMode::kColumn, .sequence_parallel = true};
      LinearConfig w{.in_features = kFfn, .out_features = kHidden, .dtype = DType::kFloat32,
                     .tensor_parallel = TensorParallelMode::kRow, .sequence_parallel = true};
      if (chunked) {
        c.fprop_overlap = CommOverlap::kRingExchange;
        c.dgrad_overlap = CommOverlap::kPipelined;
        w.fprop_overlap = CommOverlap::kPipelined;
        w.dgrad_overlap = CommOverlap::kRingExchange;
      }
      return Pair{std::make_unique<Linear>(ctx, "fc1", c, kSeed, &comm),
                  std::make_unique<Linear>(ctx, "fc2", w, kSeed + 7, &comm)};
    };
    Pair bulk = make(false), eager = make(true), graphed = make(true);
    const Tensor x = tensor_of(ctx, "x", rows(x_all, kHidden, r * t, t), t, DType::kFloat32);
    const Tensor dy = tensor_of(ctx, "dy", rows(dy_all, kHidden, r * t, t), t, DType::kFloat32);
    auto step = [&](Pair& p) {
      const Linear::Forward h = p.column->forward(ctx, {x});
      const Linear::Forward y = p.row->forward(ctx, {h.y});
      const Tensor dh = p.row->backward(ctx, y.saved, {dy});
      return std::vector<Tensor>{y.y, p.column->backward(ctx, h.saved, {dh})};
    };
    auto collect_pair = [&](Pair& p, const std::vector<Tensor>& outs) {
      std::vector<std::vector<float>> v{as_floats(ctx, outs[0]), as_floats(ctx, outs[1])};
      for (Linear* l : {p.column.get(), p.row.get()}) {
        for (const Parameter* q : l->parameters()) v.push_back(ctx.to_vector<float>(q->grad));
      }
      return v;
    };
    const std::vector<std::vector<float>> want = collect_pair(bulk, step(bulk));
    const std::vector<std::vector<float>> got = collect_pair(eager, step(eager));
    for (std::size_t i = 0; i < want.size(); ++i) {
      float scale = 0;
      const float worst = largest_difference(got[i], want[i], &scale);
      if (n <= 2 || i >= 2) {
        EXPECT_EQ(worst, 0.0f) << who << ": value " << i << " differs from bulk by " << worst;
      } else {
        EXPECT_LE(worst, 1e-5f * scale) << who << ": value " << i << " differs from bulk by " << worst;
      }
    }
    auto graph = CapturedStep::capture(ctx, [&] { return step(graphed); },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    graph->replay();
    EXPECT_EQ(collect_pair(graphed, graph->outputs()), got) << who << ": graph != eager";
    EXPECT_EQ(count_ops(graph->program(), "send_recv"), 4 * (n - 1)) << who;
    EXPECT_EQ(count_ops(graph->program(), "all_gather") + count_ops(graph->program(), "reduce_scatter"), 0) << who;
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, LinearOverlapTest, ::testing::Values(2, 4),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

TEST(LinearOverlapTest, ModesThatDoNotFitTheCollectiveAreRefused) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(Linear(ctx, "fc", {.in_features = 8, .out_features = 8, .tensor_parallel = TensorParallelMode::kColumn,
                                             .sequence_parallel = true, .fprop_overlap = CommOverlap::kPipelined}, 1, &comm),
                          "fprop_overlap pipelined does not fit", "ring_exchange");
    EXPECT_ERROR_CONTAINS(Linear(ctx, "fc", {.in_features = 8, .out_features = 8, .tensor_parallel = TensorParallelMode::kRow,
                                             .dgrad_overlap = CommOverlap::kRingExchange}, 1, &comm),
                          "without sequence parallelism the collectives are all-reduces");
  });
}

TEST(MLPOverlapTest, ParsesNamesAndRefusesModesThatDoNotFitTheirCollective) {
  EXPECT_EQ(MLPOverlap::parse("none"), MLPOverlap::uniform(CommOverlap::kNone));
  EXPECT_EQ(MLPOverlap::parse("bulk"), MLPOverlap{});
  EXPECT_EQ(MLPOverlap::parse("overlap"), MLPOverlap::overlapped());
  EXPECT_EQ(MLPOverlap::parse("ring_exchange,pipelined,none,bulk"),
            (MLPOverlap{CommOverlap::kRingExchange, CommOverlap::kPipelined, CommOverlap::kNone, CommOverlap::kBulk}));
  EXPECT_ERROR_CONTAINS(MLPOverlap::parse("pipelined,none,none,none"),
                        "fc1_fprop (all-gather then GEMM) takes none, bulk or ring_exchange, got pipelined");
  EXPECT_ERROR_CONTAINS(MLPOverlap::parse("none,ring_exchange,none,none"),
                        "fc2_fprop (GEMM then reduce-scatter) takes none, bulk or pipelined");
  EXPECT_ERROR_CONTAINS(MLPOverlap::parse("fast"), "unknown overlap mode 'fast'");
  EXPECT_ERROR_CONTAINS(MLPOverlap::parse("none,none"), "four modes");
  Context ctx(Device::kHost);
  EXPECT_ERROR_CONTAINS(
      LayerNormMLP(ctx, "mlp", {.hidden = kHidden, .ffn = kFfn, .overlap = {.fc2_dgrad = CommOverlap::kPipelined}}, 1),
      "LayerNormMLP 'mlp': fc2_dgrad (all-gather then GEMM)");
}

// The overlap is the collectives': a layer without a communicator has none
// and takes any fitting choice (a step config's overlap reaches its one-rank
// reference too), in every precision.
TEST(MLPOverlapTest, APlainLayerTakesAnyFittingOverlap) {
  Context ctx(Device::kHost);
  for (const std::optional<Fp8Recipe>& fp8 : {std::optional<Fp8Recipe>(), std::optional(Fp8Recipe::current())}) {
    const LayerNormMLP layer(ctx, "mlp", {.hidden = 16, .ffn = 32, .overlap = MLPOverlap::overlapped(), .fp8 = fp8},
                             1);
    const Tensor x = ctx.persistent("x", {Shape{16, 16}, DType::kBFloat16});
    const std::vector<std::uint16_t> zeros(16 * 16, 0);
    ctx.copy_from_host(x, zeros.data(), zeros.size() * sizeof(std::uint16_t));
    const LayerNormMLP::Forward f = layer.forward(ctx, {x});
    EXPECT_NO_THROW(layer.backward(ctx, f.saved, {f.y}));
  }
}

TEST(MLPOverlapTest, EqualChoicesMeetOneGraphKeyAndEveryFieldChangesIt) {
  EXPECT_EQ(MLPOverlap::parse("overlap").key(), MLPOverlap::overlapped().key());
  EXPECT_EQ(MLPOverlap::overlapped().key().hash(), MLPOverlap::parse("ring_exchange,pipelined,ring_exchange,pipelined").key().hash());
  const MLPOverlap base = MLPOverlap::overlapped();
  for (int field = 0; field < 4; ++field) {
    MLPOverlap changed = base;
    CommOverlap* fields[] = {&changed.fc1_fprop, &changed.fc2_fprop, &changed.fc2_dgrad, &changed.fc1_dgrad};
    *fields[field] = CommOverlap::kBulk;
    EXPECT_NE(changed.key(), base.key()) << field;
  }
  EXPECT_EQ(base.to_string(), "fc1_fprop=ring_exchange fc2_fprop=pipelined fc2_dgrad=ring_exchange fc1_dgrad=pipelined");
}

// The row-window GEMMs a chunked schedule runs, on the GPU (cuBLASLt with
// offset pointers): each window equals those rows of the whole GEMM. cuBLASLt
// may pick another algorithm for another m, so the comparison allows bf16
// rounding (2^-7 relative to the largest value) rather than bits.
TEST(RowWindowGemmCudaTest, WindowsEqualTheRowsOfTheWholeGemm) {
  SG_SKIP_WITHOUT_GPU();
  Context ctx(Device::kCuda);
  const std::int64_t m = 256, k = 128, n = 192, chunk = 64;
  auto bf16_tensor = [&](const std::string& name, std::int64_t rows, std::int64_t cols, std::uint32_t s) {
    const Tensor t = ctx.persistent(name, {Shape{rows, cols}, DType::kBFloat16});
    std::vector<std::uint16_t> bits;
    for (float v : normal_values(s, rows * cols)) bits.push_back(float_to_bf16(0.25f * v));
    ctx.copy_from_host(t, bits.data(), bits.size() * 2);
    return t;
  };
  const Tensor a = bf16_tensor("a", m, k, 1);
  const Tensor w = bf16_tensor("w", n, k, 2);
  // `params` run window by window of `chunk` rows, from `source` into the same rows of `d` and `aux`.
  auto gemm_by_windows = [&](const Tensor& d, const Tensor& source, const ops::GemmParams& params,
                             const Tensor& bias_in, const Tensor& aux) {
    for (std::int64_t first = 0; first < m; first += chunk) {
      ops::GemmParams window = params;
      window.rows = chunk;
      window.a_row = first;
      window.d_row = first;
      ops::gemm_into_(ctx, d, source, w, window, bias_in, aux);
    }
  };
  const Tensor bias = ctx.persistent("bias", {Shape{n}, DType::kBFloat16});
  const ops::GemmParams fwd{.trans_b = true, .epilogue = kernels::GemmEpilogue::kGeluAuxBias};
  const ops::GemmResult whole = ops::gemm(ctx, a, w, fwd, bias);
  const Tensor act = ops::empty(ctx, {Shape{m, n}, DType::kBFloat16});
  const Tensor pre = ops::empty(ctx, {Shape{m, n}, DType::kBFloat16});
  gemm_by_windows(act, a, fwd, bias, pre);
  auto expect_near = [&](const Tensor& got, const Tensor& want, const char* what) {
    const std::vector<float> g = as_floats(ctx, got), e = as_floats(ctx, want);
    float scale = 0;
    const float worst = largest_difference(g, e, &scale);
    EXPECT_LE(worst, scale / 128) << what << ": largest difference " << worst << " of " << scale;
  };
  expect_near(act, whole.d, "GeLU output by windows");
  expect_near(pre, whole.aux, "pre-activation by windows");
  // The data gradient with GeLU's derivative: rows of dy into rows of d_pre,
  // each window reading its rows of the pre-activation.
  const Tensor dy = bf16_tensor("dy", m, n, 3);
  const Tensor pre_k = bf16_tensor("pre_k", m, k, 4);
  const ops::GemmParams bwd{.epilogue = kernels::GemmEpilogue::kDGeluBGrad};
  const ops::GemmResult dgelu = ops::gemm(ctx, dy, w, bwd, {}, pre_k);
  const Tensor d_pre = ops::empty(ctx, {Shape{m, k}, DType::kBFloat16});
  gemm_by_windows(d_pre, dy, bwd, {}, pre_k);
  expect_near(d_pre, dgelu.d, "GeLU's derivative by windows");
  // A fresh window of rows (pipelined's partial products).
  for (std::int64_t first = 0; first < m; first += chunk) {
    const Tensor rows = ops::gemm(ctx, a, w, {.trans_b = true, .rows = chunk, .a_row = first}).d;
    const Tensor all = ops::gemm(ctx, a, w, {.trans_b = true}).d;
    const std::vector<float> got = as_floats(ctx, rows);
    const std::vector<float> want = as_floats(ctx, all);
    const std::vector<float> want_rows(want.begin() + first * n, want.begin() + (first + chunk) * n);
    float scale = 0;
    EXPECT_LE(largest_difference(got, want_rows, &scale), scale / 128) << "rows from " << first;
  }
}

// One NCCL rank: every mode degenerates to the whole GEMMs and equals the
// plain layer bit for bit, captured and replayed.
TEST(OverlapModesCudaTest, EveryModeAtOneNcclRankEqualsThePlainLayer) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const TensorMeta meta{Shape{128, 256}, DType::kBFloat16};
  const Tensor x = ctx.persistent("x", meta);
  const Tensor dy = ctx.persistent("dy", meta);
  std::vector<std::uint16_t> bits;
  for (float v : normal_values(9, meta.numel())) bits.push_back(float_to_bf16(v));
  ctx.copy_from_host(x, bits.data(), bits.size() * 2);
  ctx.copy_from_host(dy, bits.data(), bits.size() * 2);
  auto run = [&](LayerNormMLP& layer, std::vector<Communicator*> comms) {
    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const LayerNormMLP::Forward f = layer.forward(ctx, {x});
                                         return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = comms});
    for (int i = 0; i < 10; ++i) graph->replay();
    std::vector<std::vector<std::uint16_t>> out;
    for (const Tensor& t : graph->outputs()) out.push_back(ctx.to_vector<std::uint16_t>(t));
    return out;
  };
  LayerNormMLP plain(ctx, "mlp", {.hidden = 256, .ffn = 1024}, kSeed);
  const auto want = run(plain, {});
  for (const char* mode : {"none", "bulk", "overlap"}) {
    LayerNormMLP layer(ctx, "mlp", {.hidden = 256, .ffn = 1024, .overlap = MLPOverlap::parse(mode)}, kSeed, comm.get());
    EXPECT_EQ(run(layer, {comm.get()}), want) << mode;
  }
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
