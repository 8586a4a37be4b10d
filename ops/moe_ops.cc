#include "ops/moe_ops.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

namespace stepgraph::ops {

std::string TopkParams::to_string() const { return "k=" + std::to_string(topk); }
std::string MoEPlanParams::to_string() const { return "experts=" + std::to_string(experts); }
std::string SplitOffsetsParams::to_string() const {
  return "tokens=" + std::to_string(tokens) + (sum == kernels::SplitSum::kAtMostRows ? " sum<=tokens" : "");
}

namespace {

const TensorMeta kErrorWord{Shape{1}, DType::kInt32};

void check_meta(std::string_view op, const char* what, const TensorMeta& got, const TensorMeta& want) {
  SG_CHECK(got == want, "op ", op, ": ", what, " must be ", want.shape, " ", dtype_name(want.dtype), ", got ",
           got.shape, " ", dtype_name(got.dtype));
}

void check_matrix(std::string_view op, const char* what, const TensorMeta& meta) {
  SG_CHECK(meta.shape.rank() == 2, "op ", op, ": ", what, " must be a matrix, got ", meta.shape);
}

// --- operands -----------------------------------------------------------------

template <typename F>
struct RouterOperands {
  F logits;  // [T, E]
  F bias;    // fp32 [E], optional: added for the choice only
};

template <typename F, typename V>
void visit_operands(const TopkParams&, RouterOperands<F>& o, V& v) {
  v({"logits"}, o.logits);
  v.optional_last({"bias"}, o.bias);
}

template <typename F>
struct RouterBackwardOperands {
  F dgates;   // fp32 [T, k]
  F logits;   // [T, E]
  F experts;  // int32 [T, k]
  F gates;    // fp32 [T, k]
};

template <typename F, typename V>
void visit_operands(const TopkParams&, RouterBackwardOperands<F>& o, V& v) {
  v({"dgates"}, o.dgates);
  v({"logits"}, o.logits);
  v({"experts"}, o.experts);
  v({"gates"}, o.gates);
}

// moe_plan and split_offsets: what they read and the error word they raise.
template <typename F>
struct PlanOperands {
  F experts;     // int32 [T, k]
  F error_word;  // int32 [1], written
};

template <typename F, typename V>
void visit_operands(const MoEPlanParams&, PlanOperands<F>& o, V& v) {
  v({"experts"}, o.experts);
  v({.name = "error_word", .use = Use::kWrite}, o.error_word);
}

template <typename F>
struct SplitOffsetsOperands {
  F splits;      // int32 [E]
  F error_word;  // int32 [1], written
};

template <typename F, typename V>
void visit_operands(const SplitOffsetsParams&, SplitOffsetsOperands<F>& o, V& v) {
  v({"splits"}, o.splits);
  v({.name = "error_word", .use = Use::kWrite}, o.error_word);
}

template <typename F>
struct PermuteOperands {
  F x;        // [T, H]
  F sources;  // int32 [T*k]
};

template <typename F, typename V>
void visit_operands(const NoParams&, PermuteOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v({"sources"}, o.sources);
}

template <typename F>
struct UnpermuteOperands {
  F y_perm;     // [T*k, H]
  F positions;  // int32 [T, k]
  F gates;      // fp32 [T, k], optional: weight 1 without
};

template <typename F, typename V>
void visit_operands(const NoParams&, UnpermuteOperands<F>& o, V& v) {
  v({"y_perm"}, o.y_perm);
  v({"positions"}, o.positions);
  v.optional_last({"gates"}, o.gates);
}

template <typename F>
struct UnpermuteBackwardOperands {
  F dy;         // [T, H]
  F y_perm;     // [T*k, H]
  F positions;  // int32 [T, k]
  F gates;      // fp32 [T, k]
};

template <typename F, typename V>
void visit_operands(const NoParams&, UnpermuteBackwardOperands<F>& o, V& v) {
  v({"dy"}, o.dy);
  v({"y_perm"}, o.y_perm);
  v({"positions"}, o.positions);
  v({"gates"}, o.gates);
}

template <typename F>
struct RouterOutputs {
  F experts;  // int32 [T, k]
  F gates;    // fp32 [T, k]
};

template <typename F, typename V>
void visit_operands(const TopkParams&, RouterOutputs<F>& o, V& v) {
  v({"experts"}, o.experts);
  v({"gates"}, o.gates);
}

template <typename F>
struct PlanOutputs {
  F splits;     // int32 [E]
  F offsets;    // int32 [E + 1]
  F positions;  // int32 [T, k]
  F sources;    // int32 [T * k]
  F scratch;    // int32: the kernel's workspace
};

template <typename F, typename V>
void visit_operands(const MoEPlanParams&, PlanOutputs<F>& o, V& v) {
  v({"splits"}, o.splits);
  v({"offsets"}, o.offsets);
  v({"positions"}, o.positions);
  v({"sources"}, o.sources);
  v({"scratch"}, o.scratch);
}

template <typename F>
struct UnpermuteBackwardOutputs {
  F dy_perm;  // [T*k, H]
  F dgates;   // fp32 [T, k]
};

template <typename F, typename V>
void visit_operands(const NoParams&, UnpermuteBackwardOutputs<F>& o, V& v) {
  v({"dy_perm"}, o.dy_perm);
  v({"dgates"}, o.dgates);
}

constexpr std::string_view kRouter = "router_topk";
constexpr std::string_view kRouterBackward = "router_topk_backward";
constexpr std::string_view kPlan = "moe_plan";
constexpr std::string_view kSplitOffsets = "split_offsets";
constexpr std::string_view kPermute = "moe_permute";
constexpr std::string_view kUnpermute = "moe_unpermute";
constexpr std::string_view kUnpermuteBackward = "moe_unpermute_backward";

// --- descriptors and checks -----------------------------------------------------

kernels::RouterDesc router_desc(const TopkParams& p, const TensorMeta& logits) {
  return {logits.dtype, logits.shape.dim(0), logits.shape.dim(1), p.topk};
}

// positions [T, k] gives the permute desc; rows are [T*k, H] of `dtype`.
kernels::PermuteDesc permute_desc(const TensorMeta& positions, std::int64_t hidden, DType dtype) {
  return {dtype, positions.shape.dim(0), hidden, static_cast<int>(positions.shape.dim(1))};
}

// The desc of rows [T*k, H] at positions [T, k].
kernels::PermuteDesc rows_desc(const Operand& rows, const Operand& positions) {
  return permute_desc(*positions.meta, rows.shape().dim(1), rows.dtype());
}

std::vector<TensorMeta> check_router_topk(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<TopkParams>();
  const auto o = bind_metas<RouterOperands>(kRouter, p, in);
  check_matrix(kRouter, "logits", o.logits);
  const kernels::RouterDesc desc = router_desc(p, o.logits);
  kernels::check_router(desc);
  if (operand_layout<RouterOperands>(p, in.size()).at.bias >= 0) {
    check_meta(kRouter, "the expert bias", o.bias, {Shape{desc.experts}, DType::kFloat32});
  }
  const Shape out{desc.tokens, desc.topk};
  return output_metas(p, RouterOutputs<TensorMeta>{.experts = {out, DType::kInt32}, .gates = {out, DType::kFloat32}});
}

std::vector<TensorMeta> check_router_backward(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<TopkParams>();
  const auto o = bind_metas<RouterBackwardOperands>(kRouterBackward, p, in);
  check_matrix(kRouterBackward, "logits", o.logits);
  const kernels::RouterDesc desc = router_desc(p, o.logits);
  kernels::check_router(desc);
  const Shape routed{desc.tokens, desc.topk};
  check_meta(kRouterBackward, "dgates", o.dgates, {routed, DType::kFloat32});
  check_meta(kRouterBackward, "experts", o.experts, {routed, DType::kInt32});
  check_meta(kRouterBackward, "gates", o.gates, {routed, DType::kFloat32});
  return {o.logits};
}

kernels::PlanDesc plan_desc(const MoEPlanParams& p, const TensorMeta& experts) {
  return {experts.shape.dim(0), p.experts, static_cast<int>(experts.shape.dim(1))};
}

std::vector<TensorMeta> check_plan(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<MoEPlanParams>();
  const auto o = bind_metas<PlanOperands>(kPlan, p, in);
  check_matrix(kPlan, "experts", o.experts);
  SG_CHECK(o.experts.dtype == DType::kInt32, "op moe_plan: experts must be int32, got ", dtype_name(o.experts.dtype));
  check_meta(kPlan, "the error word", o.error_word, kErrorWord);
  const kernels::PlanDesc desc = plan_desc(p, o.experts);
  const auto scratch = static_cast<std::int64_t>(kernels::moe_plan_workspace_bytes(desc) / 4);
  return output_metas(p, PlanOutputs<TensorMeta>{.splits = {Shape{desc.experts}, DType::kInt32},
                                                 .offsets = {Shape{desc.experts + 1}, DType::kInt32},
                                                 .positions = {o.experts.shape, DType::kInt32},
                                                 .sources = {Shape{desc.entries()}, DType::kInt32},
                                                 .scratch = {Shape{scratch > 0 ? scratch : 1}, DType::kInt32}});
}

std::vector<TensorMeta> check_split_offsets(const OpParams& params, std::span<const TensorMeta> in) {
  const auto& p = params.as<SplitOffsetsParams>();
  const auto o = bind_metas<SplitOffsetsOperands>(kSplitOffsets, p, in);
  SG_CHECK(o.splits.shape.rank() == 1 && o.splits.dtype == DType::kInt32 && o.splits.shape.dim(0) >= 1 &&
               o.splits.shape.dim(0) <= kernels::kMaxExperts,
           "op split_offsets: splits must be int32 [E] with 1 <= E <= ", kernels::kMaxExperts, ", got ", o.splits.shape,
           " ", dtype_name(o.splits.dtype));
  check_meta(kSplitOffsets, "the error word", o.error_word, kErrorWord);
  SG_CHECK(p.tokens >= 0 && p.tokens < (std::int64_t{1} << 31), "op split_offsets: tokens must be in [0, 2^31), got ",
           p.tokens);
  return {TensorMeta{Shape{o.splits.shape.dim(0) + 1}, DType::kInt32}};
}

std::vector<TensorMeta> check_permute(const OpParams&, std::span<const TensorMeta> in) {
  const auto o = bind_metas<PermuteOperands>(kPermute, NoParams{}, in);
  check_matrix(kPermute, "x", o.x);
  const std::int64_t tokens = o.x.shape.dim(0);
  SG_CHECK(o.sources.shape.rank() == 1 && o.sources.dtype == DType::kInt32 && tokens > 0 &&
               (o.sources.shape.dim(0) == tokens || o.sources.shape.dim(0) == 2 * tokens),
           "op moe_permute: sources must be int32 [tokens * k] with k 1 or 2 (tokens = ", tokens, "), got ",
           o.sources.shape, " ", dtype_name(o.sources.dtype));
  kernels::check_permute({o.x.dtype, tokens, o.x.shape.dim(1), static_cast<int>(o.sources.shape.dim(0) / tokens)});
  return {TensorMeta{Shape{o.sources.shape.dim(0), o.x.shape.dim(1)}, o.x.dtype}};
}

// positions int32 [T, k] and rows [T*k, H]; returns the desc.
kernels::PermuteDesc check_rows(std::string_view op, const TensorMeta& rows, const TensorMeta& positions) {
  check_matrix(op, "positions", positions);
  SG_CHECK(positions.dtype == DType::kInt32, "op ", op, ": positions must be int32, got ", dtype_name(positions.dtype));
  check_matrix(op, "the expert-ordered rows", rows);
  SG_CHECK(rows.shape.dim(0) == positions.numel(), "op ", op, ": the expert-ordered rows ", rows.shape,
           " must have one row per (token, slot) of positions ", positions.shape);
  const kernels::PermuteDesc desc = permute_desc(positions, rows.shape.dim(1), rows.dtype);
  kernels::check_permute(desc);
  return desc;
}

std::vector<TensorMeta> check_unpermute(const OpParams&, std::span<const TensorMeta> in) {
  const auto o = bind_metas<UnpermuteOperands>(kUnpermute, NoParams{}, in);
  const kernels::PermuteDesc desc = check_rows(kUnpermute, o.y_perm, o.positions);
  if (operand_layout<UnpermuteOperands>(NoParams{}, in.size()).at.gates >= 0) {
    check_meta(kUnpermute, "gates", o.gates, {o.positions.shape, DType::kFloat32});
  }
  return {TensorMeta{Shape{desc.tokens, desc.hidden}, desc.dtype}};
}

std::vector<TensorMeta> check_unpermute_backward(const OpParams&, std::span<const TensorMeta> in) {
  const auto o = bind_metas<UnpermuteBackwardOperands>(kUnpermuteBackward, NoParams{}, in);
  const kernels::PermuteDesc desc = check_rows(kUnpermuteBackward, o.y_perm, o.positions);
  check_meta(kUnpermuteBackward, "dy", o.dy, {Shape{desc.tokens, desc.hidden}, desc.dtype});
  check_meta(kUnpermuteBackward, "gates", o.gates, {o.positions.shape, DType::kFloat32});
  return output_metas(NoParams{}, UnpermuteBackwardOutputs<TensorMeta>{.dy_perm = o.y_perm,
                                                                       .dgates = {o.positions.shape, DType::kFloat32}});
}

std::int32_t* int_ptr(void* p) { return static_cast<std::int32_t*>(p); }

}  // namespace

const OpDef& router_topk_op() {
  static const OpDef op{
      .name = kRouter,
      .check = check_router_topk,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<TopkParams>();
            const auto o = bind_args<RouterOperands>(p, a);
            const auto out = bind_outputs<RouterOutputs>(p, a);
            kernels::launch_router_topk(router_desc(p, *o.logits.meta), o.logits.data, out.experts.as<std::int32_t>(),
                                        out.gates.as<float>(), s, o.bias.as<const float>());
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<TopkParams>();
            const auto o = bind_args<RouterOperands>(p, a);
            const auto out = bind_outputs<RouterOutputs>(p, a);
            kernels::host::router_topk(router_desc(p, *o.logits.meta), o.logits.data, out.experts.as<std::int32_t>(),
                                       out.gates.as<float>(), o.bias.as<const float>());
          },
  };
  return op;
}
SG_REGISTER_OP(router_topk_op);

const OpDef& router_topk_backward_op() {
  static const OpDef op{
      .name = kRouterBackward,
      .check = check_router_backward,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<TopkParams>();
            const auto o = bind_args<RouterBackwardOperands>(p, a);
            kernels::launch_router_backward(router_desc(p, *o.logits.meta), o.dgates.as<float>(), o.logits.data,
                                            o.experts.as<std::int32_t>(), o.gates.as<float>(), a.outputs[0], s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<TopkParams>();
            const auto o = bind_args<RouterBackwardOperands>(p, a);
            kernels::host::router_backward(router_desc(p, *o.logits.meta), o.dgates.as<float>(), o.logits.data,
                                           o.experts.as<std::int32_t>(), o.gates.as<float>(), a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(router_topk_backward_op);

const OpDef& moe_plan_op() {
  static const OpDef op{
      .name = kPlan,
      .check = check_plan,
      .mutated_inputs_for = written_inputs_of<PlanOperands, MoEPlanParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<MoEPlanParams>();
            const auto o = bind_args<PlanOperands>(p, a);
            const auto out = bind_outputs<PlanOutputs>(p, a);
            kernels::launch_moe_plan(plan_desc(p, *o.experts.meta), o.experts.as<std::int32_t>(),
                                     out.splits.as<std::int32_t>(), out.offsets.as<std::int32_t>(),
                                     out.positions.as<std::int32_t>(), out.sources.as<std::int32_t>(), out.scratch.data,
                                     o.error_word.as<std::int32_t>(), s);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<MoEPlanParams>();
            const auto o = bind_args<PlanOperands>(p, a);
            const auto out = bind_outputs<PlanOutputs>(p, a);
            kernels::host::moe_plan(plan_desc(p, *o.experts.meta), o.experts.as<std::int32_t>(),
                                    out.splits.as<std::int32_t>(), out.offsets.as<std::int32_t>(),
                                    out.positions.as<std::int32_t>(), out.sources.as<std::int32_t>(),
                                    o.error_word.as<std::int32_t>());
          },
  };
  return op;
}
SG_REGISTER_OP(moe_plan_op);

const OpDef& split_offsets_op() {
  static const OpDef op{
      .name = kSplitOffsets,
      .check = check_split_offsets,
      .mutated_inputs_for = written_inputs_of<SplitOffsetsOperands, SplitOffsetsParams>,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* s) {
            const auto& p = params.as<SplitOffsetsParams>();
            const auto o = bind_args<SplitOffsetsOperands>(p, a);
            kernels::launch_split_offsets(o.splits.numel(), p.tokens, o.splits.as<std::int32_t>(),
                                          int_ptr(a.outputs[0]), o.error_word.as<std::int32_t>(), s, p.sum);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            const auto& p = params.as<SplitOffsetsParams>();
            const auto o = bind_args<SplitOffsetsOperands>(p, a);
            kernels::host::split_offsets(o.splits.numel(), p.tokens, o.splits.as<std::int32_t>(), int_ptr(a.outputs[0]),
                                         o.error_word.as<std::int32_t>(), p.sum);
          },
  };
  return op;
}
SG_REGISTER_OP(split_offsets_op);

namespace {
kernels::PermuteDesc permute_call_desc(const PermuteOperands<Operand>& o) {
  const Shape& x = o.x.shape();
  return {o.x.dtype(), x.dim(0), x.dim(1), static_cast<int>(o.sources.numel() / x.dim(0))};
}
}  // namespace

const OpDef& moe_permute_op() {
  static const OpDef op{
      .name = kPermute,
      .check = check_permute,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<PermuteOperands>(NoParams{}, a);
            kernels::launch_moe_permute(permute_call_desc(o), o.x.data, o.sources.as<std::int32_t>(), a.outputs[0], s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<PermuteOperands>(NoParams{}, a);
            kernels::host::moe_permute(permute_call_desc(o), o.x.data, o.sources.as<std::int32_t>(), a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(moe_permute_op);

const OpDef& moe_unpermute_op() {
  static const OpDef op{
      .name = kUnpermute,
      .check = check_unpermute,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<UnpermuteOperands>(NoParams{}, a);
            kernels::launch_moe_unpermute(rows_desc(o.y_perm, o.positions), o.y_perm.data,
                                          o.positions.as<std::int32_t>(), o.gates.as<const float>(), a.outputs[0], s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<UnpermuteOperands>(NoParams{}, a);
            kernels::host::moe_unpermute(rows_desc(o.y_perm, o.positions), o.y_perm.data,
                                         o.positions.as<std::int32_t>(), o.gates.as<const float>(), a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(moe_unpermute_op);

const OpDef& moe_unpermute_backward_op() {
  static const OpDef op{
      .name = kUnpermuteBackward,
      .check = check_unpermute_backward,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const auto o = bind_args<UnpermuteBackwardOperands>(NoParams{}, a);
            const auto out = bind_outputs<UnpermuteBackwardOutputs>(NoParams{}, a);
            kernels::launch_moe_unpermute_backward(rows_desc(o.y_perm, o.positions), o.dy.data, o.y_perm.data,
                                                   o.positions.as<std::int32_t>(), o.gates.as<float>(),
                                                   out.dy_perm.data, out.dgates.as<float>(), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const auto o = bind_args<UnpermuteBackwardOperands>(NoParams{}, a);
            const auto out = bind_outputs<UnpermuteBackwardOutputs>(NoParams{}, a);
            kernels::host::moe_unpermute_backward(rows_desc(o.y_perm, o.positions), o.dy.data, o.y_perm.data,
                                                  o.positions.as<std::int32_t>(), o.gates.as<float>(), out.dy_perm.data,
                                                  out.dgates.as<float>());
          },
  };
  return op;
}
SG_REGISTER_OP(moe_unpermute_backward_op);

RouterResult router_topk(Context& ctx, const Tensor& logits, int topk, const Tensor& bias) {
  const TopkParams params{topk};
  auto out = bind_results<RouterOutputs>(
      params, ctx.call(router_topk_op(), params, flatten(kRouter, params, RouterOperands<Tensor>{logits, bias})));
  out.experts.set_name("router.experts");
  out.gates.set_name("router.gates");
  return {.experts = out.experts, .gates = out.gates};
}

Tensor router_topk_backward(Context& ctx, const Tensor& dgates, const Tensor& logits, const RouterResult& routed) {
  const int topk = routed.experts.shape().rank() == 2 ? static_cast<int>(routed.experts.shape().dim(1)) : 0;
  const TopkParams params{topk};
  return ctx
      .call(router_topk_backward_op(), params,
            flatten(kRouterBackward, params,
                    RouterBackwardOperands<Tensor>{dgates, logits, routed.experts, routed.gates}))
      .front();
}

MoEPlan moe_plan(Context& ctx, const Tensor& experts, const Tensor& error_word, std::int64_t num_experts) {
  const MoEPlanParams params{num_experts};
  auto out = bind_results<PlanOutputs>(
      params, ctx.call(moe_plan_op(), params, flatten(kPlan, params, PlanOperands<Tensor>{experts, error_word})));
  out.splits.set_name("moe.splits");
  out.offsets.set_name("moe.offsets");
  out.positions.set_name("moe.positions");
  out.sources.set_name("moe.sources");
  return {.splits = out.splits, .offsets = out.offsets, .positions = out.positions, .sources = out.sources};
}

Tensor split_offsets(Context& ctx, const Tensor& splits, const Tensor& error_word, std::int64_t tokens,
                     kernels::SplitSum sum) {
  const SplitOffsetsParams params{tokens, sum};
  return ctx
      .call(split_offsets_op(), params,
            flatten(kSplitOffsets, params, SplitOffsetsOperands<Tensor>{splits, error_word}))
      .front();
}

Tensor moe_permute(Context& ctx, const Tensor& x, const Tensor& sources) {
  return ctx.call(moe_permute_op(), NoParams{}, flatten(kPermute, NoParams{}, PermuteOperands<Tensor>{x, sources}))
      .front();
}

Tensor moe_unpermute(Context& ctx, const Tensor& y_perm, const Tensor& positions, const Tensor& gates) {
  return ctx
      .call(moe_unpermute_op(), NoParams{},
            flatten(kUnpermute, NoParams{}, UnpermuteOperands<Tensor>{y_perm, positions, gates}))
      .front();
}

UnpermuteGrads moe_unpermute_backward(Context& ctx, const Tensor& dy, const Tensor& y_perm, const Tensor& positions,
                                      const Tensor& gates) {
  const auto out = bind_results<UnpermuteBackwardOutputs>(
      NoParams{}, ctx.call(moe_unpermute_backward_op(), NoParams{},
                           flatten(kUnpermuteBackward, NoParams{},
                                   UnpermuteBackwardOperands<Tensor>{dy, y_perm, positions, gates})));
  return {.dy_perm = out.dy_perm, .dgates = out.dgates};
}

}  // namespace stepgraph::ops
