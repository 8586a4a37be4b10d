// The GPT LanguageModel (heads > 0) at tensor parallelism on host thread
// worlds of 2 and 4 ranks, against one rank on the same tokens: every rank's
// tokens are its rows of the batch (a vocabulary-parallel embedding, Note
// [Vocabulary-parallel embedding]), cu_seqlens the packing of the whole
// batch, variable lengths with a sequence of one token and sequences that
// span ranks; and the window model (heads = 0), each rank on its rows of
// examples. Each rank holds its rows of the embedding table; its loss, its
// logits columns and the gradients of its embedding rows, its head rows and
// the replicated final norm match one rank's; eager equals graph bit for bit
// on every rank.
//
// Tolerance: the embedding's own sums do not cross ranks, but what reaches
// it does: the attention projection's and fc2's partial sums are
// reduce-scattered (the same terms as one rank's GEMM in another fp32
// order), the head's dx and the cross-entropy's sum of exponentials are
// split over the vocabulary, the norms' gradients are all-reduced. Each is a
// few fp32 roundings (about 1e-7 relative) per layer; we allow 1e-5 of each
// tensor's largest reference value and 1e-6 relative on the loss. A wrong
// slice, a missing reduction or a mis-packed sequence is off by 1e-2 or more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/language_model.h"
#include "tests/layers/shard_values.h"
#include "tests/layers/tensor_io.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

using testing::columns;
using testing::rows;

constexpr std::int64_t kTokens = 32;
constexpr std::int64_t kVocab = 32;
constexpr std::int64_t kHidden = 32;
// Sequences of 1, 7, 5, 12 and 7 tokens: rank boundaries (every 16 or 8
// tokens) fall inside sequences.
const std::vector<std::int32_t> kPacking = {0, 1, 8, 13, 25, 32};

struct Case {
  int ranks;
  std::int64_t kv_heads;  // 2: grouped-query attention, kv heads split over 2 ranks
  const char* overlap;
  std::int64_t heads = 4;  // 0: the window model, on kTokens examples of kWindow tokens
};

constexpr std::int64_t kWindow = 4;

// Tokens per row, and the embedding's width.
std::int64_t width(const Case& c) { return c.heads > 0 ? 1 : kWindow; }
std::int64_t embedding_dim(const Case& c) { return kHidden / width(c); }

LanguageModelConfig gpt(const Case& c) {
  return {.model = {.hidden = kHidden,
                    .ffn = 64,
                    .layers = 2,
                    .vocab = kVocab,
                    .dtype = DType::kFloat32,
                    .seed = 11,
                    .heads = c.heads,
                    .kv_heads = c.kv_heads,
                    .overlap = MLPOverlap::parse(c.overlap)},
          .context = c.heads > 0 ? 8 : kWindow};
}

Tensor ints(Context& ctx, const std::string& name, const std::vector<std::int32_t>& values, Shape shape) {
  const Tensor t = ctx.persistent(name, {std::move(shape), DType::kInt32});
  testing::write_values(ctx, t, values);
  return t;
}

// What one forward, loss and backward gives: the loss, the logits, and the
// gradients of the embedding table, the final norm (gamma, beta) and the
// head, in fp32.
struct Result {
  float loss = NAN;
  std::vector<float> logits, embedding, norm, head;
};

// The parameters LanguageModel::parameters() lists around the stack's: the
// embedding table first, the final norm's gamma and beta and the head last.
Result run(Context& ctx, LanguageModel& model, const Tensor& tokens, const Tensor& labels, const Tensor& cu,
           const Tensor& flag) {
  const LanguageModel::Forward f = model.forward(ctx, tokens, flag, cu);
  const ResidualStack& stack = model.stack();
  const ops::CrossEntropyResult ce = stack.loss(ctx, f.logits, stack.gather_labels(ctx, labels), flag);
  model.backward(ctx, f.saved, ce.dlogits);
  const std::vector<Parameter*> p = model.parameters();
  Result out{ctx.to_vector<float>(ce.loss).at(0), ctx.to_vector<float>(f.logits), ctx.to_vector<float>(p[0]->grad),
             ctx.to_vector<float>(p[p.size() - 3]->grad), ctx.to_vector<float>(p.back()->grad)};
  const std::vector<float> beta = ctx.to_vector<float>(p[p.size() - 2]->grad);
  out.norm.insert(out.norm.end(), beta.begin(), beta.end());
  return out;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  testing::expect_close(got, want, what, 1e-5f, 1e-3f);
}

class LanguageModelTensorParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(LanguageModelTensorParallelTest, EveryRankMatchesOneRankAndItsGraphEqualsEager) {
  const Case c = GetParam();
  const int n = c.ranks;
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  std::uniform_int_distribution<std::int32_t> id(0, kVocab - 1);
  std::vector<std::int32_t> tokens(kTokens * width(c)), labels(kTokens);
  for (std::int32_t& t : tokens) t = id(rng);
  for (std::int32_t& l : labels) l = id(rng);
  const Shape cu_shape{static_cast<std::int64_t>(kPacking.size())};
  // The packing of the GPT's sequences; the window model has none.
  const auto packing = [&](Context& ctx) { return c.heads > 0 ? ints(ctx, "cu", kPacking, cu_shape) : Tensor{}; };
  Result want;
  {
    Context ctx(Device::kHost, 2);
    LanguageModel model(ctx, gpt(c));
    want = run(ctx, model, ints(ctx, "tokens", tokens, Shape{kTokens, width(c)}),
               ints(ctx, "labels", labels, Shape{kTokens}), packing(ctx),
               ctx.persistent("flag", {Shape{1}, DType::kInt32}));
  }
  const std::int64_t t = kTokens / n;
  const std::int64_t v = kVocab / n;
  HostWorld::run(n, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(n) + " (heads " +
                            std::to_string(c.heads) + ", kv_heads " +
                            std::to_string(c.kv_heads) + ", " + c.overlap + "), " + testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModel eager(ctx, gpt(c), &comm);
    LanguageModel graphed(ctx, gpt(c), &comm);
    const Tensor my_tokens = ints(ctx, "tokens", rows(tokens, width(c), r * t, t), Shape{t, width(c)});
    const Tensor my_labels = ints(ctx, "labels", rows(labels, 1, r * t, t), Shape{t});
    const Tensor cu = packing(ctx);
    EXPECT_EQ(eager.parameters()[0]->value.shape(), (Shape{v, embedding_dim(c)})) << who << ": the table's rows";
    const Tensor flag = ctx.persistent("flag", {Shape{1}, DType::kInt32});

    const Result got = run(ctx, eager, my_tokens, my_labels, cu, flag);
    EXPECT_NEAR(got.loss, want.loss, 1e-6 * std::abs(want.loss)) << who << ": loss";
    expect_close(got.logits, columns(want.logits, kTokens, kVocab, r * v, v), who + ": logits columns");
    expect_close(got.embedding, rows(want.embedding, embedding_dim(c), r * v, v), who + ": embedding gradient rows");
    expect_close(got.head, rows(want.head, kHidden, r * v, v), who + ": head gradient rows");
    expect_close(got.norm, want.norm, who + ": final norm gradient (replicated)");
    EXPECT_EQ(ctx.to_vector<std::int32_t>(flag).at(0), 0) << who;

    auto graph = CapturedStep::capture(ctx, [&] {
      const LanguageModel::Forward f = graphed.forward(ctx, my_tokens, flag, cu);
      const ResidualStack& stack = graphed.stack();
      const ops::CrossEntropyResult ce = stack.loss(ctx, f.logits, stack.gather_labels(ctx, my_labels), flag);
      graphed.backward(ctx, f.saved, ce.dlogits);
      return std::vector<Tensor>{ce.loss, f.logits};
    }, {.pool_report_policy = PoolReportPolicy::kError, .communicators = {&comm}});
    for (int replay = 0; replay < 2; ++replay) {
      graph->replay();
      const std::string when = who + " replay " + std::to_string(replay) + ": graph != eager";
      EXPECT_EQ(testing::bits(ctx.to_vector<float>(graph->outputs()[0])), testing::bits({got.loss})) << when;
      EXPECT_EQ(testing::bits(ctx.to_vector<float>(graph->outputs()[1])), testing::bits(got.logits)) << when;
      const std::vector<Parameter*> pe = eager.parameters();
      const std::vector<Parameter*> pg = graphed.parameters();
      ASSERT_EQ(pe.size(), pg.size());
      for (std::size_t i = 0; i < pe.size(); ++i) {
        EXPECT_EQ(testing::raw_bytes(ctx, pg[i]->grad), testing::raw_bytes(ctx, pe[i]->grad))
            << when << " (gradient of " << pg[i]->name << ")";
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, LanguageModelTensorParallelTest,
                         ::testing::Values(Case{2, 2, "bulk"}, Case{2, 0, "overlap"}, Case{4, 0, "none"},
                                           Case{4, 4, "overlap"}, Case{2, 0, "bulk", 0}, Case{4, 0, "overlap", 0}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.ranks) + "_heads" +
                                  std::to_string(info.param.heads) + "_kv" +
                                  std::to_string(info.param.kv_heads) + "_" + info.param.overlap;
                         });

TEST(LanguageModelTensorParallelErrorsTest, AVocabularyThatDoesNotDivideByTheRanksIsAClearError) {
  HostWorld::run(3, [](Communicator& comm) {
    Context ctx(Device::kHost);
    LanguageModelConfig config = gpt({3, 0, "none"});
    config.model.vocab = 44;
    EXPECT_ERROR_CONTAINS(LanguageModel(ctx, config, &comm), "Embedding 'embedding'", "splits vocab 44 over the 3 ranks",
                          "pad the vocabulary to a multiple of 3");
  });
}

}  // namespace
}  // namespace stepgraph
