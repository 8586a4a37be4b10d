// A small GPT trunk (ResidualStack with attention: 2 TransformerLayers of 4
// query heads) trained by TrainStep over tensor-parallel host thread worlds
// of 2 and 4 ranks, each rank on its token shard of the global batch (Note
// [Tensor-parallel ResidualStack], Note [Tensor-parallel attention]),
// against one process on the whole batch over 4 AdamW steps: every step's
// loss, and after them every parameter (the ranks' slices gathered back into
// the whole matrices; the replicated ones on every rank). The batch is packed
// sequences of 5, 1, 7 and 3 tokens. The kv heads split over the ranks
// where they divide by the TP size (2 at TP 2, 4 at TP 4), and are copied on
// the ranks sharing each where the ranks outnumber them (2 at TP 4, 1 at
// TP 2), the copies equal bit for bit after the steps. Graph equals eager bit for bit on every rank,
// losses and parameters.
//
// Tolerance: the ranks add the same fp32 terms as one process in another
// order (the projections' partial sums over heads and ffn, QKV's and fc1's
// data gradients, the vocabulary's split softmax sums, the norms'
// all-reduced gradients), about 1e-7 relative per step. The loss is held to
// 1e-5 relative. AdamW normalises each update by the root of the
// gradient's second moment, which turns a gradient element within rounding
// of zero into a whole lr-sized step of either sign; with eps = 1e-2 (about
// the gradients' size here) an update changes by at most lr / eps = 0.1
// times its gradient's change, so every parameter stays within 1e-5
// absolute of one process's after 4 steps (with the default eps 1e-8, 6 runs
// of 15 had an element 1e-5 to 1.3e-4 off). A missing
// reduction, a wrong head slice or a packing of the rank's tokens only is off
// by 1e-3 or more.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/host_world.h"
#include "graphs/captured_step.h"
#include "layers/residual_stack.h"
#include "optim/adamw.h"
#include "tests/layers/world_steps.h"
#include "tests/support/global_batch.h"
#include "tests/support/seed.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

constexpr std::int64_t kHidden = 32;
constexpr std::int64_t kHeads = 4;
constexpr std::int64_t kHeadDim = kHidden / kHeads;
constexpr std::int64_t kVocab = 32;
constexpr std::int64_t kTokens = 16;  // the global batch
constexpr int kSteps = 4;
const std::vector<std::int32_t> kPacking{0, 5, 6, 13, 16};
constexpr std::int64_t kSequences = 4;

ResidualStackConfig config(std::int64_t kv_heads, const MLPOverlap& overlap) {
  return {.hidden = kHidden,
          .ffn = 64,
          .layers = 2,
          .vocab = kVocab,
          .dtype = DType::kFloat32,
          .seed = 11,
          .heads = kHeads,
          .kv_heads = kv_heads,
          .overlap = overlap};
}

struct Rig {
  Rig(Context& ctx, std::int64_t tokens, std::int64_t kv_heads, Communicator* tp, const MLPOverlap& overlap)
      : model(ctx, config(kv_heads, overlap), tp),
        optimizer(ctx, model.parameters(), {.lr = 1e-3f, .eps = 1e-2f}),
        step(ctx, model, optimizer, tokens, nullptr, DataParallelMode::kAllReduce,
             kSequences / (tp != nullptr ? tp->world_size() : 1)) {
    // The packing of the whole batch, on every rank (the step made one of equal lengths).
    ctx.copy_from_host(step.packing(), kPacking.data(), kPacking.size() * sizeof(std::int32_t));
  }
  void load(Context& ctx, const testing::GlobalBatch& b, std::int64_t first, std::int64_t tokens) {
    ctx.copy_from_host(step.inputs(), b.x.data() + first * kHidden, static_cast<std::size_t>(tokens * kHidden) * 4);
    ctx.copy_from_host(step.labels(), b.labels.data() + first, static_cast<std::size_t>(tokens) * 4);
  }
  ResidualStack model;
  AdamW optimizer;
  TrainStep step;
};

testing::GlobalBatch global_batch(std::uint32_t seed, int step) {
  return testing::global_batch(seed, step, kTokens, kHidden, kVocab);
}

// Writes a rank's slice `local` of parameter `name` (one rank's values
// `whole`, [rows, cols]) into `gathered`; false when it is replicated.
bool place_slice(const std::string& name, std::int64_t kv_heads, int n, int rank, std::int64_t rows,
                 std::int64_t cols, const std::vector<float>& local, std::vector<float>& gathered) {
  const auto size = static_cast<std::int64_t>(local.size());
  if (name.find(".qkv.linear.") != std::string::npos) {
    // Head blocks: each rank's q, k and v heads, the kv heads a copy on the
    // ranks sharing one where they are fewer than the ranks (Note
    // [Tensor-parallel attention]).
    const std::int64_t copies = kv_heads % n == 0 ? 1 : n / kv_heads;
    const std::int64_t width = name.find(".bias") != std::string::npos ? 1 : cols;
    std::int64_t block_start = 0, at = 0;
    for (const auto& [block, c] : {std::pair{kHeads * kHeadDim, std::int64_t{1}},
                                   std::pair{kv_heads * kHeadDim, copies}, std::pair{kv_heads * kHeadDim, copies}}) {
      const std::int64_t part = block / (n / c);
      std::copy(local.begin() + at * width, local.begin() + (at + part) * width,
                gathered.begin() + (block_start + (rank / c) * part) * width);
      block_start += block;
      at += part;
    }
    return true;
  }
  if (size * n != rows * cols) return false;  // whole on every rank
  const bool by_columns = name.find(".proj.") != std::string::npos || name.find(".fc2.") != std::string::npos;
  if (!by_columns) {  // rows: fc1's ffn, the head's vocabulary
    std::copy(local.begin(), local.end(), gathered.begin() + rank * size);
    return true;
  }
  const std::int64_t c = cols / n;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::copy(local.begin() + r * c, local.begin() + (r + 1) * c, gathered.begin() + r * cols + rank * c);
  }
  return true;
}

struct Case {
  int tp;
  std::int64_t kv_heads;
  const char* overlap;
};

class TensorParallelGptTest : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelGptTest, EqualsOneProcessOnTheWholeBatchOverFourAdamWStepsAndGraphEqualsEager) {
  const Case c = GetParam();
  const MLPOverlap overlap = MLPOverlap::parse(c.overlap);
  const testing::TestSeed seed;
  std::vector<float> want_losses;
  std::vector<std::string> names;
  std::vector<std::vector<float>> want_params;
  std::vector<Shape> shapes;
  {
    Context ctx(Device::kHost, 2);
    Rig rig(ctx, kTokens, c.kv_heads, nullptr, overlap);
    for (int s = 0; s < kSteps; ++s) {
      rig.load(ctx, global_batch(seed.value(), s), 0, kTokens);
      want_losses.push_back(ctx.to_vector<float>(rig.step(ctx)[0]).at(0));
    }
    for (const Parameter* p : rig.model.parameters()) {
      names.push_back(p->name);
      shapes.push_back(p->master.shape());
      want_params.push_back(ctx.to_vector<float>(p->master));
    }
  }
  std::vector<std::vector<float>> gathered = want_params;  // sliced ones overwritten by the ranks
  std::vector<bool> sliced(names.size(), false);
  std::mutex mutex;
  std::map<std::pair<std::size_t, int>, std::vector<float>> rank_qkv;  // (parameter, rank): its QKV values
  const std::int64_t local = kTokens / c.tp;
  HostWorld::run(c.tp, [&](Communicator& tp) {
    const int r = tp.rank();
    const std::string who = "rank " + std::to_string(r) + " of tp " + std::to_string(c.tp) + " (kv_heads " +
                            std::to_string(c.kv_heads) + ", " + c.overlap + ")";
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    Rig eager(ctx, local, c.kv_heads, &tp, overlap);
    Rig graphed(ctx, local, c.kv_heads, &tp, overlap);
    ASSERT_NO_FATAL_FAILURE(testing::expect_steps_match_one_process(ctx, eager, graphed, want_losses, who, [&](int s) {
      const testing::GlobalBatch b = global_batch(seed.value(), s);
      eager.load(ctx, b, r * local, local);
      graphed.load(ctx, b, r * local, local);
    }));
    const std::vector<Parameter*> pe = eager.model.parameters();
    const std::vector<Parameter*> pg = graphed.model.parameters();
    ASSERT_EQ(pg.size(), names.size()) << who;
    for (std::size_t i = 0; i < pg.size(); ++i) {
      const std::vector<float> values = ctx.to_vector<float>(pg[i]->master);
      EXPECT_EQ(values, ctx.to_vector<float>(pe[i]->master)) << who << " " << pg[i]->name << ": graph != eager";
      ASSERT_EQ(pg[i]->name, names[i]) << who;
      const std::int64_t rows = shapes[i].dim(0);
      const std::int64_t cols = shapes[i].rank() > 1 ? shapes[i].dim(1) : 1;
      std::lock_guard<std::mutex> lock(mutex);
      if (names[i].find(".qkv.linear.") != std::string::npos) rank_qkv[{i, r}] = values;
      if (place_slice(names[i], c.kv_heads, c.tp, r, rows, cols, values, gathered[i])) {
        sliced[i] = true;
      } else {
        testing::expect_within(values, want_params[i], 1e-5f, who + " " + names[i] + " (replicated)");
      }
    }
  });
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (sliced[i]) testing::expect_within(gathered[i], want_params[i], 1e-5f, names[i] + " (the ranks' slices gathered)");
  }
  // Ranks that share a kv head hold equal copies of it, bit for bit, after the steps.
  const std::int64_t copies = c.kv_heads % c.tp == 0 ? 1 : c.tp / c.kv_heads;
  for (const auto& [key, values] : rank_qkv) {
    const int first = static_cast<int>(key.second / copies * copies);
    const std::int64_t width = names[key.first].find(".bias") != std::string::npos ? 1 : kHidden;
    const auto q_values = static_cast<std::ptrdiff_t>(kHeads * kHeadDim / c.tp * width);  // its query heads' rows
    const std::vector<float>& theirs = rank_qkv.at({key.first, first});
    EXPECT_TRUE(std::equal(values.begin() + q_values, values.end(), theirs.begin() + q_values))
        << names[key.first] << ": rank " << key.second << "'s kv copies differ from rank " << first << "'s";
  }
  // Every block's QKV weight and bias, projection weight, fc1 weight and bias and fc2 weight, and the head.
  EXPECT_EQ(std::count(sliced.begin(), sliced.end(), true), 2 * 6 + 1);
}

INSTANTIATE_TEST_SUITE_P(Worlds, TensorParallelGptTest,
                         ::testing::Values(Case{2, 2, "bulk"}, Case{2, 2, "overlap"}, Case{2, 2, "none"},
                                           Case{4, 2, "overlap"}, Case{4, 2, "bulk"}, Case{4, 4, "overlap"},
                                           Case{2, 1, "overlap"}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "_kv" +
                                  std::to_string(info.param.kv_heads) + "_" + info.param.overlap;
                         });

}  // namespace
}  // namespace stepgraph
