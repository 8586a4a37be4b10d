#include "ops/parallel_loss_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "kernels/parallel_cross_entropy.h"
#include "ops/collective_ops.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::string VocabParallelCrossEntropyParams::to_string() const {
  char text[128];
  std::snprintf(text, sizeof(text), "vocab=%lld, offset=%lld, ignore=%lld, scale=%g", static_cast<long long>(vocab),
                static_cast<long long>(vocab_offset), static_cast<long long>(ignore_index),
                static_cast<double>(loss_scale));
  return text;
}

namespace {

const VocabParallelCrossEntropyParams& of(const OpParams& params) {
  return params.as<VocabParallelCrossEntropyParams>();
}

// logits [tokens, vocab_local] and labels [tokens] lead every step that reads the logits.
kernels::ParallelCrossEntropyDesc describe(const VocabParallelCrossEntropyParams& p,
                                           std::span<const TensorMeta> inputs) {
  kernels::ParallelCrossEntropyDesc desc;
  desc.logits_type = inputs[0].dtype;
  desc.label_type = inputs[1].dtype;
  desc.tokens = inputs[0].shape.rank() == 2 ? inputs[0].shape.dim(0) : 0;
  desc.vocab_local = inputs[0].shape.rank() == 2 ? inputs[0].shape.dim(1) : 0;
  desc.vocab = p.vocab;
  desc.vocab_offset = p.vocab_offset;
  desc.ignore_index = p.ignore_index;
  desc.loss_scale = p.loss_scale;
  return desc;
}

TensorMeta f32(Shape shape) { return {std::move(shape), DType::kFloat32}; }

// Checks logits_local [tokens, vocab_local] and labels [tokens] against the params; returns tokens.
std::int64_t check_logits_and_labels(std::string_view op, const OpParams& params, std::span<const TensorMeta> inputs) {
  SG_CHECK(inputs[0].shape.rank() == 2, "op ", op, ": logits_local must be [tokens, vocab_local], got ",
           inputs[0].shape);
  const std::int64_t tokens = inputs[0].shape.dim(0);
  SG_CHECK(inputs[1].shape == Shape{tokens}, "op ", op, ": labels must be [", tokens, "] to match the logits ",
           inputs[0].shape, ", got ", inputs[1].shape);
  kernels::check_parallel_cross_entropy(describe(of(params), inputs));
  return tokens;
}

// Checks that `meta` is fp32 of `shape`, naming the op and the input.
void expect_f32(std::string_view op, std::string_view what, const TensorMeta& meta, const Shape& shape) {
  SG_CHECK(meta == f32(shape), "op ", op, ": ", what, " must be fp32 ", shape, ", got ", dtype_name(meta.dtype), " ",
           meta.shape);
}

std::vector<TensorMeta> check_stats(const OpParams& params, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "vocab_parallel_cross_entropy_stats";
  SG_CHECK(inputs.size() == 2, "op ", kOp, " takes logits_local and labels, got ", inputs.size(), " inputs");
  const std::int64_t tokens = check_logits_and_labels(kOp, params, inputs);
  return {f32(Shape{tokens}), f32(Shape{tokens, 2})};
}

std::vector<TensorMeta> check_rescale(const OpParams&, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "vocab_parallel_cross_entropy_rescale";
  SG_CHECK(inputs.size() == 3, "op ", kOp, " takes local_max, global_max and partial, got ", inputs.size(),
           " inputs");
  SG_CHECK(inputs[0].shape.rank() == 1 && inputs[0].shape.dim(0) > 0, "op ", kOp,
           ": local_max must be [tokens], got ", inputs[0].shape);
  const std::int64_t tokens = inputs[0].shape.dim(0);
  expect_f32(kOp, "local_max", inputs[0], Shape{tokens});
  expect_f32(kOp, "global_max", inputs[1], Shape{tokens});
  expect_f32(kOp, "partial", inputs[2], Shape{tokens, 2});
  return {f32(Shape{tokens, 2})};
}

std::vector<TensorMeta> check_finish(const OpParams& params, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "vocab_parallel_cross_entropy_finish";
  SG_CHECK(inputs.size() == 5, "op ", kOp, " takes logits_local, labels, global_max, totals and an error flag, got ",
           inputs.size(), " inputs");
  const std::int64_t tokens = check_logits_and_labels(kOp, params, inputs);
  expect_f32(kOp, "global_max", inputs[2], Shape{tokens});
  expect_f32(kOp, "totals", inputs[3], Shape{tokens, 2});
  SG_CHECK(inputs[4] == (TensorMeta{Shape{1}, DType::kInt32}), "op ", kOp, ": the error flag must be int32 [1], got ",
           inputs[4].shape, " ", dtype_name(inputs[4].dtype));
  const auto scratch = static_cast<std::int64_t>(
      (kernels::parallel_cross_entropy_workspace_bytes(describe(of(params), inputs)) + 3) / 4);
  return {f32(Shape{}), inputs[0], f32(Shape{scratch})};
}

float* as_f32(void* p) { return static_cast<float*>(p); }

}  // namespace

const OpDef& vocab_parallel_cross_entropy_stats_op() {
  static const OpDef op{
      .name = "vocab_parallel_cross_entropy_stats",
      .check = check_stats,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_parallel_cross_entropy_stats(describe(of(params), a.input_metas), a.inputs[0],
                                                         a.inputs[1], as_f32(a.outputs[0]), as_f32(a.outputs[1]),
                                                         stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::parallel_cross_entropy_stats(describe(of(params), a.input_metas), a.inputs[0], a.inputs[1],
                                                        as_f32(a.outputs[0]), as_f32(a.outputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(vocab_parallel_cross_entropy_stats_op);

const OpDef& vocab_parallel_cross_entropy_rescale_op() {
  static const OpDef op{
      .name = "vocab_parallel_cross_entropy_rescale",
      .check = check_rescale,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_parallel_cross_entropy_rescale(a.input_metas[0].shape.dim(0), as_f32(a.inputs[0]),
                                                           as_f32(a.inputs[1]), as_f32(a.inputs[2]),
                                                           as_f32(a.outputs[0]), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::parallel_cross_entropy_rescale(a.input_metas[0].shape.dim(0), as_f32(a.inputs[0]),
                                                          as_f32(a.inputs[1]), as_f32(a.inputs[2]),
                                                          as_f32(a.outputs[0]));
          },
  };
  return op;
}
SG_REGISTER_OP(vocab_parallel_cross_entropy_rescale_op);

const OpDef& vocab_parallel_cross_entropy_finish_op() {
  static const OpDef op{
      .name = "vocab_parallel_cross_entropy_finish",
      .check = check_finish,
      .mutated_inputs = {4},
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_parallel_cross_entropy_finish(
                describe(of(params), a.input_metas), a.inputs[0], a.inputs[1], as_f32(a.inputs[2]),
                as_f32(a.inputs[3]), as_f32(a.outputs[0]), a.outputs[1], a.outputs[2],
                static_cast<std::int32_t*>(a.inputs[4]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::parallel_cross_entropy_finish(describe(of(params), a.input_metas), a.inputs[0],
                                                         a.inputs[1], as_f32(a.inputs[2]), as_f32(a.inputs[3]),
                                                         as_f32(a.outputs[0]), a.outputs[1],
                                                         static_cast<std::int32_t*>(a.inputs[4]));
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
  const std::vector<Tensor> stats = ctx.call(vocab_parallel_cross_entropy_stats_op(), p, {logits_local, labels});
  const Tensor global_max = all_reduce(ctx, tp, stats[0], ReduceOp::kMax).set_name("ce.global_max");
  const Tensor scaled =
      ctx.call(vocab_parallel_cross_entropy_rescale_op(), p, {stats[0], global_max, stats[1]}).at(0);
  const Tensor totals = all_reduce(ctx, tp, scaled, ReduceOp::kSum).set_name("ce.totals");
  std::vector<Tensor> out =
      ctx.call(vocab_parallel_cross_entropy_finish_op(), p, {logits_local, labels, global_max, totals, error_flag});
  return {out[0], out[1]};
}

}  // namespace stepgraph::ops
