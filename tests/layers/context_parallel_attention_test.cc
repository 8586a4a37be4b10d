// Context-parallel attention (Note [Context-parallel attention by
// all-gather] in layers/context_parallel_attention.h) on host thread worlds
// of 2 and 4 ranks, against one rank's self-attention ops over the whole
// batch: each rank holds its zig-zag chunks of the global q, k, v and dout.
//
// What must be equal, and why:
// - out, lse and dq bit for bit: every query sees the same keys in the same
//   order as on one rank, and its sums are all local (no sum crosses ranks).
// - dk and dv within a tolerance: each rank's partial sums (over its own
//   queries) are rounded to the dtype and added by the reduce-scatter, where
//   one rank adds every query's term into one fp32 sum. fp32: only the order
//   of the additions differs (measured up to 5e-7 of the tensor's largest
//   value); we allow 1e-5. bf16: each of the N <= 4 partials is rounded (half
//   an ulp, 2^-9 relative to the partial, and partials of opposite signs can
//   exceed their sum) and the sum is rounded once more (measured up to 7e-3
//   of the largest value); we allow 2e-2 (a missing rank's partial or a
//   misplaced chunk is off by O(1)).
// - eager == graph bit for bit on every rank (the plan, gathers, reorders,
//   segment attention and reduce-scatters are ops, replayed).
// Packings: one sequence spanning every rank, a one-token sequence among
// others, several short ones (some inside one chunk), and a random one; the
// seed prints on failure. On the GPU, one NCCL rank: captured and replayed
// equals eager bit for bit, and the plain self-attention within 1e-5 (fp32).
#include "layers/context_parallel_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::raw_bytes;
using testing::read_floats;

constexpr std::int64_t kTokens = 48;  // divides by 2 x 4
constexpr std::int64_t kHeads = 4;
constexpr std::int64_t kKvHeads = 2;
constexpr std::int64_t kDim = 8;

struct Packing {
  const char* name;
  std::vector<std::int32_t> lengths;  // sum kTokens; empty: random
};

struct Case {
  int ranks;
  DType dtype;
  bool causal;
  Packing packing;
};

std::string case_name(const Case& c) {
  return "cp" + std::to_string(c.ranks) + "_" + std::string(dtype_name(c.dtype)) + (c.causal ? "_causal_" : "_full_") +
         c.packing.name;
}

std::vector<std::int32_t> offsets_of(const Packing& packing, std::uint32_t seed) {
  std::vector<std::int32_t> lengths = packing.lengths;
  if (lengths.empty()) {
    std::mt19937 rng(seed);
    for (std::int32_t total = 0; total < kTokens;) {
      const auto l = std::min<std::int32_t>(kTokens - total, 1 + static_cast<std::int32_t>(rng() % 13));
      lengths.push_back(l);
      total += l;
    }
  }
  std::vector<std::int32_t> cu{0};
  for (std::int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

// The global batch's values.
struct Batch {
  std::vector<std::int32_t> cu;
  std::vector<float> q, k, v, dout;
};

Batch make_batch(const Case& c, std::uint32_t seed) {
  return {offsets_of(c.packing, seed), testing::normal_values(seed + 1, kTokens * kHeads * kDim),
          testing::normal_values(seed + 2, kTokens * kKvHeads * kDim),
          testing::normal_values(seed + 3, kTokens * kKvHeads * kDim),
          testing::normal_values(seed + 4, kTokens * kHeads * kDim)};
}

ops::AttentionParams params_of(const Case& c) {
  return {.heads = kHeads, .kv_heads = kKvHeads, .head_dim = kDim, .causal = c.causal};
}

Tensor float_tensor(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t cols,
                    DType dtype) {
  const Tensor t = ctx.persistent(name, {Shape{static_cast<std::int64_t>(values.size()) / cols, cols}, dtype});
  testing::write_floats(ctx, t, values);
  return t;
}

Tensor int_tensor(Context& ctx, const std::string& name, const std::vector<std::int32_t>& values) {
  const Tensor t = ctx.persistent(name, {Shape{static_cast<std::int64_t>(values.size())}, DType::kInt32});
  testing::write_values(ctx, t, values);
  return t;
}

// out, lse, dq, dk, dv as fp32 values (exact for 16-bit dtypes).
struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

Result read(Context& ctx, const std::vector<Tensor>& t) {
  return {read_floats(ctx, t[0]), read_floats(ctx, t[1]), read_floats(ctx, t[2]), read_floats(ctx, t[3]),
          read_floats(ctx, t[4])};
}

// One rank's self-attention over the whole batch.
Result reference(const Case& c, const Batch& b) {
  Context ctx(Device::kHost);
  const Tensor q = float_tensor(ctx, "q", b.q, kHeads * kDim, c.dtype);
  const Tensor k = float_tensor(ctx, "k", b.k, kKvHeads * kDim, c.dtype);
  const Tensor v = float_tensor(ctx, "v", b.v, kKvHeads * kDim, c.dtype);
  const Tensor dout = float_tensor(ctx, "dout", b.dout, kHeads * kDim, c.dtype);
  const Tensor cu = int_tensor(ctx, "cu_seqlens", b.cu);
  const ops::AttentionForward f = ops::attention_forward(ctx, params_of(c), q, k, v, cu);
  const ops::AttentionGrads g = ops::attention_backward(ctx, params_of(c), q, k, v, f.out, f.lse, dout, cu);
  return read(ctx, {f.out, f.lse, g.dq, g.dk, g.dv});
}

// Rank r's rows of a [kTokens, cols] matrix: chunk r, then chunk 2N - 1 - r.
std::vector<float> local_rows(const std::vector<float>& m, std::int64_t cols, int ranks, int rank) {
  const std::int64_t chunk = kTokens / (2 * ranks);
  std::vector<float> out = testing::rows(m, cols, rank * chunk, chunk);
  const std::vector<float> second = testing::rows(m, cols, (2 * ranks - 1 - rank) * chunk, chunk);
  out.insert(out.end(), second.begin(), second.end());
  return out;
}

// Rank r's columns of lse [H, kTokens].
std::vector<float> local_lse(const std::vector<float>& lse, int ranks, int rank) {
  std::vector<float> out;
  for (std::int64_t h = 0; h < kHeads; ++h) {
    const std::vector<float> row = testing::rows(lse, kTokens, h, 1);
    const std::vector<float> mine = local_rows(row, 1, ranks, rank);
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

double tolerance(DType dtype) { return dtype == DType::kFloat32 ? 1e-5 : 2e-2; }

class ContextParallelAttentionTest : public ::testing::TestWithParam<Case> {};

TEST_P(ContextParallelAttentionTest, EqualsOneRankOverTheWholeBatchAndItsGraphEqualsEager) {
  const Case c = GetParam();
  const int n = c.ranks;
  const testing::TestSeed seed;
  const Batch batch = make_batch(c, seed.value());
  const Result want = reference(c, batch);
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n) + ", " + case_name(c) + ", " +
                            testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const Tensor q = float_tensor(ctx, "q", local_rows(batch.q, kHeads * kDim, n, r), kHeads * kDim, c.dtype);
    const Tensor k = float_tensor(ctx, "k", local_rows(batch.k, kKvHeads * kDim, n, r), kKvHeads * kDim, c.dtype);
    const Tensor v = float_tensor(ctx, "v", local_rows(batch.v, kKvHeads * kDim, n, r), kKvHeads * kDim, c.dtype);
    const Tensor dout = float_tensor(ctx, "dout", local_rows(batch.dout, kHeads * kDim, n, r), kHeads * kDim, c.dtype);
    const Tensor cu = int_tensor(ctx, "cu_seqlens", batch.cu);
    const ops::AttentionParams params = params_of(c);
    auto step = [&] {
      const ops::ContextParallelPlan plan =
          ops::context_parallel_plan(ctx, {.ranks = n, .rank = r, .tokens = kTokens, .causal = c.causal}, cu);
      const ops::AttentionForward f = context_parallel_attention_forward(ctx, comm, params, plan, q, k, v);
      const ops::AttentionGrads g =
          context_parallel_attention_backward(ctx, comm, params, plan, q, k, v, f.out, f.lse, dout);
      return std::vector<Tensor>{f.out, f.lse, g.dq, g.dk, g.dv};
    };
    const std::vector<Tensor> eager = step();
    const Result got = read(ctx, eager);
    EXPECT_EQ(testing::bits(got.out), testing::bits(local_rows(want.out, kHeads * kDim, n, r))) << who << ": out";
    EXPECT_EQ(testing::bits(got.lse), testing::bits(local_lse(want.lse, n, r))) << who << ": lse";
    EXPECT_EQ(testing::bits(got.dq), testing::bits(local_rows(want.dq, kHeads * kDim, n, r))) << who << ": dq";
    testing::expect_close(got.dk, local_rows(want.dk, kKvHeads * kDim, n, r), who + ": dk",
                          static_cast<float>(tolerance(c.dtype)), 0.0f);
    testing::expect_close(got.dv, local_rows(want.dv, kKvHeads * kDim, n, r), who + ": dv",
                          static_cast<float>(tolerance(c.dtype)), 0.0f);

    std::vector<std::vector<std::uint8_t>> eager_bytes;
    for (const Tensor& t : eager) eager_bytes.push_back(raw_bytes(ctx, t));
    auto graph =
        CapturedStep::capture(ctx, step, {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    for (int replay = 0; replay < 2; ++replay) {
      graph->replay();
      for (std::size_t i = 0; i < eager.size(); ++i) {
        EXPECT_EQ(raw_bytes(ctx, graph->outputs()[i]), eager_bytes[i])
            << who << " replay " << replay << ": graph != eager for output " << i << " (out, lse, dq, dk, dv)";
      }
    }
  });
}

const Packing kSpanning{"one_sequence_over_every_rank", {kTokens}};
const Packing kOneToken{"with_a_one_token_sequence", {5, 1, 30, 12}};
const Packing kShort{"short_sequences", {3, 2, 1, 4, 2, 6, 5, 1, 3, 7, 2, 4, 8}};
const Packing kRandom{"random", {}};

INSTANTIATE_TEST_SUITE_P(
    Worlds, ContextParallelAttentionTest,
    ::testing::Values(Case{2, DType::kFloat32, true, kSpanning}, Case{4, DType::kFloat32, true, kSpanning},
                      Case{2, DType::kFloat32, true, kOneToken}, Case{4, DType::kFloat32, true, kOneToken},
                      Case{2, DType::kFloat32, true, kShort}, Case{4, DType::kFloat32, true, kShort},
                      Case{4, DType::kFloat32, true, kRandom}, Case{2, DType::kFloat32, false, kOneToken},
                      Case{4, DType::kFloat32, false, kRandom}, Case{2, DType::kBFloat16, true, kSpanning},
                      Case{4, DType::kBFloat16, true, kOneToken}, Case{4, DType::kBFloat16, true, kShort}),
    [](const auto& info) { return case_name(info.param); });

TEST(ContextParallelAttentionErrorsTest, BadPlansAndBatchesAreClearErrors) {
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const Tensor cu = int_tensor(ctx, "cu_seqlens", {0, 10, 30});
    EXPECT_ERROR_CONTAINS(ops::context_parallel_plan(ctx, {.ranks = 2, .rank = comm.rank(), .tokens = 30}, cu),
                          "30 tokens", "2 x 2 = 4 equal chunks", "pad the batch to a multiple of 4");
    const ops::AttentionParams params{.heads = 2, .kv_heads = 2, .head_dim = 4};
    const Tensor q = ctx.persistent("q", {Shape{8, 8}, DType::kFloat32});
    const Tensor cu16 = int_tensor(ctx, "cu16", {0, 10, 16});
    const ops::ContextParallelPlan other_rank =
        ops::context_parallel_plan(ctx, {.ranks = 2, .rank = 1 - comm.rank(), .tokens = 16}, cu16);
    EXPECT_ERROR_CONTAINS(context_parallel_attention_forward(ctx, comm, params, other_rank, q, q, q),
                          "context-parallel attention forward", "the plan is for rank", ".rank = cp.rank()");
    const ops::ContextParallelPlan full =
        ops::context_parallel_plan(ctx, {.ranks = 2, .rank = comm.rank(), .tokens = 16, .causal = false}, cu16);
    EXPECT_ERROR_CONTAINS(context_parallel_attention_forward(ctx, comm, params, full, q, q, q),
                          "the plan is for non-causal attention", "params.causal is true");
    const ops::ContextParallelPlan plan = ops::context_parallel_plan(
        ctx, {.ranks = 2, .rank = comm.rank(), .tokens = 32}, int_tensor(ctx, "cu32", {0, 10, 32}));
    EXPECT_ERROR_CONTAINS(context_parallel_attention_forward(ctx, comm, params, plan, q, q, q),
                          "q must hold this rank's 16 of the plan's 32 tokens");
  });
}

// On the GPU, one NCCL rank (CP = 1: the gathers and the reduce-scatters are
// identities, the segments the sequences): captured and replayed equals eager
// bit for bit, and the plain self-attention (fp32: the same arithmetic,
// other kernels) within 1e-5.
TEST(ContextParallelAttentionCudaTest, OneNcclRankCapturedEqualsEagerAndSelfAttention) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  const Case c{1, DType::kFloat32, true, kOneToken};
  const Batch batch = make_batch(c, seed.value());
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  const Tensor q = float_tensor(ctx, "q", batch.q, kHeads * kDim, c.dtype);
  const Tensor k = float_tensor(ctx, "k", batch.k, kKvHeads * kDim, c.dtype);
  const Tensor v = float_tensor(ctx, "v", batch.v, kKvHeads * kDim, c.dtype);
  const Tensor dout = float_tensor(ctx, "dout", batch.dout, kHeads * kDim, c.dtype);
  const Tensor cu = int_tensor(ctx, "cu_seqlens", batch.cu);
  const ops::AttentionParams params = params_of(c);
  auto step = [&] {
    const ops::ContextParallelPlan plan =
        ops::context_parallel_plan(ctx, {.ranks = 1, .rank = 0, .tokens = kTokens}, cu);
    const ops::AttentionForward f = context_parallel_attention_forward(ctx, *comm, params, plan, q, k, v);
    const ops::AttentionGrads g =
        context_parallel_attention_backward(ctx, *comm, params, plan, q, k, v, f.out, f.lse, dout);
    return std::vector<Tensor>{f.out, f.lse, g.dq, g.dk, g.dv};
  };
  const std::vector<Tensor> eager = step();
  std::vector<std::vector<std::uint8_t>> eager_bytes;
  for (const Tensor& t : eager) eager_bytes.push_back(raw_bytes(ctx, t));
  const Result got = read(ctx, eager);
  const ops::AttentionForward f = ops::attention_forward(ctx, params, q, k, v, cu);
  const ops::AttentionGrads g = ops::attention_backward(ctx, params, q, k, v, f.out, f.lse, dout, cu);
  const Result want = read(ctx, {f.out, f.lse, g.dq, g.dk, g.dv});
  testing::expect_close(got.out, want.out, "out");
  testing::expect_close(got.lse, want.lse, "lse");
  testing::expect_close(got.dq, want.dq, "dq");
  testing::expect_close(got.dk, want.dk, "dk");
  testing::expect_close(got.dv, want.dv, "dv");
  auto graph =
      CapturedStep::capture(ctx, step, {.pool_report_policy = PoolReportPolicy::kError, .communicators = {comm.get()}});
  for (int replay = 0; replay < 2; ++replay) {
    graph->replay();
    for (std::size_t i = 0; i < eager.size(); ++i) {
      EXPECT_EQ(raw_bytes(ctx, graph->outputs()[i]), eager_bytes[i]) << "replay " << replay << " output " << i;
    }
  }
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
