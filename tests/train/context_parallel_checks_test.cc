// What a context-parallel model and step refuse, with errors naming what to
// change (attention without its plan or with one it cannot use, a window
// model, heads = 0, MoE, dropout, a step without the
// data x context gradient group, a global batch that does not cut into 2N
// chunks), a packed step's first packing (one sequence of the whole
// TP x CP group's tokens), and the zig-zag rows a rank takes of a batch.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "engine/host_world.h"
#include "layers/language_model.h"
#include "layers/multihead_attention.h"
#include "ops/context_parallel_ops.h"
#include "ops/elementwise_ops.h"
#include "optim/adamw.h"
#include "tests/support/expect_error.h"
#include "train/context_parallel_batch.h"
#include "train/train_step.h"

namespace stepgraph {
namespace {

LanguageModelConfig gpt() {
  return {.model = {.hidden = 16, .ffn = 32, .layers = 1, .vocab = 16, .dtype = DType::kFloat32, .seed = 3, .heads = 2},
          .context = 8};
}

TEST(ContextParallelRowsTest, ARankTakesChunksRAnd2NMinus1MinusR) {
  std::vector<std::int32_t> rows(16);
  std::iota(rows.begin(), rows.end(), 0);
  // Rows of width 2: 8 tokens, 4 chunks of 2 tokens at CP 2.
  EXPECT_EQ(context_parallel_rows<std::int32_t>(rows, 2, 2, 0),
            (std::vector<std::int32_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(context_parallel_rows<std::int32_t>(rows, 2, 2, 1), (std::vector<std::int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(context_parallel_rows<std::int32_t>(rows, 1, 4, 3), (std::vector<std::int32_t>{6, 7, 8, 9}));
  EXPECT_ERROR_CONTAINS(context_parallel_rows<std::int32_t>(rows, 1, 3, 0), "16 tokens", "multiple of 6");
  EXPECT_ERROR_CONTAINS(context_parallel_rows<std::int32_t>(rows, 1, 2, 2), "rank 2", "2 context-parallel ranks");
}

TEST(ContextParallelChecksTest, ModelsRefuseWhatTheyCannotSplit) {
  HostWorld::run(2, [](Communicator& cp) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModelConfig window = gpt();
    window.model.heads = 0;
    EXPECT_ERROR_CONTAINS(LanguageModel(ctx, window, nullptr, &cp), "window model", "heads > 0");
    ResidualStackConfig no_attention = gpt().model;
    no_attention.heads = 0;
    EXPECT_ERROR_CONTAINS(ResidualStack(ctx, no_attention, nullptr, &cp), "heads is 0", "data parallelism");
    ResidualStackConfig dropout = gpt().model;
    dropout.dropout = 0.1f;
    EXPECT_ERROR_CONTAINS(ResidualStack(ctx, dropout, nullptr, &cp), "dropout (0.1)", "context parallelism");
    ResidualStackConfig moe = gpt().model;
    moe.experts = 2;
    moe.moe_every = 1;
    EXPECT_ERROR_CONTAINS(ResidualStack(ctx, moe, nullptr, &cp), "experts (2)", "context parallelism");
  });
}

// The plan is made once per step by the caller and passed down: a
// context-parallel layer without it, or a plain layer given one, is an error.
TEST(ContextParallelChecksTest, AttentionNeedsItsPlanExactlyWhenContextParallel) {
  HostWorld::run(2, [](Communicator& cp) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    const MultiheadAttentionConfig config{.hidden = 16, .heads = 2, .dtype = DType::kFloat32};
    const MultiheadAttention split(ctx, "split", config, 1, nullptr, &cp);
    const MultiheadAttention plain(ctx, "plain", config, 1);
    const Tensor x = ops::fill(ctx, {Shape{4, 16}, DType::kFloat32}, 0.5f);
    const std::vector<std::int32_t> packing = {0, 8};
    const Tensor cu = ctx.persistent("cu_seqlens", {Shape{2}, DType::kInt32});
    ctx.copy_from_host(cu, packing.data(), packing.size() * 4);
    EXPECT_ERROR_CONTAINS(split.forward(ctx, {x, cu}), "args.plan is empty", "ops::context_parallel_plan");
    const ops::ContextParallelPlan plan =
        ops::context_parallel_plan(ctx, {.ranks = 2, .rank = cp.rank(), .tokens = 8}, cu);
    EXPECT_ERROR_CONTAINS(plain.forward(ctx, {x, cu, plan}), "args.plan is given", "no context-parallel communicator");
    // With its plan the layer runs, its output this rank's 4 tokens.
    EXPECT_EQ(split.forward(ctx, {x, cu, plan}).y.shape(), (Shape{4, 16}));
  });
}

TEST(ContextParallelChecksTest, AStepNeedsTheDataTimesContextGradientGroup) {
  HostWorld::run(2, [](Communicator& cp) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModel model(ctx, gpt(), nullptr, &cp);
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    EXPECT_ERROR_CONTAINS(TrainStep(ctx, model, optimizer, TrainStep::PackedTokens{.tokens = 4, .sequences = 2}),
                          "context-parallel", "data_parallel must be the group", "got none");
  });
}

// Before any packing is written a packed step's packing is one sequence of
// the CP group's tokens (2 x the rank's rows), and a global batch that does
// not cut into 2N chunks is an error at the step's forward naming the sizes.
TEST(ContextParallelChecksTest, PackingIsTheGroupsAndTheBatchMustCutInto2NChunks) {
  HostWorld::run(2, [](Communicator& cp) {
    Context ctx(Device::kHost, 2);
    ctx.set_communication_stream(2);
    LanguageModel model(ctx, gpt(), nullptr, &cp);
    AdamW optimizer(ctx, model.parameters(), {.lr = 1e-3f});
    const TrainStep step(ctx, model, optimizer, TrainStep::PackedTokens{.tokens = 4, .sequences = 2}, &cp);
    EXPECT_EQ(ctx.to_vector<std::int32_t>(step.packing()), (std::vector<std::int32_t>{0, 8, 8}));
    LanguageModel odd_model(ctx, gpt(), nullptr, &cp);
    AdamW odd_optimizer(ctx, odd_model.parameters(), {.lr = 1e-3f});
    const TrainStep odd(ctx, odd_model, odd_optimizer, TrainStep::PackedTokens{.tokens = 3, .sequences = 1}, &cp);
    EXPECT_ERROR_CONTAINS(odd(ctx), "6 tokens must divide into 2 x 2", "multiple of 4");
  });
}

}  // namespace
}  // namespace stepgraph
