// Tensor- and sequence-parallel MultiheadAttention (Note [Tensor-parallel
// attention]) on host thread worlds of 2 and 4 ranks, against one rank on
// the same tokens: y and dx (each rank's token shard, or every token without
// sequence parallelism), every parameter gradient (the ranks' head slices of
// QKV and columns of the projection gathered back into the whole matrices,
// the replicated ones on every rank), for MHA and split GQA, with each
// overlap mode; eager equals graph bit for bit on every rank. The tokens are
// packed sequences of different lengths, one of a single token.
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
#include <string>
#include <vector>

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

// Writes a rank's [(H + 2 Hkv)/N D, cols] QKV slice into the whole [(H + 2 Hkv) D, cols] matrix.
void place_qkv_rows(std::vector<float>& whole, const std::vector<float>& slice, const Case& c, int rank,
                    std::int64_t cols) {
  const std::int64_t n = c.ranks;
  std::int64_t block_start = 0, local = 0;
  for (const std::int64_t block : {c.heads * kHeadDim, c.kv_heads * kHeadDim, c.kv_heads * kHeadDim}) {
    const std::int64_t part = block / n;
    std::copy(slice.begin() + local * cols, slice.begin() + (local + part) * cols,
              whole.begin() + (block_start + rank * part) * cols);
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
  const std::int64_t qkv_rows = (c.heads + 2 * c.kv_heads) * kHeadDim;
  const std::int64_t proj_in = c.heads * kHeadDim;
  // The ranks' QKV and projection gradients, gathered back (disjoint slices: no lock).
  std::vector<float> qkv_weight(reference.grads[2].size()), qkv_bias(reference.grads[3].size());
  std::vector<float> proj_weight(reference.grads[4].size());
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
    place_qkv_rows(qkv_weight, got.grads[2], c, r, kHidden);
    place_qkv_rows(qkv_bias, got.grads[3], c, r, 1);
    const std::int64_t cols = proj_in / n;
    for (std::int64_t row = 0; row < kHidden; ++row) {
      std::copy(got.grads[4].begin() + row * cols, got.grads[4].begin() + (row + 1) * cols,
                proj_weight.begin() + row * proj_in + r * cols);
    }
    ASSERT_EQ(got.grads[2].size(), static_cast<std::size_t>(qkv_rows / n * kHidden)) << who;

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
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const struct {
    int ranks;
    std::int64_t heads, kv_heads;
  } shapes[] = {{2, 4, 4}, {2, 4, 2}, {4, 4, 4}, {4, 8, 4}};
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
// in the fused q, k, v layout: checked on the values themselves.
TEST(TensorParallelAttentionInitTest, EachRankHoldsItsHeadsRowsOfTheOneRankWeights) {
  const Case c{2, 4, 2, true, CommOverlap::kBulk};
  std::vector<float> whole_weight, whole_bias;
  {
    Context ctx(Device::kHost);
    MultiheadAttention layer(ctx, "attn", config(c, false), kSeed);
    whole_weight = ctx.to_vector<float>(layer.parameters()[2]->master);
    whole_bias = ctx.to_vector<float>(layer.parameters()[3]->master);
  }
  std::vector<float> weight(whole_weight.size()), bias(whole_bias.size());
  HostWorld::run(2, [&](Communicator& comm) {
    Context ctx(Device::kHost);
    MultiheadAttention layer(ctx, "attn", config(c, true), kSeed, &comm);
    place_qkv_rows(weight, ctx.to_vector<float>(layer.parameters()[2]->master), c, comm.rank(), kHidden);
    place_qkv_rows(bias, ctx.to_vector<float>(layer.parameters()[3]->master), c, comm.rank(), 1);
  });
  EXPECT_EQ(weight, whole_weight);
  EXPECT_EQ(bias, whole_bias);
}

TEST(TensorParallelAttentionErrorsTest, HeadsThatDoNotSplitAreRefusedNamingHeadsKvHeadsAndTheTpSize) {
  auto build = [](int ranks, std::int64_t heads, std::int64_t kv_heads) {
    HostWorld::run(ranks, [&](Communicator& comm) {
      Context ctx(Device::kHost);
      MultiheadAttention layer(ctx, "attn", config({ranks, heads, kv_heads, true, CommOverlap::kBulk}, true), kSeed,
                               &comm);
    });
  };
  // heads 6 over 4 ranks.
  EXPECT_ERROR_CONTAINS(build(4, 6, 6), "heads 6", "tensor-parallel size 4");
  // kv_heads 2 over 4 ranks: the replicated case, not built.
  EXPECT_ERROR_CONTAINS(build(4, 4, 2), "heads 4", "kv_heads 2", "tensor-parallel size 4", "replicating");
  // MQA at TP 2.
  EXPECT_ERROR_CONTAINS(build(2, 4, 1), "kv_heads 1", "tensor-parallel size 2");
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
