// The GPT LanguageModel (vocabulary-parallel embedding, attention heads and
// ffn split, vocabulary-parallel head) trained by TrainStep on packed
// variable-length sequences over host thread worlds of TP=2, TP=4, CP=2,
// CP=4 and the 2-D TP=2 x DP=2, TP=2 x CP=2 and CP=2 x DP=2 (tensor groups
// of consecutive ranks, context groups across them, data groups across
// both), against one process on the whole global batch over 4 AdamW steps.
// Each data-parallel group trains on its half of the batch; inside it each
// context-parallel rank holds its zig-zag chunks of the group's tokens
// (Note [Context-parallel token layout]), each tensor-parallel rank its rows
// of those, and every rank the packing of all the group's tokens, with
// sequences of one token, sequences that span the ranks' rows and one that
// spans every context-parallel rank; the packings change from step to step
// without a new capture. Every step's loss matches one
// process's; after the steps the embedding rows, the head rows and the
// final norm do; eager equals graph bit for bit on every rank, the losses
// and every parameter.
//
// Tolerance: the ranks add the same fp32 terms as one process in another
// order wherever a sum crosses ranks (the row-parallel projections' partial
// sums, the column-parallel layers' data gradients, the split softmax sums,
// the norms' all-reduced gradients, the data- and context-parallel gradient
// sums, context-parallel attention's reduce-scattered dK and dV partials),
// about 1e-7 relative per step; the embedding's own lookup and gradient do
// not (Note [Vocabulary-parallel embedding]), nor do context-parallel
// attention's out, lse and dq (one rank's bits: Note [Context-parallel
// attention by all-gather]) or the rotary positions (exact integers). We
// allow 1e-5 relative on each step's loss and 1e-5 absolute on the
// parameters after 4 steps of lr 1e-3. AdamW's eps is 1e-5: with the
// default 1e-8 an element whose gradient is within rounding of zero (an
// embedding row's, seen by few tokens) is normalised to a step of up to lr
// whose size and sign the rounding decides, 6e-5 apart in about one run in
// 20; with eps 1e-5 a gradient difference d moves it by at most lr d / eps,
// about 1e-7 for rounding-level d, and an ordinary gradient still moves it
// by about lr. A wrong slice, a missing reduction, wrong rotary positions
// or a packing of the rank's rows alone is off by 1e-3 or more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/language_model.h"
#include "optim/adamw.h"
#include "tests/layers/world_steps.h"
#include "tests/support/seed.h"
#include "train/context_parallel_batch.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kTokens = 32;  // the global batch
constexpr std::int64_t kVocab = 32;
constexpr std::int64_t kHidden = 32;
constexpr std::int64_t kSequences = 8;  // packing slots: the most sequences a step's tokens hold
constexpr int kSteps = 4;

struct Case {
  int tp;
  int dp;
  std::int64_t kv_heads;
  const char* overlap;
  DataParallelMode mode = DataParallelMode::kAllReduce;
  int cp = 1;
};

LanguageModelConfig gpt(const Case& c) {
  return {.model = {.hidden = kHidden,
                    .ffn = 64,
                    .layers = 2,
                    .vocab = kVocab,
                    .dtype = DType::kFloat32,
                    .seed = 23,
                    .heads = 4,
                    .kv_heads = c.kv_heads,
                    .overlap = MLPOverlap::parse(c.overlap)},
          .context = 8};
}

// Sequence starts of a half batch (16 tokens): 1, 7, 5 and 3 tokens; 9, 1
// and 6; or 15 and 1 (the 15 span every context-parallel rank's chunks of
// the half, and of the whole batch at CP 4).
const std::vector<std::vector<std::int32_t>> kHalfPackings = {{0, 1, 8, 13, 16}, {0, 9, 10, 16}, {0, 15, 16}};

// The packing of `tokens` tokens from sequence starts `starts` (ending at
// tokens), as kSequences + 1 entries: the empty sequences after the last.
std::vector<std::int32_t> padded(std::vector<std::int32_t> starts, std::int64_t tokens) {
  starts.resize(kSequences + 1, static_cast<std::int32_t>(tokens));
  return starts;
}

// Step s's packing of data-parallel group g's half: the half packings take
// turns, so the groups' differ and each changes every step.
const std::vector<std::int32_t>& half_packing(int step, int group) {
  return kHalfPackings[(step + group) % kHalfPackings.size()];
}

// The whole batch's packing of step s: group 0's half, then group 1's.
std::vector<std::int32_t> whole_packing(int step) {
  std::vector<std::int32_t> starts = half_packing(step, 0);
  for (const std::int32_t start : half_packing(step, 1)) {
    if (start > 0) starts.push_back(start + static_cast<std::int32_t>(kTokens / 2));
  }
  return padded(starts, kTokens);
}

// The packing a data-parallel group of `dp` sees in step s.
std::vector<std::int32_t> group_packing(int step, int group, int dp) {
  return dp == 1 ? whole_packing(step) : padded(half_packing(step, group), kTokens / 2);
}

struct Batch {
  std::vector<std::int32_t> tokens, labels;
};

Batch global_batch(std::uint32_t seed, int step) {
  std::mt19937 rng(seed + 1000u * static_cast<std::uint32_t>(step));
  std::uniform_int_distribution<std::int32_t> id(0, kVocab - 1);
  Batch b;
  for (std::int64_t i = 0; i < kTokens; ++i) b.tokens.push_back(id(rng));
  for (std::int64_t i = 0; i < kTokens; ++i) b.labels.push_back(id(rng));
  return b;
}

// Rows [first, first + count) of the batch into the step's tokens and labels.
void write_tokens_and_labels(Context& ctx, const TrainStep& step, const Batch& b, std::int64_t first,
                             std::int64_t count) {
  ctx.copy_from_host(step.inputs(), b.tokens.data() + first, static_cast<std::size_t>(count) * 4);
  ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(count) * 4);
}

// A rank's place in a TP x CP x DP world: tensor groups of consecutive
// ranks, context groups across them, data groups across both.
struct Place {
  int tp_rank, cp_rank, dp_rank;
};

// The rank's tokens and labels: its data group's half (or all), its
// context-parallel chunks of those, its tensor-parallel rows of those.
Batch rank_rows(const Batch& b, const Case& c, const Place& at) {
  const auto mine = [&](const std::vector<std::int32_t>& all) {
    const std::int64_t group_tokens = kTokens / c.dp;
    const std::span<const std::int32_t> group(all.data() + at.dp_rank * group_tokens, group_tokens);
    const std::vector<std::int32_t> chunks = context_parallel_rows(group, 1, c.cp, at.cp_rank);
    const std::int64_t local = group_tokens / (c.cp * c.tp);
    return std::vector<std::int32_t>(chunks.begin() + at.tp_rank * local, chunks.begin() + (at.tp_rank + 1) * local);
  };
  return {mine(b.tokens), mine(b.labels)};
}

struct Rig {
  Rig(Context& ctx, const Case& c, std::int64_t tokens, Communicator* tp, Communicator* dp, Communicator* cp = nullptr)
      : model(ctx, gpt(c), tp, cp),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f, .eps = 1e-5f}),
        step(ctx, model, optimizer, TrainStep::PackedTokens{.tokens = tokens, .sequences = kSequences}, dp, c.mode) {}
  // This rank's rows (all of `mine`), and its group's packing.
  void load(Context& ctx, const Batch& mine, const std::vector<std::int32_t>& packing) {
    write_tokens_and_labels(ctx, step, mine, 0, static_cast<std::int64_t>(mine.tokens.size()));
    ctx.copy_from_host(step.packing(), packing.data(), packing.size() * 4);
  }
  // The embedding table, the final norm's gamma and beta and the head's
  // weight: the first parameter and the last three.
  std::vector<std::vector<float>> outer(Context& ctx) {
    const std::vector<Parameter*> p = model.parameters();
    std::vector<std::vector<float>> out;
    for (const Parameter* q : {p[0], p[p.size() - 3], p[p.size() - 2], p.back()}) {
      out.push_back(ctx.to_vector<float>(q->master));
    }
    return out;
  }
  LanguageModel model;
  AdamW optimizer;
  TrainStep step;
};

std::string case_name(const Case& c) {
  return "tp" + std::to_string(c.tp) + "_cp" + std::to_string(c.cp) + "_dp" + std::to_string(c.dp) + "_kv" +
         std::to_string(c.kv_heads) + "_" + c.overlap + "_" + std::string(data_parallel_mode_name(c.mode));
}

class GptParallelTrainTest : public ::testing::TestWithParam<Case> {};

TEST_P(GptParallelTrainTest, EqualsOneProcessOnTheGlobalBatchOverFourAdamWStepsAndGraphEqualsEager) {
  const Case c = GetParam();
  const testing::TestSeed seed;
  std::vector<float> want_losses;
  std::vector<std::vector<float>> want_outer;
  {
    Context ctx(Device::kHost, 2);
    Rig rig(ctx, c, kTokens, nullptr, nullptr);
    for (int s = 0; s < kSteps; ++s) {
      rig.load(ctx, global_batch(seed.value(), s), whole_packing(s));
      want_losses.push_back(ctx.to_vector<float>(rig.step(ctx)[0]).at(0));
    }
    rig.step.check_errors(ctx);
    want_outer = rig.outer(ctx);
  }
  const std::int64_t local = kTokens / (c.tp * c.cp * c.dp);
  HostWorld::run(c.tp * c.cp * c.dp, [&](Communicator& world) {
    const int w = world.rank();
    const Place at{.tp_rank = w % c.tp, .cp_rank = (w / c.tp) % c.cp, .dp_rank = w / (c.tp * c.cp)};
    // Tensor-parallel groups of consecutive ranks, context-parallel across
    // them, data-parallel across both; the gradients are summed over data x
    // context (the ranks of one tensor-parallel rank).
    std::unique_ptr<Communicator> tp_group, cp_group, grad_group;
    Communicator* tp = nullptr;
    Communicator* cp = nullptr;
    Communicator* grads = nullptr;
    if (c.tp > 1) {
      tp_group = world.split(w / c.tp, w, "tp");
      tp = tp_group.get();
    }
    if (c.cp > 1) {
      cp_group = world.split(at.tp_rank + c.tp * at.dp_rank, w, "cp");
      cp = cp_group.get();
    }
    if (c.cp * c.dp > 1) {
      grad_group = world.split(at.tp_rank, w, "dp x cp");
      grads = grad_group.get();
    }
    const int group = at.dp_rank;
    const std::string who = "world rank " + std::to_string(w) + " (" + case_name(c) + "), " +
                            testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Rig eager(ctx, c, local, tp, grads, cp);
    Rig graphed(ctx, c, local, tp, grads, cp);
    EXPECT_EQ(graphed.step.packing().shape(), (Shape{kSequences + 1})) << who;
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(ctx, eager, graphed, want_losses, who, [&](int s) {
      const Batch mine = rank_rows(global_batch(seed.value(), s), c, at);
      const std::vector<std::int32_t> packing = group_packing(s, group, c.dp);
      eager.load(ctx, mine, packing);
      graphed.load(ctx, mine, packing);
    }));
    eager.step.check_errors(ctx);
    graphed.step.check_errors(ctx);
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    ASSERT_EQ(pe.size(), pg.size()) << who;
    for (std::size_t i = 0; i < pg.size(); ++i) {
      EXPECT_EQ(ctx.to_vector<float>(pg[i]->master), ctx.to_vector<float>(pe[i]->master))
          << who << " " << pg[i]->name << ": graph != eager";
    }
    // This rank's rows of the embedding and the head (vocabulary slices),
    // and the replicated final norm.
    const std::vector<std::vector<float>> got = graphed.outer(ctx);
    const std::int64_t v = kVocab / c.tp;
    const auto rows_of = [&](const std::vector<float>& whole) {
      return std::vector<float>(whole.begin() + at.tp_rank * v * kHidden,
                                whole.begin() + (at.tp_rank + 1) * v * kHidden);
    };
    testing::expect_within(got[0], rows_of(want_outer[0]), 1e-5f, who + " embedding rows");
    testing::expect_within(got[1], want_outer[1], 1e-5f, who + " final norm gamma");
    testing::expect_within(got[2], want_outer[2], 1e-5f, who + " final norm beta");
    testing::expect_within(got[3], rows_of(want_outer[3]), 1e-5f, who + " head rows");
  });
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, GptParallelTrainTest,
    ::testing::Values(
        Case{2, 1, 2, "bulk"}, Case{4, 1, 4, "overlap"}, Case{2, 2, 2, "none"}, Case{2, 2, 0, "overlap"},
        Case{2, 2, 2, "bulk", DataParallelMode::kZero1},
        Case{.tp = 1, .dp = 1, .kv_heads = 2, .overlap = "none", .cp = 2},
        Case{.tp = 1, .dp = 1, .kv_heads = 0, .overlap = "none", .cp = 4},
        Case{.tp = 2, .dp = 1, .kv_heads = 2, .overlap = "bulk", .cp = 2},
        Case{.tp = 2, .dp = 1, .kv_heads = 1, .overlap = "overlap", .cp = 2},
        Case{.tp = 1, .dp = 2, .kv_heads = 2, .overlap = "none", .cp = 2},
        Case{.tp = 1, .dp = 2, .kv_heads = 0, .overlap = "none", .mode = DataParallelMode::kZero1, .cp = 2}),
    [](const auto& info) { return case_name(info.param); });

// Before any packing is written, a packed step's packing is one sequence of
// all the tokens: under TP the group's, N times the rank's rows, so the
// first step trains as one process on one sequence of the whole batch.
TEST(GptParallelTrainPackingTest, APackedStepStartsAsOneSequenceOfTheGroupsTokens) {
  const Case c{2, 1, 2, "bulk"};
  const testing::TestSeed seed;
  const Batch b = global_batch(seed.value(), 0);
  float want = NAN;
  {
    Context ctx(Device::kHost, 2);
    Rig rig(ctx, c, kTokens, nullptr, nullptr);
    write_tokens_and_labels(ctx, rig.step, b, 0, kTokens);
    want = ctx.to_vector<float>(rig.step(ctx)[0]).at(0);
  }
  std::vector<std::int32_t> one_sequence(kSequences + 1, static_cast<std::int32_t>(kTokens));
  one_sequence[0] = 0;
  HostWorld::run(c.tp, [&](Communicator& tp) {
    const std::string who = "rank " + std::to_string(tp.rank()) + ", " + testing::seed_note(seed.value());
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Rig rig(ctx, c, kTokens / c.tp, &tp, nullptr);
    EXPECT_EQ(ctx.to_vector<std::int32_t>(rig.step.packing()), one_sequence) << who;
    write_tokens_and_labels(ctx, rig.step, b, tp.rank() * kTokens / c.tp, kTokens / c.tp);
    EXPECT_NEAR(ctx.to_vector<float>(rig.step(ctx)[0]).at(0), want, 1e-5 * std::abs(want)) << who;
  });
}

}  // namespace
}  // namespace stepgraph
