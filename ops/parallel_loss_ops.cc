#include "ops/parallel_loss_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/parallel_cross_entropy.h"
#include "ops/collective_ops.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string VocabParallelCrossEntropyParams::to_string() const {
  char text[128];
  std::snprintf(text, sizeof(text), "vocab=%lld, offset=%lld, ignore=%lld, scale=%g", static_cast<long long>(vocab),
                static_cast<long long>(vocab_offset), static_cast<long long>(ignore_index),
                static_cast<double>(loss_scale));
  return text;
}

namespace {

using Params = VocabParallelCrossEntropyParams;

template <typename F>
struct StatsOperands {
  F logits_local;  // [tokens, vocab_local]
  F labels;        // [tokens]
};

template <typename F, typename V>
void visit_operands(const Params&, StatsOperands<F>& o, V& v) {
  v({"logits_local"}, o.logits_local);
  v({"labels"}, o.labels);
}

template <typename F>
struct Stats {
  F local_max;  // fp32 [tokens]
  F partial;    // fp32 [tokens, 2]
};

template <typename F, typename V>
void visit_operands(const Params&, Stats<F>& o, V& v) {
  v({"local_max"}, o.local_max);
  v({"partial"}, o.partial);
}

template <typename F>
struct RescaleOperands {
  F local_max, global_max;  // fp32 [tokens]
  F partial;                // fp32 [tokens, 2]
};

template <typename F, typename V>
void visit_operands(const Params&, RescaleOperands<F>& o, V& v) {
  v({"local_max"}, o.local_max);
  v({"global_max"}, o.global_max);
  v({"partial"}, o.partial);
}

template <typename F>
struct FinishOperands {
  F logits_local;  // [tokens, vocab_local]
  F labels;        // [tokens]
  F global_max;    // fp32 [tokens]
  F totals;        // fp32 [tokens, 2]
  F error_flag;    // int32 [1], raised on a bad label
};

template <typename F, typename V>
void visit_operands(const Params&, FinishOperands<F>& o, V& v) {
  v({"logits_local"}, o.logits_local);
  v({"labels"}, o.labels);
  v({"global_max"}, o.global_max);
  v({"totals"}, o.totals);
  v({.name = "error_flag", .use = Use::kWrite}, o.error_flag);
}

template <typename F>
struct FinishOutputs {
  F loss;           // fp32 []
  F dlogits_local;  // like logits_local
  F scratch;        // fp32, the kernel's workspace
};

template <typename F, typename V>
void visit_operands(const Params&, FinishOutputs<F>& o, V& v) {
  v({"loss"}, o.loss);
  v({"dlogits_local"}, o.dlogits_local);
  v({"scratch"}, o.scratch);
}

constexpr std::string_view kStats = "vocab_parallel_cross_entropy_stats";
constexpr std::string_view kRescale = "vocab_parallel_cross_entropy_rescale";
constexpr std::string_view kFinish = "vocab_parallel_cross_entropy_finish";

kernels::ParallelCrossEntropyDesc describe(const Params& p, const TensorMeta& logits, const TensorMeta& labels) {
  kernels::ParallelCrossEntropyDesc desc;
  desc.logits_type = logits.dtype;
  desc.label_type = labels.dtype;
  desc.tokens = logits.shape.rank() == 2 ? logits.shape.dim(0) : 0;
  desc.vocab_local = logits.shape.rank() == 2 ? logits.shape.dim(1) : 0;
  desc.vocab = p.vocab;
  desc.vocab_offset = p.vocab_offset;
  desc.ignore_index = p.ignore_index;
  desc.loss_scale = p.loss_scale;
  return desc;
}

TensorMeta f32(Shape shape) { return {std::move(shape), DType::kFloat32}; }

// Checks logits_local [tokens, vocab_local] and labels [tokens] against the params; returns tokens.
std::int64_t check_logits_and_labels(std::string_view op, const Params& p, const TensorMeta& logits,
                                     const TensorMeta& labels) {
  SG_CHECK(logits.shape.rank() == 2, "op ", op, ": logits_local must be [tokens, vocab_local], got ", logits.shape);
  const std::int64_t tokens = logits.shape.dim(0);
  SG_CHECK(labels.shape == Shape{tokens}, "op ", op, ": labels must be [", tokens, "] to match the logits ",
           logits.shape, ", got ", labels.shape);
  kernels::check_parallel_cross_entropy(describe(p, logits, labels));
  return tokens;
}

// Checks that `meta` is fp32 of `shape`, naming the op and the input.
void expect_f32(std::string_view op, std::string_view what, const TensorMeta& meta, const Shape& shape) {
  SG_CHECK(meta == f32(shape), "op ", op, ": ", what, " must be fp32 ", shape, ", got ", dtype_name(meta.dtype), " ",
           meta.shape);
}

std::vector<TensorMeta> check_stats(const OpParams& params, std::span<const TensorMeta> inputs) {
  const Params& p = params.as<Params>();
  const auto o = bind_metas<StatsOperands>(kStats, p, inputs);
  const std::int64_t tokens = check_logits_and_labels(kStats, p, o.logits_local, o.labels);
  return output_metas(p, Stats<TensorMeta>{.local_max = f32(Shape{tokens}), .partial = f32(Shape{tokens, 2})});
}

std::vector<TensorMeta> check_rescale(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<RescaleOperands>(kRescale, params.as<Params>(), inputs);
  SG_CHECK(o.local_max.shape.rank() == 1 && o.local_max.shape.dim(0) > 0, "op ", kRescale,
           ": local_max must be [tokens], got ", o.local_max.shape);
  const std::int64_t tokens = o.local_max.shape.dim(0);
  expect_f32(kRescale, "local_max", o.local_max, Shape{tokens});
  expect_f32(kRescale, "global_max", o.global_max, Shape{tokens});
  expect_f32(kRescale, "partial", o.partial, Shape{tokens, 2});
  return {f32(Shape{tokens, 2})};
}

std::vector<TensorMeta> check_finish(const OpParams& params, std::span<const TensorMeta> inputs) {
  const Params& p = params.as<Params>();
  const auto o = bind_metas<FinishOperands>(kFinish, p, inputs);
  const std::int64_t tokens = check_logits_and_labels(kFinish, p, o.logits_local, o.labels);
  expect_f32(kFinish, "global_max", o.global_max, Shape{tokens});
  expect_f32(kFinish, "totals", o.totals, Shape{tokens, 2});
  SG_CHECK(o.error_flag == (TensorMeta{Shape{1}, DType::kInt32}), "op ", kFinish,
           ": the error flag must be int32 [1], got ", o.error_flag.shape, " ", dtype_name(o.error_flag.dtype));
  const auto scratch = static_cast<std::int64_t>(
      (kernels::parallel_cross_entropy_workspace_bytes(describe(p, o.logits_local, o.labels)) + 3) / 4);
  return output_metas(p, FinishOutputs<TensorMeta>{
                             .loss = f32(Shape{}), .dlogits_local = o.logits_local, .scratch = f32(Shape{scratch})});
}

template <typename Operands>
kernels::ParallelCrossEntropyDesc describe(const Params& p, const Operands& o) {
  return describe(p, *o.logits_local.meta, *o.labels.meta);
}

}  // namespace

const OpDef& vocab_parallel_cross_entropy_stats_op() {
  static const OpDef op{
      .name = kStats,
      .check = check_stats,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const Params& p = params.as<Params>();
            const auto in = bind_args<StatsOperands>(p, a);
            const auto out = bind_outputs<Stats>(p, a);
            kernels::launch_parallel_cross_entropy_stats(describe(p, in), in.logits_local.data, in.labels.data,
                                                         out.local_max.as<float>(), out.partial.as<float>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const Params& p = params.as<Params>();
            const auto in = bind_args<StatsOperands>(p, a);
            const auto out = bind_outputs<Stats>(p, a);
            kernels::host::parallel_cross_entropy_stats(describe(p, in), in.logits_local.data, in.labels.data,
                                                        out.local_max.as<float>(), out.partial.as<float>());
          },
  };
  return op;
}
SG_REGISTER_OP(vocab_parallel_cross_entropy_stats_op);

const OpDef& vocab_parallel_cross_entropy_rescale_op() {
  static const OpDef op{
      .name = kRescale,
      .check = check_rescale,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const auto o = bind_args<RescaleOperands>(params.as<Params>(), a);
            kernels::launch_parallel_cross_entropy_rescale(o.local_max.shape().dim(0), o.local_max.as<float>(),
                                                           o.global_max.as<float>(), o.partial.as<float>(),
                                                           static_cast<float*>(a.outputs[0]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto o = bind_args<RescaleOperands>(params.as<Params>(), a);
            kernels::host::parallel_cross_entropy_rescale(o.local_max.shape().dim(0), o.local_max.as<float>(),
                                                          o.global_max.as<float>(), o.partial.as<float>(),
                                                          static_cast<float*>(a.outputs[0]));
          },
  };
  return op;
}
SG_REGISTER_OP(vocab_parallel_cross_entropy_rescale_op);

const OpDef& vocab_parallel_cross_entropy_finish_op() {
  static const OpDef op{
      .name = kFinish,
      .check = check_finish,
      .mutated_inputs_for = written_inputs_of<FinishOperands, Params>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const Params& p = params.as<Params>();
            const auto in = bind_args<FinishOperands>(p, a);
            const auto out = bind_outputs<FinishOutputs>(p, a);
            kernels::launch_parallel_cross_entropy_finish(describe(p, in), in.logits_local.data, in.labels.data,
                                                          in.global_max.as<float>(), in.totals.as<float>(),
                                                          out.loss.as<float>(), out.dlogits_local.data,
                                                          out.scratch.data, in.error_flag.as<std::int32_t>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const Params& p = params.as<Params>();
            const auto in = bind_args<FinishOperands>(p, a);
            const auto out = bind_outputs<FinishOutputs>(p, a);
            kernels::host::parallel_cross_entropy_finish(
                describe(p, in), in.logits_local.data, in.labels.data, in.global_max.as<float>(), in.totals.as<float>(),
                out.loss.as<float>(), out.dlogits_local.data, in.error_flag.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(vocab_parallel_cross_entropy_finish_op);

CrossEntropyResult vocab_parallel_cross_entropy(Context& ctx, Communicator& tp, const Tensor& logits_local,
                                                const Tensor& labels, const Tensor& error_flag,
                                                std::int64_t vocab_offset, const CrossEntropyParams& params) {
  SG_CHECK(logits_local.defined() && logits_local.shape().rank() == 2,
           "vocab_parallel_cross_entropy: logits_local must be [tokens, vocab / ", tp.world_size(), "], got ",
           logits_local.defined() ? detail::concat(logits_local.shape()) : std::string("an undefined tensor"));
  const std::int64_t local = logits_local.shape().dim(1);
  SG_CHECK(vocab_offset == tp.rank() * local, "vocab_parallel_cross_entropy: vocab_offset ", vocab_offset,
           " is not the first column of rank ", tp.rank(), "'s slice (", tp.rank(), " * ", local, " = ",
           tp.rank() * local, ") of ", tp.describe(), "; pass VocabParallelHead::vocab_offset()");
  const VocabParallelCrossEntropyParams p{.vocab = local * tp.world_size(),
                                          .vocab_offset = vocab_offset,
                                          .ignore_index = params.ignore_index,
                                          .loss_scale = params.loss_scale};
  // See Note [Vocabulary-parallel cross-entropy] for the steps.
  const Stats<Tensor> stats = bind_results<Stats>(
      p, ctx.call(vocab_parallel_cross_entropy_stats_op(), p,
                  flatten(kStats, p, StatsOperands<Tensor>{.logits_local = logits_local, .labels = labels})));
  const Tensor global_max = all_reduce(ctx, tp, stats.local_max, ReduceOp::kMax).set_name("ce.global_max");
  const Tensor scaled =
      ctx.call(vocab_parallel_cross_entropy_rescale_op(), p,
               flatten(kRescale, p,
                       RescaleOperands<Tensor>{
                           .local_max = stats.local_max, .global_max = global_max, .partial = stats.partial}))
          .at(0);
  const Tensor totals = all_reduce(ctx, tp, scaled, ReduceOp::kSum).set_name("ce.totals");
  const FinishOutputs<Tensor> out =
      bind_results<FinishOutputs>(p, ctx.call(vocab_parallel_cross_entropy_finish_op(), p,
                                              flatten(kFinish, p,
                                                      FinishOperands<Tensor>{.logits_local = logits_local,
                                                                             .labels = labels,
                                                                             .global_max = global_max,
                                                                             .totals = totals,
                                                                             .error_flag = error_flag})));
  return {out.loss, out.dlogits_local};
}

}  // namespace stepgraph::ops
