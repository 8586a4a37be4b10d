#include "ops/moe_ops.h"

#include <string>
#include <vector>

#include "engine/error.h"
#include "kernels/moe_routing.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::string TopkParams::to_string() const { return "k=" + std::to_string(topk); }
std::string MoEPlanParams::to_string() const { return "experts=" + std::to_string(experts); }
std::string SplitOffsetsParams::to_string() const { return "tokens=" + std::to_string(tokens); }

namespace {

const TensorMeta kErrorWord{Shape{1}, DType::kInt32};

void check_arity(std::string_view op, std::span<const TensorMeta> in, std::size_t want, const char* names) {
  SG_CHECK(in.size() == want, "op ", op, " takes ", want, " inputs (", names, "), got ", in.size());
}

void check_meta(std::string_view op, const char* what, const TensorMeta& got, const TensorMeta& want) {
  SG_CHECK(got == want, "op ", op, ": ", what, " must be ", want.shape, " ", dtype_name(want.dtype), ", got ",
           got.shape, " ", dtype_name(got.dtype));
}

// A [rows, cols] matrix of any dtype; returns its dims.
void check_matrix(std::string_view op, const char* what, const TensorMeta& meta) {
  SG_CHECK(meta.shape.rank() == 2, "op ", op, ": ", what, " must be a matrix, got ", meta.shape);
}

kernels::RouterDesc router_desc(const OpParams& p, const TensorMeta& logits) {
  return {logits.dtype, logits.shape.dim(0), logits.shape.dim(1), p.as<TopkParams>().topk};
}

// positions [T, k] gives the permute desc; rows are [T*k, H] of `dtype`.
kernels::PermuteDesc permute_desc(const TensorMeta& positions, std::int64_t hidden, DType dtype) {
  return {dtype, positions.shape.dim(0), hidden, static_cast<int>(positions.shape.dim(1))};
}

std::int32_t* int_ptr(void* p) { return static_cast<std::int32_t*>(p); }
float* float_ptr(void* p) { return static_cast<float*>(p); }

// Inputs: logits [T, E].
std::vector<TensorMeta> check_router_topk(const OpParams& params, std::span<const TensorMeta> in) {
  check_arity("router_topk", in, 1, "logits");
  check_matrix("router_topk", "logits", in[0]);
  const kernels::RouterDesc desc = router_desc(params, in[0]);
  kernels::check_router(desc);
  const Shape out{desc.tokens, desc.topk};
  return {TensorMeta{out, DType::kInt32}, TensorMeta{out, DType::kFloat32}};
}

// Inputs: dgates [T, k] fp32, logits [T, E], experts [T, k] int32, gates [T, k] fp32.
std::vector<TensorMeta> check_router_backward(const OpParams& params, std::span<const TensorMeta> in) {
  constexpr std::string_view op = "router_topk_backward";
  check_arity(op, in, 4, "dgates, logits, experts, gates");
  check_matrix(op, "logits", in[1]);
  const kernels::RouterDesc desc = router_desc(params, in[1]);
  kernels::check_router(desc);
  const Shape routed{desc.tokens, desc.topk};
  check_meta(op, "dgates", in[0], {routed, DType::kFloat32});
  check_meta(op, "experts", in[2], {routed, DType::kInt32});
  check_meta(op, "gates", in[3], {routed, DType::kFloat32});
  return {in[1]};
}

kernels::PlanDesc plan_desc(const OpParams& params, const TensorMeta& experts) {
  return {experts.shape.dim(0), params.as<MoEPlanParams>().experts, static_cast<int>(experts.shape.dim(1))};
}

// Inputs: experts [T, k] int32, error word int32 [1] (written).
std::vector<TensorMeta> check_plan(const OpParams& params, std::span<const TensorMeta> in) {
  check_arity("moe_plan", in, 2, "experts, error word");
  check_matrix("moe_plan", "experts", in[0]);
  SG_CHECK(in[0].dtype == DType::kInt32, "op moe_plan: experts must be int32, got ", dtype_name(in[0].dtype));
  check_meta("moe_plan", "the error word", in[1], kErrorWord);
  const kernels::PlanDesc desc = plan_desc(params, in[0]);
  const auto scratch = static_cast<std::int64_t>(kernels::moe_plan_workspace_bytes(desc) / 4);
  return {TensorMeta{Shape{desc.experts}, DType::kInt32}, TensorMeta{Shape{desc.experts + 1}, DType::kInt32},
          TensorMeta{in[0].shape, DType::kInt32}, TensorMeta{Shape{desc.entries()}, DType::kInt32},
          TensorMeta{Shape{scratch > 0 ? scratch : 1}, DType::kInt32}};
}

// Inputs: splits int32 [E], error word int32 [1] (written).
std::vector<TensorMeta> check_split_offsets(const OpParams& params, std::span<const TensorMeta> in) {
  check_arity("split_offsets", in, 2, "splits, error word");
  SG_CHECK(in[0].shape.rank() == 1 && in[0].dtype == DType::kInt32 && in[0].shape.dim(0) >= 1 &&
               in[0].shape.dim(0) <= kernels::kMaxExperts,
           "op split_offsets: splits must be int32 [E] with 1 <= E <= ", kernels::kMaxExperts, ", got ", in[0].shape,
           " ", dtype_name(in[0].dtype));
  check_meta("split_offsets", "the error word", in[1], kErrorWord);
  const std::int64_t tokens = params.as<SplitOffsetsParams>().tokens;
  SG_CHECK(tokens >= 0 && tokens < (std::int64_t{1} << 31), "op split_offsets: tokens must be in [0, 2^31), got ",
           tokens);
  return {TensorMeta{Shape{in[0].shape.dim(0) + 1}, DType::kInt32}};
}

// Inputs: x [T, H], sources int32 [T*k].
std::vector<TensorMeta> check_permute(const OpParams&, std::span<const TensorMeta> in) {
  check_arity("moe_permute", in, 2, "x, sources");
  check_matrix("moe_permute", "x", in[0]);
  const std::int64_t tokens = in[0].shape.dim(0);
  SG_CHECK(in[1].shape.rank() == 1 && in[1].dtype == DType::kInt32 && tokens > 0 &&
               (in[1].shape.dim(0) == tokens || in[1].shape.dim(0) == 2 * tokens),
           "op moe_permute: sources must be int32 [tokens * k] with k 1 or 2 (tokens = ", tokens, "), got ",
           in[1].shape, " ", dtype_name(in[1].dtype));
  kernels::check_permute({in[0].dtype, tokens, in[0].shape.dim(1), static_cast<int>(in[1].shape.dim(0) / tokens)});
  return {TensorMeta{Shape{in[1].shape.dim(0), in[0].shape.dim(1)}, in[0].dtype}};
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

// Inputs: y_perm [T*k, H], positions [T, k][, gates fp32 [T, k]].
std::vector<TensorMeta> check_unpermute(const OpParams&, std::span<const TensorMeta> in) {
  SG_CHECK(in.size() == 2 || in.size() == 3, "op moe_unpermute takes y_perm, positions and optionally gates, got ",
           in.size(), " inputs");
  const kernels::PermuteDesc desc = check_rows("moe_unpermute", in[0], in[1]);
  if (in.size() == 3) check_meta("moe_unpermute", "gates", in[2], {in[1].shape, DType::kFloat32});
  return {TensorMeta{Shape{desc.tokens, desc.hidden}, desc.dtype}};
}

// Inputs: dy [T, H], y_perm [T*k, H], positions [T, k], gates fp32 [T, k].
std::vector<TensorMeta> check_unpermute_backward(const OpParams&, std::span<const TensorMeta> in) {
  constexpr std::string_view op = "moe_unpermute_backward";
  check_arity(op, in, 4, "dy, y_perm, positions, gates");
  const kernels::PermuteDesc desc = check_rows(op, in[1], in[2]);
  check_meta(op, "dy", in[0], {Shape{desc.tokens, desc.hidden}, desc.dtype});
  check_meta(op, "gates", in[3], {in[2].shape, DType::kFloat32});
  return {in[1], TensorMeta{in[2].shape, DType::kFloat32}};
}

}  // namespace

const OpDef& router_topk_op() {
  static const OpDef op{
      .name = "router_topk",
      .check = check_router_topk,
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_router_topk(router_desc(p, a.input_metas[0]), a.inputs[0], int_ptr(a.outputs[0]),
                                        float_ptr(a.outputs[1]), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::router_topk(router_desc(p, a.input_metas[0]), a.inputs[0], int_ptr(a.outputs[0]),
                                       float_ptr(a.outputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(router_topk_op);

const OpDef& router_topk_backward_op() {
  static const OpDef op{
      .name = "router_topk_backward",
      .check = check_router_backward,
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_router_backward(router_desc(p, a.input_metas[1]), float_ptr(a.inputs[0]), a.inputs[1],
                                            int_ptr(a.inputs[2]), float_ptr(a.inputs[3]), a.outputs[0], s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::router_backward(router_desc(p, a.input_metas[1]), float_ptr(a.inputs[0]), a.inputs[1],
                                           int_ptr(a.inputs[2]), float_ptr(a.inputs[3]), a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(router_topk_backward_op);

const OpDef& moe_plan_op() {
  static const OpDef op{
      .name = "moe_plan",
      .check = check_plan,
      .mutated_inputs = {1},
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_moe_plan(plan_desc(p, a.input_metas[0]), int_ptr(a.inputs[0]), int_ptr(a.outputs[0]),
                                     int_ptr(a.outputs[1]), int_ptr(a.outputs[2]), int_ptr(a.outputs[3]), a.outputs[4],
                                     int_ptr(a.inputs[1]), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::moe_plan(plan_desc(p, a.input_metas[0]), int_ptr(a.inputs[0]), int_ptr(a.outputs[0]),
                                    int_ptr(a.outputs[1]), int_ptr(a.outputs[2]), int_ptr(a.outputs[3]),
                                    int_ptr(a.inputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(moe_plan_op);

const OpDef& split_offsets_op() {
  static const OpDef op{
      .name = "split_offsets",
      .check = check_split_offsets,
      .mutated_inputs = {1},
      .launch_cuda =
          [](const OpParams& p, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_split_offsets(a.input_metas[0].numel(), p.as<SplitOffsetsParams>().tokens,
                                          int_ptr(a.inputs[0]), int_ptr(a.outputs[0]), int_ptr(a.inputs[1]), s);
          },
      .run_host =
          [](const OpParams& p, const KernelArgs& a) {
            kernels::host::split_offsets(a.input_metas[0].numel(), p.as<SplitOffsetsParams>().tokens,
                                         int_ptr(a.inputs[0]), int_ptr(a.outputs[0]), int_ptr(a.inputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(split_offsets_op);

namespace {
kernels::PermuteDesc permute_call_desc(const KernelArgs& a) {
  const TensorMeta& x = a.input_metas[0];
  return {x.dtype, x.shape.dim(0), x.shape.dim(1), static_cast<int>(a.input_metas[1].numel() / x.shape.dim(0))};
}
}  // namespace

const OpDef& moe_permute_op() {
  static const OpDef op{
      .name = "moe_permute",
      .check = check_permute,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_moe_permute(permute_call_desc(a), a.inputs[0], int_ptr(a.inputs[1]), a.outputs[0], s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::moe_permute(permute_call_desc(a), a.inputs[0], int_ptr(a.inputs[1]), a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(moe_permute_op);

const OpDef& moe_unpermute_op() {
  static const OpDef op{
      .name = "moe_unpermute",
      .check = check_unpermute,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            const float* gates = a.inputs.size() == 3 ? float_ptr(a.inputs[2]) : nullptr;
            kernels::launch_moe_unpermute(
                permute_desc(a.input_metas[1], a.input_metas[0].shape.dim(1), a.input_metas[0].dtype), a.inputs[0],
                int_ptr(a.inputs[1]), gates, a.outputs[0], s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            const float* gates = a.inputs.size() == 3 ? float_ptr(a.inputs[2]) : nullptr;
            kernels::host::moe_unpermute(
                permute_desc(a.input_metas[1], a.input_metas[0].shape.dim(1), a.input_metas[0].dtype), a.inputs[0],
                int_ptr(a.inputs[1]), gates, a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(moe_unpermute_op);

const OpDef& moe_unpermute_backward_op() {
  static const OpDef op{
      .name = "moe_unpermute_backward",
      .check = check_unpermute_backward,
      .launch_cuda =
          [](const OpParams&, const KernelArgs& a, CUstream_st* s) {
            kernels::launch_moe_unpermute_backward(
                permute_desc(a.input_metas[2], a.input_metas[1].shape.dim(1), a.input_metas[1].dtype), a.inputs[0],
                a.inputs[1], int_ptr(a.inputs[2]), float_ptr(a.inputs[3]), a.outputs[0], float_ptr(a.outputs[1]), s);
          },
      .run_host =
          [](const OpParams&, const KernelArgs& a) {
            kernels::host::moe_unpermute_backward(
                permute_desc(a.input_metas[2], a.input_metas[1].shape.dim(1), a.input_metas[1].dtype), a.inputs[0],
                a.inputs[1], int_ptr(a.inputs[2]), float_ptr(a.inputs[3]), a.outputs[0], float_ptr(a.outputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(moe_unpermute_backward_op);

RouterResult router_topk(Context& ctx, const Tensor& logits, int topk) {
  std::vector<Tensor> out = ctx.call(router_topk_op(), TopkParams{topk}, {logits});
  out[0].set_name("router.experts");
  out[1].set_name("router.gates");
  return {out[0], out[1]};
}

Tensor router_topk_backward(Context& ctx, const Tensor& dgates, const Tensor& logits, const RouterResult& routed) {
  const int topk = routed.experts.shape().rank() == 2 ? static_cast<int>(routed.experts.shape().dim(1)) : 0;
  return ctx.call(router_topk_backward_op(), TopkParams{topk}, {dgates, logits, routed.experts, routed.gates}).front();
}

MoEPlan moe_plan(Context& ctx, const Tensor& experts, const Tensor& error_word, std::int64_t num_experts) {
  std::vector<Tensor> out = ctx.call(moe_plan_op(), MoEPlanParams{num_experts}, {experts, error_word});
  out[0].set_name("moe.splits");
  out[1].set_name("moe.offsets");
  out[2].set_name("moe.positions");
  out[3].set_name("moe.sources");
  return {out[0], out[1], out[2], out[3]};
}

Tensor split_offsets(Context& ctx, const Tensor& splits, const Tensor& error_word, std::int64_t tokens) {
  return ctx.call(split_offsets_op(), SplitOffsetsParams{tokens}, {splits, error_word}).front();
}

Tensor moe_permute(Context& ctx, const Tensor& x, const Tensor& sources) {
  return ctx.call(moe_permute_op(), NoParams{}, {x, sources}).front();
}

Tensor moe_unpermute(Context& ctx, const Tensor& y_perm, const Tensor& positions, const Tensor& gates) {
  std::vector<Tensor> inputs{y_perm, positions};
  if (gates.defined()) inputs.push_back(gates);
  return ctx.call(moe_unpermute_op(), NoParams{}, std::move(inputs)).front();
}

UnpermuteGrads moe_unpermute_backward(Context& ctx, const Tensor& dy, const Tensor& y_perm, const Tensor& positions,
                                      const Tensor& gates) {
  std::vector<Tensor> out = ctx.call(moe_unpermute_backward_op(), NoParams{}, {dy, y_perm, positions, gates});
  return {out[0], out[1]};
}

}  // namespace stepgraph::ops
