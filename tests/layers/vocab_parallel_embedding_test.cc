// The vocabulary-parallel Embedding (Note [Vocabulary-parallel embedding])
// on host thread worlds of 1, 2 and 4 ranks, against one rank's whole table
// on the same global tokens, bf16 and fp32, one token a row (the GPT's) and a
// window of three: each rank's table is the whole table's rows, its output
// the one-rank output's rows and its table gradient the one-rank gradient's
// rows, all bit for bit (no sum crosses ranks: the reduce-scatter adds -0.0
// to the owner's value); eager equals graph bit for bit on every rank; a
// token outside the vocabulary on one rank's rows sets the flag on every
// rank and embeds as zeros, as on one rank; errors. On the GPU, one NCCL
// rank, captured and replayed, equals the plain table bit for bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/embedding.h"
#include "tests/layers/one_rank_parity.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::raw_bytes;
using testing::rows;

constexpr std::int64_t kRows = 16;  // the rows every rank embeds together
constexpr std::int64_t kVocab = 32;
constexpr std::int64_t kDim = 8;
constexpr std::uint32_t kTableSeed = 5;

struct Case {
  int ranks;
  DType dtype;
  std::int64_t width;
};

std::string case_name(const Case& c) {
  return "tp" + std::to_string(c.ranks) + "_" + std::string(dtype_name(c.dtype)) + "_width" + std::to_string(c.width);
}

// Tokens in [0, kVocab) with many repeats (rows of every rank's slice).
std::vector<std::int32_t> random_tokens(std::uint32_t seed, std::int64_t count) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> pick(0, kVocab - 1);
  std::vector<std::int32_t> out(static_cast<std::size_t>(count));
  for (std::int32_t& t : out) t = pick(rng);
  return out;
}

Tensor int_tensor(Context& ctx, const std::string& name, const std::vector<std::int32_t>& values, std::int64_t cols) {
  const Tensor t =
      ctx.persistent(name, {Shape{static_cast<std::int64_t>(values.size()) / cols, cols}, DType::kInt32});
  testing::write_values(ctx, t, values);
  return t;
}

Tensor float_tensor(Context& ctx, const std::string& name, const std::vector<float>& values, std::int64_t cols,
                    DType dtype) {
  const Tensor t = ctx.persistent(name, {Shape{static_cast<std::int64_t>(values.size()) / cols, cols}, dtype});
  testing::write_floats(ctx, t, values);
  return t;
}

// What one forward and backward gives, as bytes.
struct Result {
  std::vector<std::uint8_t> table, y, grad;
  std::int32_t flag = 0;
};

Result run(Context& ctx, const Embedding& embedding, const Tensor& tokens, const Tensor& dy, const Tensor& flag) {
  const Embedding::Forward f = embedding.forward(ctx, {tokens, flag});
  embedding.backward(ctx, f.saved, {dy});
  return {raw_bytes(ctx, embedding.table().value), raw_bytes(ctx, f.y), raw_bytes(ctx, embedding.table().grad),
          ctx.to_vector<std::int32_t>(flag).at(0)};
}

// One rank's whole table on all the tokens.
Result reference(const Case& c, const std::vector<std::int32_t>& tokens, const std::vector<float>& dy) {
  Context ctx(Device::kHost);
  const Embedding embedding(ctx, "embedding", {.vocab = kVocab, .dim = kDim, .dtype = c.dtype}, kTableSeed);
  return run(ctx, embedding, int_tensor(ctx, "tokens", tokens, c.width),
             float_tensor(ctx, "dy", dy, c.width * kDim, c.dtype), ctx.persistent("flag", {Shape{1}, DType::kInt32}));
}

// Bytes [first, first + count) of `bytes` in units of `unit` bytes.
std::vector<std::uint8_t> slice(const std::vector<std::uint8_t>& bytes, std::int64_t unit, std::int64_t first,
                                std::int64_t count) {
  return rows(bytes, unit, first, count);
}

class VocabParallelEmbeddingTest : public ::testing::TestWithParam<Case> {};

TEST_P(VocabParallelEmbeddingTest, EveryRankHoldsAndComputesOneRanksRowsBitForBitAndItsGraphEqualsEager) {
  const Case c = GetParam();
  const int n = c.ranks;
  const testing::TestSeed seed;
  const std::vector<std::int32_t> tokens = random_tokens(seed.value(), kRows * c.width);
  const std::vector<float> dy = testing::normal_values(seed.value() + 1, kRows * c.width * kDim);
  const Result want = reference(c, tokens, dy);
  const std::int64_t local_rows = kRows / n;
  const std::int64_t row_bytes = c.width * kDim * static_cast<std::int64_t>(dtype_size(c.dtype));
  const std::int64_t table_row_bytes = kDim * static_cast<std::int64_t>(dtype_size(c.dtype));
  const std::int64_t grad_row_bytes = kDim * 4;
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who =
        "rank " + std::to_string(r) + " of " + std::to_string(n) + ", " + testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const EmbeddingConfig config{.vocab = kVocab, .dim = kDim, .dtype = c.dtype};
    const Embedding eager(ctx, "embedding", config, kTableSeed, &comm);
    const Embedding graphed(ctx, "embedding", config, kTableSeed, &comm);
    EXPECT_EQ(eager.local_vocab(), kVocab / n) << who;
    EXPECT_EQ(eager.vocab_offset(), r * kVocab / n) << who;
    EXPECT_EQ(eager.table().value.shape(), (Shape{kVocab / n, kDim})) << who;
    const Tensor my_tokens =
        int_tensor(ctx, "tokens", rows(tokens, c.width, r * local_rows, local_rows), c.width);
    const Tensor my_dy =
        float_tensor(ctx, "dy", rows(dy, c.width * kDim, r * local_rows, local_rows), c.width * kDim, c.dtype);
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});

    const Result got = run(ctx, eager, my_tokens, my_dy, flag);
    const std::int64_t v = kVocab / n;
    EXPECT_EQ(got.table, slice(want.table, table_row_bytes, r * v, v)) << who << ": the table's rows";
    EXPECT_EQ(got.y, slice(want.y, row_bytes, r * local_rows, local_rows)) << who << ": the output rows";
    EXPECT_EQ(got.grad, slice(want.grad, grad_row_bytes, r * v, v)) << who << ": the table gradient's rows";
    EXPECT_EQ(got.flag, 0) << who;

    auto graph = CapturedStep::capture(ctx,
                                       [&] {
                                         const Embedding::Forward f = graphed.forward(ctx, {my_tokens, flag});
                                         graphed.backward(ctx, f.saved, {my_dy});
                                         return std::vector<Tensor>{f.y};
                                       },
                                       {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    for (int replay = 0; replay < 2; ++replay) {
      graph->replay();
      EXPECT_EQ(raw_bytes(ctx, graph->outputs()[0]), got.y) << who << " replay " << replay << ": graph != eager";
      EXPECT_EQ(raw_bytes(ctx, graphed.table().grad), got.grad) << who << " replay " << replay << ": graph != eager";
    }
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0) << who;
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, VocabParallelEmbeddingTest,
                         ::testing::Values(Case{1, DType::kBFloat16, 1}, Case{2, DType::kBFloat16, 1},
                                           Case{4, DType::kBFloat16, 1}, Case{2, DType::kFloat32, 1},
                                           Case{4, DType::kFloat32, 3}, Case{2, DType::kBFloat16, 3}),
                         [](const auto& info) { return case_name(info.param); });

// A token outside [0, vocab) in rank 1's rows sets the flag on every rank,
// eager and replayed, embeds as one rank's zeros (+0.0) and adds to no
// gradient row, as on one rank.
TEST(VocabParallelEmbeddingTokensTest, AnOutOfRangeTokenSetsTheFlagOnEveryRankAndEmbedsAsOneRanksZeros) {
  constexpr int kRanks = 4;
  const Case c{kRanks, DType::kBFloat16, 1};
  const testing::TestSeed seed;
  std::vector<std::int32_t> tokens = random_tokens(seed.value(), kRows);
  tokens[5] = kVocab;  // one past the end, in rank 1's rows
  tokens[6] = -1;
  const std::vector<float> dy = testing::normal_values(seed.value() + 1, kRows * kDim);
  const Result want = reference(c, tokens, dy);
  ASSERT_EQ(want.flag, 1);
  constexpr std::int64_t kLocal = kRows / kRanks;
  HostWorld::run(kRanks, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + ", " + testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const Embedding embedding(ctx, "embedding", {.vocab = kVocab, .dim = kDim, .dtype = c.dtype}, kTableSeed, &comm);
    const Tensor my_tokens = int_tensor(ctx, "tokens", rows(tokens, 1, r * kLocal, kLocal), 1);
    const Tensor my_dy = float_tensor(ctx, "dy", rows(dy, kDim, r * kLocal, kLocal), kDim, c.dtype);
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
    const Result got = run(ctx, embedding, my_tokens, my_dy, flag);
    EXPECT_EQ(got.flag, 1) << who;
    EXPECT_EQ(got.y, slice(want.y, kDim * 2, r * kLocal, kLocal)) << who;
    constexpr std::int64_t v = kVocab / kRanks;
    EXPECT_EQ(got.grad, slice(want.grad, kDim * 4, r * v, v)) << who;

    const std::int32_t zero = 0;
    ctx.copy_from_host(flag, &zero, sizeof(zero));
    auto graph = CapturedStep::capture(
        ctx, [&] { return std::vector<Tensor>{embedding.forward(ctx, {my_tokens, flag}).y}; },
        {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0) << who << ": capturing runs nothing";
    graph->replay();
    EXPECT_EQ(raw_bytes(ctx, graph->outputs()[0]), got.y) << who;
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 1) << who << ": the replay sets the flag";
  });
}

TEST(VocabParallelEmbeddingErrorsTest, BadConfigsAndArgumentsAreClearErrors) {
  HostWorld::run(3, [](Communicator& comm) {
    Context ctx(Device::kHost);
    EXPECT_ERROR_CONTAINS(Embedding(ctx, "embedding", {.vocab = 32, .dim = 8}, 1, &comm), "Embedding 'embedding'",
                          "splits vocab 32 over the 3 ranks", "pad the vocabulary to a multiple of 3");
  });
  HostWorld::run(2, [](Communicator& comm) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const Embedding embedding(ctx, "embedding", {.vocab = kVocab, .dim = kDim, .dtype = DType::kFloat32}, 1, &comm);
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
    EXPECT_ERROR_CONTAINS(embedding.forward(ctx, {ctx.persistent("t", {Shape{4, 1}, DType::kFloat32}), flag}),
                          "Embedding 'embedding' forward", "tokens", "this rank's rows of the tokens");
    const Tensor tokens = ctx.persistent("tokens", {Shape{4, 1}, DType::kInt32});
    const Embedding::Forward f = embedding.forward(ctx, {tokens, flag});
    EXPECT_EQ(f.y.shape(), (Shape{4, kDim}));
    EXPECT_EQ(f.saved.tokens.shape(), (Shape{8, 1})) << "every rank's tokens, gathered";
    EXPECT_ERROR_CONTAINS(
        embedding.backward(ctx, f.saved, {ctx.persistent("dy", {Shape{8, kDim}, DType::kFloat32})}),
        "Embedding 'embedding' backward", "dy must be [4, 8]");
  });
}

// On the GPU, one rank through real NCCL: the all-gathers and the
// reduce-scatter are identities captured into the graph; replayed, the
// vocabulary-parallel table equals the plain one bit for bit.
TEST(VocabParallelEmbeddingCudaTest, OneNcclRankCapturedAndReplayedEqualsThePlainTable) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  constexpr std::int64_t kVocabGpu = 1024;
  constexpr std::int64_t kDimGpu = 256;
  constexpr std::int64_t kTokensGpu = 512;
  const EmbeddingConfig config{.vocab = kVocabGpu, .dim = kDimGpu};
  const Embedding parallel(ctx, "embedding", config, kTableSeed, comm.get());
  const Embedding plain(ctx, "embedding", config, kTableSeed);
  std::vector<std::int32_t> token_values(kTokensGpu);
  std::mt19937 rng(seed.value());
  for (std::int32_t& t : token_values) t = std::uniform_int_distribution<std::int32_t>(0, kVocabGpu - 1)(rng);
  const Tensor tokens = int_tensor(ctx, "tokens", token_values, 1);
  const Tensor dy =
      float_tensor(ctx, "dy", testing::normal_values(seed.value() + 1, kTokensGpu * kDimGpu), kDimGpu, config.dtype);
  const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});
  auto step = [&](const Embedding& e) {
    return [&] {
      const Embedding::Forward f = e.forward(ctx, {tokens, flag});
      e.backward(ctx, f.saved, {dy});
      return std::vector<Tensor>{f.y};
    };
  };
  const testing::ParityGraphs graphs(ctx, *comm, step(parallel), step(plain));
  graphs.replay(3);
  EXPECT_EQ(raw_bytes(ctx, graphs.with->outputs()[0]), raw_bytes(ctx, graphs.without->outputs()[0]));
  EXPECT_EQ(raw_bytes(ctx, parallel.table().grad), raw_bytes(ctx, plain.table().grad));
  EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0);
  comm->check_health();
}

}  // namespace
}  // namespace stepgraph
