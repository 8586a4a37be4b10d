// Context parallelism's ops (ops/context_parallel_ops.h) and the segment
// attention ops' checks (ops/attention_ops.h), on the host: the zig-zag
// reorder puts a rank-major gathered tensor in stream order and back, in
// any dtype and row width, eager and replayed; the plan op gives the host
// plan; bad shapes and params are clear errors naming the operand.
#include "ops/context_parallel_ops.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "engine/context.h"
#include "graphs/captured_step.h"
#include "kernels/context_parallel_plan.h"
#include "ops/attention_ops.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

template <typename T>
Tensor tensor_of(Context& ctx, const char* name, const std::vector<T>& values, Shape shape, DType dtype) {
  const Tensor t = ctx.persistent(name, {shape, dtype});
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(T));
  return t;
}

TEST(ZigzagReorderTest, GatheredRankMajorRowsGoToStreamOrderAndBackEagerAndReplayed) {
  for (const int ranks : {1, 2, 4}) {
    constexpr std::int64_t kChunk = 3, kWidth = 2;
    const std::int64_t rows = 2 * ranks * kChunk;
    // Gathered row b * kChunk + i holds (stream chunk of block b) * kChunk + i in both columns.
    std::vector<std::int32_t> gathered;
    for (std::int64_t block = 0; block < 2 * ranks; ++block) {
      for (std::int64_t i = 0; i < kChunk; ++i) {
        const auto row = static_cast<std::int32_t>(kernels::zigzag_stream_chunk(ranks, block) * kChunk + i);
        gathered.insert(gathered.end(), {row, row});
      }
    }
    std::vector<std::int32_t> stream(static_cast<std::size_t>(rows));
    std::iota(stream.begin(), stream.end(), 0);
    std::vector<std::int32_t> stream_rows;
    for (std::int32_t r : stream) stream_rows.insert(stream_rows.end(), {r, r});

    Context ctx(Device::kHost);
    const Tensor x = tensor_of(ctx, "x", gathered, Shape{rows, kWidth}, DType::kInt32);
    const Tensor in_order = ops::zigzag_to_stream(ctx, ranks, x);
    EXPECT_EQ(ctx.to_vector<std::int32_t>(in_order), stream_rows) << "cp" << ranks;
    EXPECT_EQ(ctx.to_vector<std::int32_t>(ops::zigzag_from_stream(ctx, ranks, in_order)), gathered) << "cp" << ranks;

    auto graph = CapturedStep::capture(ctx, [&] {
      return std::vector<Tensor>{ops::zigzag_from_stream(ctx, ranks, ops::zigzag_to_stream(ctx, ranks, x))};
    });
    graph->replay();
    EXPECT_EQ(ctx.to_vector<std::int32_t>(graph->outputs()[0]), gathered) << "cp" << ranks << " replayed";
  }
}

TEST(ContextParallelPlanOpTest, GivesTheHostPlan) {
  Context ctx(Device::kHost);
  const std::vector<std::int32_t> cu{0, 5, 6, 16};
  const Tensor cu_t = tensor_of(ctx, "cu", cu, Shape{4}, DType::kInt32);
  const ops::ContextParallelPlan plan = ops::context_parallel_plan(ctx, {.ranks = 2, .rank = 1, .tokens = 16}, cu_t);
  const kernels::ContextParallelPlanDesc d{.tokens = 16, .sequences = 3, .ranks = 2, .rank = 1};
  std::vector<std::int32_t> q_offsets(7), kv_ranges(12), positions(8);
  kernels::host::context_parallel_plan(d, cu.data(), q_offsets.data(), kv_ranges.data(), positions.data());
  EXPECT_EQ(plan.q_offsets.shape(), Shape{7});
  EXPECT_EQ(plan.kv_ranges.shape(), (Shape{6, 2}));
  EXPECT_EQ(ctx.to_vector<std::int32_t>(plan.q_offsets), q_offsets);
  EXPECT_EQ(ctx.to_vector<std::int32_t>(plan.kv_ranges), kv_ranges);
  EXPECT_EQ(ctx.to_vector<std::int32_t>(plan.positions), positions);
  // Rank 1 of 2 holds stream chunks 1 ([4, 8)) and 2 ([8, 12)).
  EXPECT_EQ(ctx.to_vector<std::int32_t>(plan.positions), (std::vector<std::int32_t>{4, 0, 0, 1, 2, 3, 4, 5}));
}

TEST(ContextParallelOpsErrorsTest, BadShapesAndParamsNameTheOperand) {
  Context ctx(Device::kHost);
  const Tensor rows10 = ctx.persistent("x", {Shape{10, 2}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(ops::zigzag_to_stream(ctx, 2, rows10), "zigzag_reorder", "divide into 2 x 2 chunks");
  const Tensor cu64 = ctx.persistent("cu64", {Shape{3}, DType::kInt64});
  EXPECT_ERROR_CONTAINS(ops::context_parallel_plan(ctx, {.ranks = 2, .rank = 0, .tokens = 16}, cu64),
                        "context_parallel_plan", "cu_seqlens must be int32");

  const ops::AttentionParams params{.heads = 2, .kv_heads = 1, .head_dim = 4};
  const Tensor q = ctx.persistent("q", {Shape{6, 8}, DType::kFloat32});
  const Tensor kv = ctx.persistent("kv", {Shape{12, 4}, DType::kFloat32});
  const Tensor q_offsets = ctx.persistent("q_offsets", {Shape{3}, DType::kInt32});
  const Tensor ranges = ctx.persistent("ranges", {Shape{2, 2}, DType::kInt32});
  const Tensor bad_ranges = ctx.persistent("bad_ranges", {Shape{3, 2}, DType::kInt32});
  EXPECT_ERROR_CONTAINS(ops::segment_attention_forward(ctx, params, q, kv, kv, q_offsets, bad_ranges),
                        "segment_attention_forward", "kv_ranges must be int32 [2 segments, 2]");
  EXPECT_ERROR_CONTAINS(ops::segment_attention_forward(ctx, params, q, q, kv, q_offsets, ranges),
                        "segment_attention_forward", "k must be");
  const Tensor lse = ctx.persistent("lse", {Shape{2, 5}, DType::kFloat32});
  EXPECT_ERROR_CONTAINS(ops::segment_attention_backward(ctx, params, q, kv, kv, q, lse, q, q_offsets, ranges),
                        "segment_attention_backward", "lse must be fp32 [2, 6]");
}

}  // namespace
}  // namespace stepgraph
