#include "ops/fp8_ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/error.h"
#include "kernels/fp8_fused.h"
#include "kernels/fp8_quantize.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string QuantizeParams::to_string() const {
  return std::string(fp8_format_name(format)) + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "");
}

std::string ScaleFromAmaxParams::to_string() const {
  return std::string(fp8_format_name(format)) + (power_of_two ? " power_of_two" : "");
}

std::string DelayedScalingParams::to_string() const {
  return std::string(fp8_format_name(format)) + " " + recipe.to_string();
}

namespace {

// Tensor-wise quantize and amax read x of rank >= 2 as the matrix [rows,
// cols] of its last dimension and the product of the others (a GroupedLinear
// weight [E, N, K] as [E * N, K]).
std::int64_t matrix_cols(const Shape& shape) { return shape.dim(shape.rank() - 1); }
std::int64_t matrix_rows(const Shape& shape) { return shape.numel() / std::max<std::int64_t>(1, matrix_cols(shape)); }

const TensorMeta kScalar{Shape{1}, DType::kFloat32};
const TensorMeta kFlag{Shape{1}, DType::kInt32};

void expect_scalar(std::string_view op, std::string_view role, const TensorMeta& got) {
  SG_CHECK(got == kScalar, "op ", op, ": ", role, " must be [1] fp32, got ", got.shape, " ", dtype_name(got.dtype));
}

// --- quantize and quantize_into_ ------------------------------------------------

template <typename F>
struct QuantizeOperands {
  F x;      // [rows, cols] (or [..., cols])
  F scale;  // fp32 [1]
};

template <typename F, typename V>
void visit_operands(const QuantizeParams&, QuantizeOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v({"scale"}, o.scale);
}

// quantize's outputs, and what quantize_into_ writes.
template <typename F>
struct QuantizeOutputs {
  F rowwise;     // FP8 [rows, cols], with params.rowwise
  F columnwise;  // FP8 [cols, rows], with params.columnwise
  F amax;        // fp32 [1]
};

template <typename F, typename V>
void visit_operands(const QuantizeParams& p, QuantizeOutputs<F>& o, V& v, Use use = Use::kRead) {
  v({.name = "rowwise", .use = use, .present = p.rowwise}, o.rowwise);
  v({.name = "columnwise", .use = use, .present = p.columnwise}, o.columnwise);
  v({.name = "amax", .use = use}, o.amax);
}

template <typename F>
struct QuantizeIntoOperands {
  QuantizeOperands<F> in;
  QuantizeOutputs<F> out;  // written
};

template <typename F, typename V>
void visit_operands(const QuantizeParams& p, QuantizeIntoOperands<F>& o, V& v) {
  visit_operands(p, o.in, v);
  visit_operands(p, o.out, v, Use::kWrite);
}

constexpr std::string_view kQuantize = "quantize";
constexpr std::string_view kQuantizeInto = "quantize_into_";

kernels::QuantizeDesc describe(const QuantizeParams& p, const TensorMeta& x) {
  kernels::QuantizeDesc desc;
  desc.in_dtype = x.dtype;
  desc.format = p.format;
  desc.rows = matrix_rows(x.shape);
  desc.cols = matrix_cols(x.shape);
  desc.rowwise = p.rowwise;
  desc.columnwise = p.columnwise;
  return desc;
}

QuantizeOutputs<TensorMeta> check_quantize(std::string_view op, const QuantizeParams& p,
                                           const QuantizeOperands<TensorMeta>& o) {
  SG_CHECK(o.x.shape.rank() >= 2, "op ", op,
           ": x must be [rows, cols] (or [..., cols], read as rows of its last dimension), got ", o.x.shape);
  SG_CHECK(o.scale == kScalar, "op ", op, ": scale must be [1] fp32, got ", o.scale.shape, " ",
           dtype_name(o.scale.dtype));
  const kernels::QuantizeDesc desc = describe(p, o.x);
  kernels::check_quantize(desc);
  const DType q = fp8_dtype(p.format);
  return {.rowwise = {Shape{desc.rows, desc.cols}, q}, .columnwise = {Shape{desc.cols, desc.rows}, q}, .amax = kScalar};
}

std::vector<TensorMeta> check(const OpParams& params, std::span<const TensorMeta> inputs) {
  const QuantizeParams& p = params.as<QuantizeParams>();
  return output_metas(p, check_quantize(kQuantize, p, bind_metas<QuantizeOperands>(kQuantize, p, inputs)));
}

std::uint8_t* bytes_of(const Operand& fp8) { return fp8.as<std::uint8_t>(); }

void launch_quantize(const QuantizeParams& p, const QuantizeOperands<Operand>& in, const QuantizeOutputs<Operand>& out,
                     CUstream_st* stream) {
  const kernels::QuantizeDesc desc = describe(p, *in.x.meta);
  const auto* scale = in.scale.as<const float>();
  // The vectorised tile kernel where it applies (16-bit x), the general one otherwise: the same bytes.
  if (!kernels::launch_quantize_vectorized(
          desc.in_dtype, desc.rows, desc.cols, in.x.data,
          {desc.format, scale, bytes_of(out.rowwise), bytes_of(out.columnwise), out.amax.as<float>()}, stream)) {
    kernels::launch_quantize(desc, in.x.data, scale, bytes_of(out.rowwise), bytes_of(out.columnwise),
                             out.amax.as<float>(), stream);
  }
}

void run_quantize_host(const QuantizeParams& p, const QuantizeOperands<Operand>& in,
                       const QuantizeOutputs<Operand>& out) {
  kernels::quantize_host(describe(p, *in.x.meta), in.x.data, *in.scale.as<const float>(), bytes_of(out.rowwise),
                         bytes_of(out.columnwise), out.amax.as<float>());
}

}  // namespace

const OpDef& quantize_op() {
  static const OpDef op{
      .name = kQuantize,
      .check = check,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const QuantizeParams& p = params.as<QuantizeParams>();
            launch_quantize(p, bind_args<QuantizeOperands>(p, a), bind_outputs<QuantizeOutputs>(p, a), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const QuantizeParams& p = params.as<QuantizeParams>();
            run_quantize_host(p, bind_args<QuantizeOperands>(p, a), bind_outputs<QuantizeOutputs>(p, a));
          },
  };
  return op;
}
SG_REGISTER_OP(quantize_op);

namespace {

void expect_destination(std::string_view name, const TensorMeta& got, const TensorMeta& want) {
  SG_CHECK(got == want, "op quantize_into_: ", name, " must be ", want.shape, " ", dtype_name(want.dtype), ", got ",
           got.shape, " ", dtype_name(got.dtype));
}

std::vector<TensorMeta> check_into(const OpParams& params, std::span<const TensorMeta> inputs) {
  const QuantizeParams& p = params.as<QuantizeParams>();
  const auto o = bind_metas<QuantizeIntoOperands>(kQuantizeInto, p, inputs);
  const QuantizeOutputs<TensorMeta> want = check_quantize(kQuantizeInto, p, o.in);
  if (p.rowwise) expect_destination("rowwise", o.out.rowwise, want.rowwise);
  if (p.columnwise) expect_destination("columnwise", o.out.columnwise, want.columnwise);
  expect_destination("amax", o.out.amax, want.amax);
  return {};
}

}  // namespace

const OpDef& quantize_into_op() {
  static const OpDef op{
      .name = kQuantizeInto,
      .check = check_into,
      .mutated_inputs_for = written_inputs_of<QuantizeIntoOperands, QuantizeParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const QuantizeParams& p = params.as<QuantizeParams>();
            const auto o = bind_args<QuantizeIntoOperands>(p, a);
            launch_quantize(p, o.in, o.out, stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const QuantizeParams& p = params.as<QuantizeParams>();
            const auto o = bind_args<QuantizeIntoOperands>(p, a);
            run_quantize_host(p, o.in, o.out);
          },
  };
  return op;
}
SG_REGISTER_OP(quantize_into_op);

std::string BlockQuantizeParams::to_string() const {
  return std::string(fp8_format_name(format)) + (shape == kernels::BlockShape::k1x128 ? " 1x128" : " 128x128") +
         (power_of_two ? " power_of_two" : "") + (rowwise ? " rowwise" : "") + (columnwise ? " columnwise" : "");
}

namespace {

// --- quantize_blocks ----------------------------------------------------------------

template <typename F>
struct BlockResults {
  F rowwise, rowwise_scale_inv;        // with params.rowwise
  F columnwise, columnwise_scale_inv;  // with params.columnwise
  F non_finite;                        // int32 [1]
};

template <typename F, typename V>
void visit_operands(const BlockQuantizeParams& p, BlockResults<F>& o, V& v) {
  v({.name = "rowwise", .present = p.rowwise}, o.rowwise);
  v({.name = "rowwise_scale_inv", .present = p.rowwise}, o.rowwise_scale_inv);
  v({.name = "columnwise", .present = p.columnwise}, o.columnwise);
  v({.name = "columnwise_scale_inv", .present = p.columnwise}, o.columnwise_scale_inv);
  v({"non_finite"}, o.non_finite);
}

constexpr std::string_view kBlocks = "quantize_blocks";

kernels::QuantizeDesc describe_blocks(const BlockQuantizeParams& p, const TensorMeta& x) {
  return {x.dtype, p.format, x.shape.dim(0), x.shape.dim(1), p.rowwise, p.columnwise};
}

std::vector<TensorMeta> check_blocks(const OpParams& params, std::span<const TensorMeta> inputs) {
  const BlockQuantizeParams& p = params.as<BlockQuantizeParams>();
  const auto o = bind_metas<ReadOperand>(kBlocks, p, inputs);
  SG_CHECK(o.x.shape.rank() == 2, "op quantize_blocks: x must be 2-D [rows, cols], got ", o.x.shape);
  const kernels::QuantizeDesc desc = describe_blocks(p, o.x);
  kernels::check_block_quantize(desc, p.shape);
  const DType q = fp8_dtype(p.format);
  auto scales = [&](std::int64_t outer, std::int64_t k) {
    return TensorMeta{Shape{kernels::BlockScaleLayout{p.shape, outer, k}.count()}, DType::kFloat32};
  };
  return output_metas(p, BlockResults<TensorMeta>{.rowwise = {Shape{desc.rows, desc.cols}, q},
                                                  .rowwise_scale_inv = scales(desc.rows, desc.cols),
                                                  .columnwise = {Shape{desc.cols, desc.rows}, q},
                                                  .columnwise_scale_inv = scales(desc.cols, desc.rows),
                                                  .non_finite = kFlag});
}

kernels::BlockOutputs block_outputs(const BlockResults<Operand>& out) {
  return {bytes_of(out.rowwise), out.rowwise_scale_inv.as<float>(), bytes_of(out.columnwise),
          out.columnwise_scale_inv.as<float>()};
}

}  // namespace

const OpDef& quantize_blocks_op() {
  static const OpDef op{
      .name = kBlocks,
      .check = check_blocks,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const BlockQuantizeParams& p = params.as<BlockQuantizeParams>();
            const auto in = bind_args<ReadOperand>(p, a);
            const auto out = bind_outputs<BlockResults>(p, a);
            kernels::launch_quantize_blocks(describe_blocks(p, *in.x.meta), p.shape, p.power_of_two, in.x.data,
                                            block_outputs(out), out.non_finite.as<int>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const BlockQuantizeParams& p = params.as<BlockQuantizeParams>();
            const auto in = bind_args<ReadOperand>(p, a);
            const auto out = bind_outputs<BlockResults>(p, a);
            const bool ok = kernels::quantize_blocks_host(describe_blocks(p, *in.x.meta), p.shape, p.power_of_two,
                                                          in.x.data, block_outputs(out));
            *out.non_finite.as<std::int32_t>() = ok ? 0 : 1;
          },
  };
  return op;
}
SG_REGISTER_OP(quantize_blocks_op);

BlockQuantized quantize_blocks(Context& ctx, const Tensor& x, const BlockQuantizeParams& params) {
  const std::vector<Tensor> out =
      ctx.call(quantize_blocks_op(), params, flatten(kBlocks, params, ReadOperand<Tensor>{x}));
  const BlockResults<Tensor> r = bind_results<BlockResults>(params, out);
  return {.rowwise = r.rowwise,
          .rowwise_scale_inv = r.rowwise_scale_inv,
          .columnwise = r.columnwise,
          .columnwise_scale_inv = r.columnwise_scale_inv,
          .non_finite = r.non_finite};
}

namespace {

// --- amax, scales, delayed scaling, flag counts ------------------------------------

template <typename F>
struct ScaleFromAmaxOperands {
  F amax;  // fp32 [1]
};

template <typename F, typename V>
void visit_operands(const ScaleFromAmaxParams&, ScaleFromAmaxOperands<F>& o, V& v) {
  v({"amax"}, o.amax);
}

template <typename F>
struct ScaleResults {
  F scale, scale_inv;  // fp32 [1]
  F non_finite;        // int32 [1]
};

template <typename F, typename V>
void visit_operands(const ScaleFromAmaxParams&, ScaleResults<F>& o, V& v) {
  v({"scale"}, o.scale);
  v({"scale_inv"}, o.scale_inv);
  v({"non_finite"}, o.non_finite);
}

template <typename F>
struct DelayedOperands {
  F amax;              // fp32 [1]: this step's
  F history;           // fp32 [amax_history_len], written
  F scale, scale_inv;  // fp32 [1], written
};

template <typename F, typename V>
void visit_operands(const DelayedScalingParams&, DelayedOperands<F>& o, V& v) {
  v({"amax"}, o.amax);
  v({.name = "history", .use = Use::kWrite}, o.history);
  v({.name = "scale", .use = Use::kWrite}, o.scale);
  v({.name = "scale_inv", .use = Use::kWrite}, o.scale_inv);
}

template <typename F>
struct CountFlagsOperands {
  F counter;             // int32 [1], written
  std::vector<F> flags;  // int32 [1] each
};

template <typename F, typename V>
void visit_operands(const NoParams&, CountFlagsOperands<F>& o, V& v) {
  v({.name = "counter", .use = Use::kWrite}, o.counter);
  v.list("flags", o.flags, kRestOfInputs);
  for (std::size_t i = 0; i < o.flags.size(); ++i)
    v({.name = "flags", .index = static_cast<std::int64_t>(i)}, o.flags[i]);
}

constexpr std::string_view kAmax = "amax";
constexpr std::string_view kScaleFromAmax = "scale_from_amax";
constexpr std::string_view kDelayed = "delayed_scaling_update_";
constexpr std::string_view kCountFlags = "count_flags_";

std::vector<TensorMeta> check_amax(const OpParams&, std::span<const TensorMeta> inputs) {
  const auto o = bind_metas<ReadOperand>(kAmax, NoParams{}, inputs);
  SG_CHECK(o.x.shape.rank() >= 2, "op amax: x must be [rows, cols] (or [..., cols]), got ", o.x.shape);
  kernels::check_quantize({o.x.dtype, Fp8Format::kE4M3, matrix_rows(o.x.shape), matrix_cols(o.x.shape), true, false});
  return {kScalar};
}

std::vector<TensorMeta> check_scale_from_amax(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<ScaleFromAmaxParams>();
  expect_scalar(kScaleFromAmax, "amax", bind_metas<ScaleFromAmaxOperands>(kScaleFromAmax, p, inputs).amax);
  return output_metas(p, ScaleResults<TensorMeta>{kScalar, kScalar, kFlag});
}

std::vector<TensorMeta> check_delayed(const OpParams& params, std::span<const TensorMeta> inputs) {
  const DelayedScalingParams& p = params.as<DelayedScalingParams>();
  p.recipe.check();
  SG_CHECK(p.recipe.scaling == Fp8Scaling::kDelayed, "op delayed_scaling_update_: the recipe's scaling is ",
           fp8_scaling_name(p.recipe.scaling), ", not delayed");
  const auto o = bind_metas<DelayedOperands>(kDelayed, p, inputs);
  expect_scalar(kDelayed, "amax", o.amax);
  const TensorMeta history{Shape{p.recipe.amax_history_len}, DType::kFloat32};
  SG_CHECK(o.history == history, "op delayed_scaling_update_: history must be ", history.shape,
           " fp32 (the recipe's amax_history_len), got ", o.history.shape, " ", dtype_name(o.history.dtype));
  expect_scalar(kDelayed, "scale", o.scale);
  expect_scalar(kDelayed, "scale_inv", o.scale_inv);
  return {kFlag};
}

}  // namespace

const OpDef& amax_op() {
  static const OpDef op{
      .name = kAmax,
      .check = check_amax,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            const Operand x = bind_args<ReadOperand>(NoParams{}, a).x;
            const std::int64_t rows = matrix_rows(x.shape()), cols = matrix_cols(x.shape());
            auto* amax = static_cast<float*>(a.outputs[0]);
            if (!kernels::launch_quantize_vectorized(x.dtype(), rows, cols, x.data, {.amax = amax}, stream)) {
              kernels::launch_amax(x.dtype(), rows, cols, x.data, amax, stream);
            }
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const Operand x = bind_args<ReadOperand>(NoParams{}, a).x;
            *static_cast<float*>(a.outputs[0]) =
                kernels::amax_host(x.dtype(), matrix_rows(x.shape()), matrix_cols(x.shape()), x.data);
          },
  };
  return op;
}
SG_REGISTER_OP(amax_op);

const OpDef& scale_from_amax_op() {
  static const OpDef op{
      .name = kScaleFromAmax,
      .check = check_scale_from_amax,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const ScaleFromAmaxParams& p = params.as<ScaleFromAmaxParams>();
            const auto in = bind_args<ScaleFromAmaxOperands>(p, a);
            const auto out = bind_outputs<ScaleResults>(p, a);
            kernels::launch_scale_from_amax(in.amax.as<const float>(), p.format, p.power_of_two, out.scale.as<float>(),
                                            out.scale_inv.as<float>(), out.non_finite.as<int>(), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const ScaleFromAmaxParams& p = params.as<ScaleFromAmaxParams>();
            const auto in = bind_args<ScaleFromAmaxOperands>(p, a);
            const auto out = bind_outputs<ScaleResults>(p, a);
            const float amax = *in.amax.as<const float>();
            const bool ok = kernels::amax_is_usable(amax);
            const float scale = ok ? kernels::fp8_scale(amax, p.format, 0, p.power_of_two) : 1.0f;
            *out.scale.as<float>() = scale;
            *out.scale_inv.as<float>() = 1.0f / scale;
            *out.non_finite.as<std::int32_t>() = ok ? 0 : 1;
          },
  };
  return op;
}
SG_REGISTER_OP(scale_from_amax_op);

const OpDef& delayed_scaling_update_op() {
  static const OpDef op{
      .name = kDelayed,
      .check = check_delayed,
      .mutated_inputs_for = written_inputs_of<DelayedOperands, DelayedScalingParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            const DelayedScalingParams& p = params.as<DelayedScalingParams>();
            const auto o = bind_args<DelayedOperands>(p, a);
            kernels::launch_delayed_scaling_update(p.recipe, p.format, o.amax.as<const float>(), o.history.as<float>(),
                                                   o.scale.as<float>(), o.scale_inv.as<float>(),
                                                   static_cast<int*>(a.outputs[0]), stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const DelayedScalingParams& p = params.as<DelayedScalingParams>();
            const auto o = bind_args<DelayedOperands>(p, a);
            const bool ok = kernels::delayed_scaling_update_host(
                p.recipe, p.format, *o.amax.as<const float>(),
                {o.history.as<float>(), o.scale.as<float>(), o.scale_inv.as<float>()});
            *static_cast<std::int32_t*>(a.outputs[0]) = ok ? 0 : 1;
          },
  };
  return op;
}
SG_REGISTER_OP(delayed_scaling_update_op);

const OpDef& count_flags_op() {
  static const OpDef op{
      .name = kCountFlags,
      .check =
          [](const OpParams&, std::span<const TensorMeta> inputs) {
            const auto o = bind_metas<CountFlagsOperands>(kCountFlags, NoParams{}, inputs);
            SG_CHECK(o.flags.size() <= kernels::kMaxCountedFlags, "op count_flags_ takes the counter and 0 to ",
                     kernels::kMaxCountedFlags, " flags, got ", o.flags.size(), " flags");
            SG_CHECK(o.counter == kFlag, "op count_flags_: the counter must be [1] int32, got ", o.counter.shape, " ",
                     dtype_name(o.counter.dtype));
            for (const TensorMeta& t : o.flags) {
              SG_CHECK(t == kFlag, "op count_flags_: flags must be [1] int32, got ", t.shape, " ", dtype_name(t.dtype));
            }
            return std::vector<TensorMeta>{};
          },
      .mutated_inputs_for = written_inputs_of<CountFlagsOperands, NoParams>,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* stream) {
            const auto o = bind_args<CountFlagsOperands>(NoParams{}, a);
            std::vector<const int*> flags;
            for (const Operand& flag : o.flags) flags.push_back(flag.as<const int>());
            kernels::launch_count_flags(flags.data(), static_cast<int>(flags.size()), o.counter.as<int>(), stream);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<CountFlagsOperands>(NoParams{}, a);
            for (const Operand& flag : o.flags) *o.counter.as<std::int32_t>() += *flag.as<const std::int32_t>();
          },
  };
  return op;
}
SG_REGISTER_OP(count_flags_op);

void count_flags_(Context& ctx, const Tensor& counter, const std::vector<Tensor>& flags) {
  ctx.call(count_flags_op(), NoParams{},
           flatten(kCountFlags, NoParams{}, CountFlagsOperands<Tensor>{.counter = counter, .flags = flags}));
}

Tensor amax(Context& ctx, const Tensor& x) {
  return ctx.call(amax_op(), NoParams{}, flatten(kAmax, NoParams{}, ReadOperand<Tensor>{x})).front();
}

Scales scale_from_amax(Context& ctx, const Tensor& amax, const ScaleFromAmaxParams& params) {
  const std::vector<Tensor> out =
      ctx.call(scale_from_amax_op(), params, flatten(kScaleFromAmax, params, ScaleFromAmaxOperands<Tensor>{amax}));
  const ScaleResults<Tensor> r = bind_results<ScaleResults>(params, out);
  return {r.scale, r.scale_inv, r.non_finite};
}

Tensor delayed_scaling_update_(Context& ctx, const DelayedScalingParams& params, const Tensor& amax,
                               const Tensor& history, const Tensor& scale, const Tensor& scale_inv) {
  return ctx
      .call(delayed_scaling_update_op(), params,
            flatten(kDelayed, params,
                    DelayedOperands<Tensor>{.amax = amax, .history = history, .scale = scale, .scale_inv = scale_inv}))
      .front();
}

Quantized quantize(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params) {
  const std::vector<Tensor> out =
      ctx.call(quantize_op(), params, flatten(kQuantize, params, QuantizeOperands<Tensor>{.x = x, .scale = scale}));
  const QuantizeOutputs<Tensor> r = bind_results<QuantizeOutputs>(params, out);
  return {.rowwise = r.rowwise, .columnwise = r.columnwise, .amax = r.amax};
}

void quantize_into_(Context& ctx, const Tensor& x, const Tensor& scale, const QuantizeParams& params,
                    const Tensor& rowwise, const Tensor& columnwise, const Tensor& amax) {
  ctx.call(quantize_into_op(), params,
           flatten(kQuantizeInto, params,
                   QuantizeIntoOperands<Tensor>{.in = {.x = x, .scale = scale},
                                                .out = {.rowwise = params.rowwise ? rowwise : Tensor(),
                                                        .columnwise = params.columnwise ? columnwise : Tensor(),
                                                        .amax = amax}}));
}

}  // namespace stepgraph::ops
