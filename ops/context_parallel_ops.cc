#include "ops/context_parallel_ops.h"

#include <cstring>

#include "engine/error.h"
#include "kernels/context_parallel_plan.h"
#include "kernels/elementwise.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string ContextParallelParams::to_string() const {
  return detail::concat("ranks=", ranks, ", rank=", rank, ", tokens=", tokens, ", causal=", causal ? 1 : 0);
}

namespace {

// Which way zigzag_reorder moves rows.
enum class ZigzagDirection : std::uint8_t { kToStream, kFromStream };

struct ZigzagParams {
  int ranks = 1;
  ZigzagDirection direction = ZigzagDirection::kToStream;
  bool operator==(const ZigzagParams&) const = default;
  std::string to_string() const {
    return detail::concat("ranks=", ranks, direction == ZigzagDirection::kToStream ? ", to stream" : ", from stream");
  }
};

template <typename F>
struct ContextParallelPlanOperands {
  F cu_seqlens;  // int32 [S + 1], the global packing
};

template <typename F, typename V>
void visit_operands(const ContextParallelParams&, ContextParallelPlanOperands<F>& o, V& v) {
  v({"cu_seqlens"}, o.cu_seqlens);
}

template <typename F>
struct ContextParallelPlanOutputs {
  F q_offsets, kv_ranges, positions;
};

template <typename F, typename V>
void visit_operands(const ContextParallelParams&, ContextParallelPlanOutputs<F>& o, V& v) {
  v({"q_offsets"}, o.q_offsets);
  v({"kv_ranges"}, o.kv_ranges);
  v({"positions"}, o.positions);
}

constexpr std::string_view kPlan = "context_parallel_plan";
constexpr std::string_view kZigzag = "zigzag_reorder";

kernels::ContextParallelPlanDesc plan_desc(const ContextParallelParams& p, std::int64_t sequences) {
  return {.tokens = p.tokens, .sequences = sequences, .ranks = p.ranks, .rank = p.rank, .causal = p.causal};
}

std::vector<TensorMeta> check_plan(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<ContextParallelParams>();
  const auto o = bind_metas<ContextParallelPlanOperands>(kPlan, p, inputs);
  SG_CHECK(o.cu_seqlens.dtype == DType::kInt32 && o.cu_seqlens.shape.rank() == 1 && o.cu_seqlens.shape.dim(0) >= 2,
           "op ", kPlan, ": cu_seqlens must be int32 [sequences + 1] with at least one sequence, got ",
           dtype_name(o.cu_seqlens.dtype), " ", o.cu_seqlens.shape);
  const kernels::ContextParallelPlanDesc d = plan_desc(p, o.cu_seqlens.shape.dim(0) - 1);
  kernels::check_context_parallel_plan(d);
  return output_metas(p, ContextParallelPlanOutputs<TensorMeta>{.q_offsets = {Shape{d.segments() + 1}, DType::kInt32},
                                                                .kv_ranges = {Shape{d.segments(), 2}, DType::kInt32},
                                                                .positions = {Shape{d.local_tokens()}, DType::kInt32}});
}

kernels::ContextParallelPlanDesc plan_desc_of(const ContextParallelParams& p, const Operand& cu_seqlens) {
  return plan_desc(p, cu_seqlens.shape().dim(0) - 1);
}

std::vector<TensorMeta> check_zigzag(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<ZigzagParams>();
  const TensorMeta x = bind_metas<ReadOperand>(kZigzag, p, inputs).x;
  SG_CHECK(p.ranks > 0, "op ", kZigzag, ": ranks must be > 0, got ", p.ranks);
  SG_CHECK(x.shape.rank() >= 1 && x.shape.dim(0) % (2 * p.ranks) == 0, "op ", kZigzag, ": x must have rows (its ",
           "first dimension) that divide into 2 x ", p.ranks, " chunks, got ", x.shape);
  return {x};
}

// Copies the 2N chunks of x into their places: copy(dst, src, bytes) for each.
template <typename Copy>
void reorder(const ZigzagParams& p, const KernelArgs& a, Copy&& copy) {
  const Operand x = bind_args<ReadOperand>(p, a).x;
  const auto chunk_bytes = static_cast<std::size_t>(x.meta->bytes() / (2 * p.ranks));
  const auto* src = static_cast<const std::byte*>(x.data);
  auto* dst = static_cast<std::byte*>(a.outputs[0]);
  for (std::int64_t block = 0; block < 2 * p.ranks; ++block) {
    const std::int64_t chunk = kernels::zigzag_stream_chunk(p.ranks, block);
    const bool to_stream = p.direction == ZigzagDirection::kToStream;
    copy(dst + (to_stream ? chunk : block) * chunk_bytes, src + (to_stream ? block : chunk) * chunk_bytes, chunk_bytes);
  }
}

}  // namespace

const OpDef& context_parallel_plan_op() {
  static const OpDef op{
      .name = kPlan,
      .check = check_plan,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto& p = params.as<ContextParallelParams>();
            const auto o = bind_args<ContextParallelPlanOperands>(p, a);
            const auto out = bind_outputs<ContextParallelPlanOutputs>(p, a);
            kernels::launch_context_parallel_plan(plan_desc_of(p, o.cu_seqlens), o.cu_seqlens.as<const std::int32_t>(),
                                                  out.q_offsets.as<std::int32_t>(), out.kv_ranges.as<std::int32_t>(),
                                                  out.positions.as<std::int32_t>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<ContextParallelParams>();
            const auto o = bind_args<ContextParallelPlanOperands>(p, a);
            const auto out = bind_outputs<ContextParallelPlanOutputs>(p, a);
            kernels::host::context_parallel_plan(plan_desc_of(p, o.cu_seqlens), o.cu_seqlens.as<const std::int32_t>(),
                                                 out.q_offsets.as<std::int32_t>(), out.kv_ranges.as<std::int32_t>(),
                                                 out.positions.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(context_parallel_plan_op);

const OpDef& zigzag_reorder_op() {
  static const OpDef op{
      .name = kZigzag,
      .check = check_zigzag,
      // 2N byte copies (copy-engine transfers on cuda).
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            reorder(params.as<ZigzagParams>(), a, [&](std::byte* dst, const std::byte* src, std::size_t bytes) {
              kernels::launch_copy_bytes(dst, src, bytes, stream);
            });
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            reorder(params.as<ZigzagParams>(), a, [](std::byte* dst, const std::byte* src, std::size_t bytes) {
              if (bytes > 0) std::memcpy(dst, src, bytes);
            });
          },
  };
  return op;
}
SG_REGISTER_OP(zigzag_reorder_op);

ContextParallelPlan context_parallel_plan(Context& ctx, const ContextParallelParams& params, const Tensor& cu_seqlens) {
  const auto r = bind_results<ContextParallelPlanOutputs>(
      params, ctx.call(context_parallel_plan_op(), params,
                       flatten(kPlan, params, ContextParallelPlanOperands<Tensor>{cu_seqlens})));
  return {.params = params, .q_offsets = r.q_offsets, .kv_ranges = r.kv_ranges, .positions = r.positions};
}

namespace {
Tensor zigzag(Context& ctx, int ranks, ZigzagDirection direction, const Tensor& x) {
  const ZigzagParams params{ranks, direction};
  return ctx.call(zigzag_reorder_op(), params, flatten(kZigzag, params, ReadOperand<Tensor>{x})).at(0);
}
}  // namespace

Tensor zigzag_to_stream(Context& ctx, int ranks, const Tensor& x) {
  return zigzag(ctx, ranks, ZigzagDirection::kToStream, x);
}

Tensor zigzag_from_stream(Context& ctx, int ranks, const Tensor& x) {
  return zigzag(ctx, ranks, ZigzagDirection::kFromStream, x);
}

}  // namespace stepgraph::ops
