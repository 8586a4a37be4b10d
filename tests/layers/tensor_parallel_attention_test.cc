// Tensor- and sequence-parallel MultiheadAttention (Note [Tensor-parallel
// attention]) on host thread worlds of 2 and 4 ranks, against one rank on
// the same tokens: y and dx (each rank's token shard, or every token without
// sequence parallelism), every parameter gradient (the ranks' head slices of
// QKV and columns of the projection gathered back into the whole matrices,
// the replicated ones on every rank), for MHA and split GQA, with each
// overlap mode, and with copies of kv heads where the ranks outnumber them
// (MQA, GQA), whose gradients must be equal bit for bit on the ranks sharing
// them; eager equals graph bit for bit on every rank. The tokens are packed
// sequences of different lengths, one of a single token.
//
// Tolerance: the projection's partial products over each rank's heads are
// added by a collective (and QKV's data gradients over the ranks' heads too),
// where one rank sums every head in one GEMM: the same fp32 terms in another
// order, about 1e-7 relative; pipelined adds them in ring order. We allow
// 1e-5 of the largest reference value; a wrong head slice, a doubled bias or
// a missing reduction is off by 1e-2 or more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "engine/fp8_recipe.h"
#include "engine/half_precision.h"
#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/multihead_attention.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::columns;
using testing::expect_close;
using testing::normal_values;
using testing::rows;

constexpr std::int64_t kTokens = 16;
constexpr std::int64_t kHidden = 32;
constexpr std::int64_t kHeadDim = 8;
constexpr std::uint32_t kSeed = 29;
// Four sequences of 5, 1, 7 and 3 tokens.
const std::vector<std::int32_t> kPacking{0, 5, 6, 13, 16};

struct Case {
  int ranks;
  std::int64_t heads, kv_heads;
  bool sequence_parallel;
  CommOverlap mode;  // every collective's (ring_exchange: the all-gathers', pipelined the reduce-scatters')
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "tp" + std::to_string(c.ranks) + "_h" + std::to_string(c.heads) + "_kv" + std::to_string(c.kv_heads) +
         (c.sequence_parallel ? "_sp_" : "_replicated_") +
         (c.mode == CommOverlap::kRingExchange ? std::string("overlapped") : std::string(comm_overlap_name(c.mode)));
}

MultiheadAttentionConfig config(const Case& c, bool split) {
  MultiheadAttentionConfig out{.hidden = kHidden,
                               .heads = c.heads,
                               .kv_heads = c.kv_heads,
                               .head_dim = kHeadDim,
                               .dtype = DType::kFloat32};
  if (split) {
    out.sequence_parallel = c.sequence_parallel;
    out.overlap = c.mode == CommOverlap::kRingExchange ? MLPOverlap::overlapped() : MLPOverlap::uniform(c.mode);
  }
  return out;
}

Tensor values_tensor(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t rows_) {
  const Tensor t = ctx.persistent(name, {Shape{rows_, kHidden}, DType::kFloat32});
  testing::write_values(ctx, t, values);
  return t;
}

Tensor packing(Context& ctx) {
  const Tensor t = ctx.persistent("cu_seqlens", {Shape{static_cast<std::int64_t>(kPacking.size())}, DType::kInt32});
  testing::write_values(ctx, t, kPacking);
  return t;
}

// y, dx and every parameter's gradient (norm gamma, beta, qkv weight, bias,
// proj weight, bias) of one forward and backward.
struct Result {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> grads;
};

Result run(Context& ctx, const MultiheadAttention& layer, const std::vector<Parameter*>& params, const Tensor& x,
           const Tensor& cu, const Tensor& dy) {
  const MultiheadAttention::Forward f = layer.forward(ctx, {x, cu});
  const Tensor dx = layer.backward(ctx, f.saved, {dy});
  Result r{ctx.to_vector<float>(f.y), ctx.to_vector<float>(dx), {}};
  for (const Parameter* p : params) r.grads.push_back(ctx.to_vector<float>(p->grad));
  return r;
}

// Ranks holding each kv head: 1 where the kv heads split over the ranks.
std::int64_t kv_copies(const Case& c) { return c.kv_heads % c.ranks == 0 ? 1 : c.ranks / c.kv_heads; }

// Rank `rank`'s rows of the whole [(H + 2 Hkv) D, cols] QKV matrix: its
// query heads, then its key and value heads (a copy where ranks share them).
std::vector<float> qkv_rows_of(const std::vector<float>& whole, const Case& c, int rank, std::int64_t cols) {
  std::vector<float> out;
  std::int64_t block_start = 0;
  for (const auto& [block, copies] : {std::pair{c.heads * kHeadDim, std::int64_t{1}},
                                      std::pair{c.kv_heads * kHeadDim, kv_copies(c)},
                                      std::pair{c.kv_heads * kHeadDim, kv_copies(c)}}) {
    const std::int64_t parts = c.ranks / copies;
    const std::int64_t first = block_start + (rank / copies) * (block / parts);
    out.insert(out.end(), whole.begin() + first * cols, whole.begin() + (first + block / parts) * cols);
    block_start += block;
  }
  return out;
}

// Writes a rank's QKV slice back into the whole matrix (the inverse of qkv_rows_of).
void place_qkv_rows(std::vector<float>& whole, const std::vector<float>& slice, const Case& c, int rank,
                    std::int64_t cols) {
  std::int64_t block_start = 0, local = 0;
  for (const auto& [block, copies] : {std::pair{c.heads * kHeadDim, std::int64_t{1}},
                                      std::pair{c.kv_heads * kHeadDim, kv_copies(c)},
                                      std::pair{c.kv_heads * kHeadDim, kv_copies(c)}}) {
    const std::int64_t part = block / (c.ranks / copies);
    std::copy(slice.begin() + local * cols, slice.begin() + (local + part) * cols,
              whole.begin() + (block_start + (rank / copies) * part) * cols);
    block_start += block;
    local += part;
  }
}

class TensorParallelAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelAttentionTest, RanksTogetherEqualOneRankAndGraphEqualsEager) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  const std::vector<float> x_all = normal_values(seed.value(), kTokens * kHidden);
  const std::vector<float> dy_all = normal_values(seed.value() + 1, kTokens * kHidden);
  Result reference;
  {
    Context ctx(Device::kHost);
    MultiheadAttention layer(ctx, "attn", config(c, false), kSeed);
    reference = run(ctx, layer, layer.parameters(), values_tensor(ctx, "x", x_all, kTokens), packing(ctx),
                    values_tensor(ctx, "dy", dy_all, kTokens));
  }
  const int n = c.ranks;
  const std::int64_t t = c.sequence_parallel ? kTokens / n : kTokens;
  const std::int64_t proj_in = c.heads * kHeadDim;
  // The ranks' QKV and projection gradients, gathered back (disjoint slices: no lock).
  std::vector<float> qkv_weight(reference.grads[2].size()), qkv_bias(reference.grads[3].size());
  std::vector<float> proj_weight(reference.grads[4].size());
  std::vector<std::vector<std::vector<float>>> rank_qkv_grads(static_cast<std::size_t>(c.ranks));
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    MultiheadAttention eager(ctx, "attn", config(c, true), kSeed, &comm);
    MultiheadAttention graphed(ctx, "attn", config(c, true), kSeed, &comm);
    const std::int64_t first = c.sequence_parallel ? r * t : 0;
    const Tensor x = values_tensor(ctx, "x", rows(x_all, kHidden, first, t), t);
    const Tensor dy = values_tensor(ctx, "dy", rows(dy_all, kHidden, first, t), t);
    const Tensor cu = packing(ctx);
    const Result got = run(ctx, eager, eager.parameters(), x, cu, dy);
    expect_close(got.y, rows(reference.y, kHidden, first, t), who + " y");
    expect_close(got.dx, rows(reference.dx, kHidden, first, t), who + " dx");
    expect_close(got.grads[0], reference.grads[0], who + " norm gamma grad");
    expect_close(got.grads[1], reference.grads[1], who + " norm beta grad");
    expect_close(got.grads[5], reference.grads[5], who + " proj bias grad");
    expect_close(got.grads[2], qkv_rows_of(reference.grads[2], c, r, kHidden), who + " qkv weight grad, its heads");
    expect_close(got.grads[3], qkv_rows_of(reference.grads[3], c, r, 1), who + " qkv bias grad, its heads");
    place_qkv_rows(qkv_weight, got.grads[2], c, r, kHidden);
    place_qkv_rows(qkv_bias, got.grads[3], c, r, 1);
    rank_qkv_grads[r] = {got.grads[2], got.grads[3]};
    const std::int64_t cols = proj_in / n;
    for (std::int64_t row = 0; row < kHidden; ++row) {
      std::copy(got.grads[4].begin() + row * cols, got.grads[4].begin() + (row + 1) * cols,
                proj_weight.begin() + row * proj_in + r * cols);
    }

    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const MultiheadAttention::Forward f = graphed.forward(ctx, {x, cu});
                                         return std::vector<Tensor>{f.y, graphed.backward(ctx, f.saved, {dy})};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    graph->replay();
    EXPECT_EQ(testing::bits(ctx.to_vector<float>(graph->outputs()[0])), testing::bits(got.y)) << who << " graph y";
    EXPECT_EQ(testing::bits(ctx.to_vector<float>(graph->outputs()[1])), testing::bits(got.dx)) << who << " graph dx";
    const std::vector<Parameter*> params = graphed.parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(testing::bits(ctx.to_vector<float>(params[i]->grad)), testing::bits(got.grads[i]))
          << who << " graph gradient " << params[i]->name;
    }
  });
  expect_close(qkv_weight, reference.grads[2], "qkv weight grad, the ranks' head rows gathered");
  expect_close(qkv_bias, reference.grads[3], "qkv bias grad, the ranks' head rows gathered");
  expect_close(proj_weight, reference.grads[4], "proj weight grad, the ranks' columns gathered");
  // Ranks sharing a kv head hold the same gradients for its copies, bit for
  // bit (and so the same copies after any optimizer step).
  const std::int64_t copies = kv_copies(c);
  for (int r = 0; r < c.ranks; ++r) {
    const int first = static_cast<int>(r / copies * copies);
    if (first == r) continue;
    const std::int64_t q_rows = c.heads * kHeadDim / c.ranks;
    for (std::size_t i = 0; i < 2; ++i) {
      const std::int64_t cols = i == 0 ? kHidden : 1;
      const std::vector<float>& mine = rank_qkv_grads[r][i];
      const std::vector<float>& theirs = rank_qkv_grads[first][i];
      EXPECT_EQ(testing::bits({mine.begin() + q_rows * cols, mine.end()}),
                testing::bits({theirs.begin() + q_rows * cols, theirs.end()}))
          << "rank " << r << " and rank " << first << ": the kv copies' " << (i == 0 ? "weight" : "bias")
          << " gradients differ";
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const struct {
    int ranks;
    std::int64_t heads, kv_heads;
  } shapes[] = {{2, 4, 4}, {2, 4, 2}, {4, 4, 4}, {4, 8, 4},
                // Copies of kv heads: MQA at 2 and 4 ranks, GQA of 2 kv heads at 4.
                {2, 4, 1}, {4, 4, 2}, {4, 4, 1}, {4, 8, 2}};
  for (const auto& s : shapes) {
    for (const CommOverlap mode : {CommOverlap::kNone, CommOverlap::kBulk, CommOverlap::kRingExchange}) {
      out.push_back({s.ranks, s.heads, s.kv_heads, true, mode});
    }
    out.push_back({s.ranks, s.heads, s.kv_heads, false, CommOverlap::kBulk});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelAttentionTest, ::testing::ValuesIn(cases()), case_name);

// The QKV weight a rank holds is its own heads' rows of the one-rank weight,
// in the fused q, k, v layout (with copies of kv heads, the same rows on the
// ranks that share them): checked on the values themselves.
TEST(TensorParallelAttentionInitTest, EachRankHoldsItsHeadsRowsOfTheOneRankWeights) {
  for (const Case c : {Case{2, 4, 2, true, CommOverlap::kBulk}, Case{4, 4, 2, true, CommOverlap::kBulk}}) {
    std::vector<float> whole_weight, whole_bias;
    {
      Context ctx(Device::kHost);
      MultiheadAttention layer(ctx, "attn", config(c, false), kSeed);
      whole_weight = ctx.to_vector<float>(layer.parameters()[2]->master);
      whole_bias = ctx.to_vector<float>(layer.parameters()[3]->master);
    }
    HostWorld::run(c.ranks, [&](Communicator& comm) {
      Context ctx(Device::kHost);
      MultiheadAttention layer(ctx, "attn", config(c, true), kSeed, &comm);
      const int r = comm.rank();
      EXPECT_EQ(ctx.to_vector<float>(layer.parameters()[2]->master), qkv_rows_of(whole_weight, c, r, kHidden))
          << "rank " << r << " of " << c.ranks;
      EXPECT_EQ(ctx.to_vector<float>(layer.parameters()[3]->master), qkv_rows_of(whole_bias, c, r, 1))
          << "rank " << r << " of " << c.ranks;
    });
  }
}

// FP8 projections (Note [FP8 Linear]) at TP 2 and 4, sequence-parallel, on
// bf16: a sliced tensor's amax (W's, the projection's input) is
// max-all-reduced, so each rank quantizes its slice with one rank's scale and
// every product over its own heads is one rank's, bit for bit: the QKV and
// projection weight and bias gradients. What is summed across the ranks after
// each partial was rounded to bf16 (y, dx, and through d_normed the norm's
// gradients) is held to 2e-2 of the largest reference value, as in
// fp8_tensor_parallel_test (N partials, each off by half a bf16 ulp).
TEST(TensorParallelAttentionFp8Test, SlicesEqualOneRankBitForBitAndSumsWithinBf16) {
  const testing::TestSeed seed;
  constexpr std::int64_t kT = 64, kH = 64, kD = 16;
  const std::vector<std::int32_t> pack{0, 20, 21, 50, 64};
  for (const int n : {2, 4}) {
    const MultiheadAttentionConfig fp8{.hidden = kH, .heads = 4, .kv_heads = 4 / (n == 2 ? 2 : 1), .head_dim = kD,
                                       .dtype = DType::kBFloat16, .fp8 = Fp8Recipe::current()};
    const Case c{n, fp8.heads, fp8.kv_heads, true, CommOverlap::kBulk};
    const std::vector<float> x_all = normal_values(seed.value(), kT * kH);
    const std::vector<float> dy_all = normal_values(seed.value() + 1, kT * kH);
    auto run_layer = [&](Context& ctx, const MultiheadAttention& layer, const std::vector<Parameter*>& params,
                         std::int64_t first, std::int64_t rows_) {
      const Tensor x = ctx.persistent("x", {Shape{rows_, kH}, DType::kBFloat16});
      const Tensor dy = ctx.persistent("dy", {Shape{rows_, kH}, DType::kBFloat16});
      const Tensor cu = ctx.persistent("cu_seqlens", {Shape{5}, DType::kInt32});
      testing::write_floats(ctx, x, rows(x_all, kH, first, rows_));
      testing::write_floats(ctx, dy, rows(dy_all, kH, first, rows_));
      testing::write_values(ctx, cu, pack);
      const MultiheadAttention::Forward f = layer.forward(ctx, {x, cu});
      const Tensor dx = layer.backward(ctx, f.saved, {dy});
      Result r{testing::read_floats(ctx, f.y), testing::read_floats(ctx, dx), {}};
      for (const Parameter* p : params) r.grads.push_back(ctx.to_vector<float>(p->grad));
      return r;
    };
    Result reference;
    {
      Context ctx(Device::kHost);
      MultiheadAttention layer(ctx, "attn", fp8, kSeed);
      reference = run_layer(ctx, layer, layer.parameters(), 0, kT);
    }
    MultiheadAttentionConfig split = fp8;
    split.overlap = MLPOverlap::uniform(CommOverlap::kBulk);
    HostWorld::run(n, [&](Communicator& comm) {
      const int r = comm.rank();
      const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n);
      Context ctx(Device::kHost, 2);
      ctx.set_communication_stream(2);
      MultiheadAttention layer(ctx, "attn", split, kSeed, &comm);
      const std::int64_t t = kT / n;
      const Result got = run_layer(ctx, layer, layer.parameters(), r * t, t);
      expect_close(got.y, rows(reference.y, kH, r * t, t), who + " y", 2e-2f);
      expect_close(got.dx, rows(reference.dx, kH, r * t, t), who + " dx", 2e-2f);
      expect_close(got.grads[0], reference.grads[0], who + " norm gamma grad", 2e-2f);
      expect_close(got.grads[1], reference.grads[1], who + " norm beta grad", 2e-2f);
      // The dot products over this rank's own heads: one rank's bits.
      auto qkv_rows = [&](const std::vector<float>& whole, std::int64_t cols) {
        std::vector<float> out;
        std::int64_t start = 0;
        for (const std::int64_t block : {c.heads * kD, c.kv_heads * kD, c.kv_heads * kD}) {
          const std::int64_t part = block / n;
          out.insert(out.end(), whole.begin() + (start + r * part) * cols,
                     whole.begin() + (start + (r + 1) * part) * cols);
          start += block;
        }
        return out;
      };
      EXPECT_EQ(testing::bits(got.grads[2]), testing::bits(qkv_rows(reference.grads[2], kH))) << who << " qkv weight";
      EXPECT_EQ(testing::bits(got.grads[3]), testing::bits(qkv_rows(reference.grads[3], 1))) << who << " qkv bias";
      EXPECT_EQ(testing::bits(got.grads[4]),
                testing::bits(columns(reference.grads[4], kH, c.heads * kD, r * c.heads * kD / n, c.heads * kD / n)))
          << who << " proj weight";
      EXPECT_EQ(testing::bits(got.grads[5]), testing::bits(reference.grads[5])) << who << " proj bias";
    });
  }
}

TEST(TensorParallelAttentionErrorsTest, HeadsThatDoNotSplitAreRefusedNamingHeadsKvHeadsAndTheTpSize) {
  auto build = [](int ranks, std::int64_t heads, std::int64_t kv_heads, std::optional<Fp8Recipe> fp8 = {}) {
    HostWorld::run(ranks, [&](Communicator& comm) {
      Context ctx(Device::kHost);
      MultiheadAttentionConfig split = config({ranks, heads, kv_heads, true, CommOverlap::kBulk}, true);
      split.fp8 = fp8;
      MultiheadAttention layer(ctx, "attn", split, kSeed, &comm);
    });
  };
  // heads 6 over 4 ranks.
  EXPECT_ERROR_CONTAINS(build(4, 6, 6), "heads 6", "tensor-parallel size 4");
  // kv_heads 3 and 4 ranks: neither divides the other.
  EXPECT_ERROR_CONTAINS(build(4, 12, 3), "heads 12", "kv_heads 3", "tensor-parallel size 4");
  // Copies of kv heads with FP8 projections.
  EXPECT_ERROR_CONTAINS(build(4, 4, 2, Fp8Recipe::current()), "kv_heads 2", "tensor-parallel size 4", "FP8");
}

TEST(TensorParallelAttentionErrorsTest, AChunkedOverlapWithoutSequenceParallelismIsRefused) {
  EXPECT_ERROR_CONTAINS(HostWorld::run(2,
                                       [](Communicator& comm) {
                                         Context ctx(Device::kHost);
                                         MultiheadAttention layer(
                                             ctx, "attn", config({2, 4, 4, false, CommOverlap::kRingExchange}, true),
                                             kSeed, &comm);
                                       }),
                        "ring_exchange");
}

// On the GPU, one rank through real NCCL: the layer's collectives are
// identities captured into the graph; replayed, the bf16 layer (tensor-core
// attention, head_dim 64) equals the plain layer bit for bit.
TEST(TensorParallelAttentionCudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainLayer) {
  SG_SKIP_WITHOUT_GPU();
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const MultiheadAttentionConfig bf16{.hidden = 256, .heads = 4, .kv_heads = 2, .dtype = DType::kBFloat16};
  MultiheadAttentionConfig split = bf16;
  split.overlap = MLPOverlap::overlapped();
  MultiheadAttention parallel(ctx, "attn", split, kSeed, comm.get());
  MultiheadAttention plain(ctx, "attn", bf16, kSeed);
  const TensorMeta meta{Shape{128, 256}, DType::kBFloat16};
  const Tensor x = ctx.persistent("x", meta);
  const Tensor dy = ctx.persistent("dy", meta);
  const testing::TestSeed seed;
  testing::write_floats(ctx, x, normal_values(seed.value(), meta.numel()));
  testing::write_floats(ctx, dy, normal_values(seed.value() + 1, meta.numel()));
  const Tensor cu = ctx.persistent("cu_seqlens", {Shape{4}, DType::kInt32});
  testing::write_values(ctx, cu, std::vector<std::int32_t>{0, 1, 77, 128});
  auto capture = [&](MultiheadAttention& layer, std::vector<Communicator*> comms) {
    return CapturedStep::capture(ctx,
                                 [&] {
                                   const MultiheadAttention::Forward f = layer.forward(ctx, {x, cu});
                                   return std::vector<Tensor>{f.y, layer.backward(ctx, f.saved, {dy})};
                                 },
                                 {.pool_report_policy = PoolReportPolicy::kError, .communicators = std::move(comms)});
  };
  auto with = capture(parallel, {comm.get()});
  auto without = capture(plain, {});
  for (int i = 0; i < 20; ++i) {
    with->replay();
    without->replay();
  }
  for (std::size_t o = 0; o < 2; ++o) {
    EXPECT_EQ(testing::raw_bytes(ctx, with->outputs()[o]), testing::raw_bytes(ctx, without->outputs()[o]))
        << "output " << o;
  }
  const std::vector<Parameter*> a = parallel.parameters();
  const std::vector<Parameter*> b = plain.parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(testing::raw_bytes(ctx, a[i]->grad), testing::raw_bytes(ctx, b[i]->grad)) << a[i]->name;
  }
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
