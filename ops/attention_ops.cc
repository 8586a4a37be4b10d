#include "ops/attention_ops.h"

#include <cstdio>
#include <vector>

#include "engine/error.h"
#include "ops/op_registration.h"

namespace stepgraph::ops {

std::string AttentionParams::to_string() const {
  char text[128];
  std::snprintf(text, sizeof(text), "heads=%lld, kv_heads=%lld, head_dim=%lld, causal=%d, scale=%g",
                static_cast<long long>(heads), static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
                causal ? 1 : 0, static_cast<double>(scale));
  return text;
}

std::string RopeParams::to_string() const {
  char text[128];
  std::snprintf(text, sizeof(text), "heads=%lld, kv_heads=%lld, head_dim=%lld, rotary_dim=%lld, base=%g",
                static_cast<long long>(heads), static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
                static_cast<long long>(rotary_dim), static_cast<double>(base));
  return text;
}

namespace {

const std::int32_t* as_i32(void* p) { return static_cast<const std::int32_t*>(p); }

// cu_seqlens int32 [S + 1] with S >= 1; returns S.
std::int64_t check_packing(std::string_view op, const TensorMeta& cu_seqlens) {
  SG_CHECK(cu_seqlens.dtype == DType::kInt32 && cu_seqlens.shape.rank() == 1 && cu_seqlens.shape.dim(0) >= 2, "op ",
           op, ": cu_seqlens must be int32 [sequences + 1] with at least one sequence, got ",
           dtype_name(cu_seqlens.dtype), " ", cu_seqlens.shape);
  return cu_seqlens.shape.dim(0) - 1;
}

// `meta` is [tokens, heads * head_dim] of `dtype`.
void expect_heads(std::string_view op, std::string_view what, const TensorMeta& meta, std::int64_t tokens,
                  std::int64_t heads, std::int64_t head_dim, DType dtype) {
  SG_CHECK(meta.dtype == dtype && meta.shape == (Shape{tokens, heads * head_dim}), "op ", op, ": ", what, " must be ",
           dtype_name(dtype), " [", tokens, ", ", heads, " heads * ", head_dim, "], got ", dtype_name(meta.dtype), " ",
           meta.shape);
}

kernels::AttentionDesc describe(const AttentionParams& p, const TensorMeta& q, std::int64_t sequences) {
  return {.dtype = q.dtype,
          .tokens = q.shape.rank() == 2 ? q.shape.dim(0) : 0,
          .sequences = sequences,
          .heads = p.heads,
          .kv_heads = p.kv_heads,
          .head_dim = p.head_dim,
          .causal = p.causal,
          .scale = p.scale};
}

kernels::RopeDesc describe(const RopeParams& p, DType dtype, std::int64_t tokens, std::int64_t sequences) {
  return {.dtype = dtype,
          .tokens = tokens,
          .sequences = sequences,
          .heads = p.heads,
          .head_dim = p.head_dim,
          .rotary_dim = p.rotary_dim,
          .base = p.base};
}

// --- QKV split ----------------------------------------------------------------

std::vector<TensorMeta> check_split(const OpParams& params, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "qkv_split_rope";
  const auto& p = params.as<RopeParams>();
  SG_CHECK(inputs.size() == 2, "op ", kOp, " takes qkv and cu_seqlens, got ", inputs.size(), " inputs");
  const std::int64_t sequences = check_packing(kOp, inputs[1]);
  SG_CHECK(inputs[0].shape.rank() == 2, "op ", kOp, ": qkv must be [tokens, (heads + 2 kv_heads) * head_dim], got ",
           inputs[0].shape);
  const std::int64_t tokens = inputs[0].shape.dim(0);
  kernels::check_qkv_rope(describe(p, inputs[0].dtype, tokens, sequences), p.kv_heads);
  expect_heads(kOp, "qkv", inputs[0], tokens, p.heads + 2 * p.kv_heads, p.head_dim, inputs[0].dtype);
  const DType dtype = inputs[0].dtype;
  return {{Shape{tokens, p.heads * p.head_dim}, dtype},
          {Shape{tokens, p.kv_heads * p.head_dim}, dtype},
          {Shape{tokens, p.kv_heads * p.head_dim}, dtype}};
}

std::vector<TensorMeta> check_merge(const OpParams& params, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "qkv_merge_rope_backward";
  const auto& p = params.as<RopeParams>();
  SG_CHECK(inputs.size() == 4, "op ", kOp, " takes dq, dk, dv and cu_seqlens, got ", inputs.size(), " inputs");
  const std::int64_t sequences = check_packing(kOp, inputs[3]);
  SG_CHECK(inputs[0].shape.rank() == 2, "op ", kOp, ": dq must be [tokens, heads * head_dim], got ", inputs[0].shape);
  const std::int64_t tokens = inputs[0].shape.dim(0);
  const DType dtype = inputs[0].dtype;
  kernels::check_qkv_rope(describe(p, dtype, tokens, sequences), p.kv_heads);
  expect_heads(kOp, "dq", inputs[0], tokens, p.heads, p.head_dim, dtype);
  expect_heads(kOp, "dk", inputs[1], tokens, p.kv_heads, p.head_dim, dtype);
  expect_heads(kOp, "dv", inputs[2], tokens, p.kv_heads, p.head_dim, dtype);
  return {{Shape{tokens, (p.heads + 2 * p.kv_heads) * p.head_dim}, dtype}};
}

// --- attention ----------------------------------------------------------------

// q, k, v [T, (H | Hkv) D] of one dtype, cu_seqlens at `packing`; returns the descriptor.
kernels::AttentionDesc check_qkv(std::string_view op, const AttentionParams& p, std::span<const TensorMeta> inputs,
                                 std::size_t packing) {
  const std::int64_t sequences = check_packing(op, inputs[packing]);
  SG_CHECK(inputs[0].shape.rank() == 2, "op ", op, ": q must be [tokens, heads * head_dim], got ", inputs[0].shape);
  const kernels::AttentionDesc desc = describe(p, inputs[0], sequences);
  kernels::check_attention(desc);
  expect_heads(op, "q", inputs[0], desc.tokens, p.heads, p.head_dim, desc.dtype);
  expect_heads(op, "k", inputs[1], desc.tokens, p.kv_heads, p.head_dim, desc.dtype);
  expect_heads(op, "v", inputs[2], desc.tokens, p.kv_heads, p.head_dim, desc.dtype);
  return desc;
}

std::vector<TensorMeta> check_forward(const OpParams& params, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "attention_forward";
  SG_CHECK(inputs.size() == 4, "op ", kOp, " takes q, k, v and cu_seqlens, got ", inputs.size(), " inputs");
  const kernels::AttentionDesc d = check_qkv(kOp, params.as<AttentionParams>(), inputs, 3);
  return {inputs[0], {Shape{d.heads, d.tokens}, DType::kFloat32}};
}

std::vector<TensorMeta> check_backward(const OpParams& params, std::span<const TensorMeta> inputs) {
  constexpr std::string_view kOp = "attention_backward";
  SG_CHECK(inputs.size() == 7, "op ", kOp, " takes q, k, v, out, lse, dout and cu_seqlens, got ", inputs.size(),
           " inputs");
  const kernels::AttentionDesc d = check_qkv(kOp, params.as<AttentionParams>(), inputs, 6);
  expect_heads(kOp, "out", inputs[3], d.tokens, d.heads, d.head_dim, d.dtype);
  SG_CHECK(inputs[4] == (TensorMeta{Shape{d.heads, d.tokens}, DType::kFloat32}), "op ", kOp, ": lse must be fp32 [",
           d.heads, ", ", d.tokens, "], got ", dtype_name(inputs[4].dtype), " ", inputs[4].shape);
  expect_heads(kOp, "dout", inputs[5], d.tokens, d.heads, d.head_dim, d.dtype);
  const auto scratch = static_cast<std::int64_t>((kernels::attention_backward_workspace_bytes(d) + 3) / 4);
  return {inputs[0], inputs[1], inputs[2], {Shape{scratch > 0 ? scratch : 1}, DType::kFloat32}};
}

kernels::AttentionDesc desc_of(const OpParams& params, const KernelArgs& a, std::size_t packing) {
  return describe(params.as<AttentionParams>(), a.input_metas[0], a.input_metas[packing].shape.dim(0) - 1);
}

kernels::RopeDesc rope_desc_of(const OpParams& params, const KernelArgs& a, std::size_t packing) {
  return describe(params.as<RopeParams>(), a.input_metas[0].dtype, a.input_metas[0].shape.dim(0),
                  a.input_metas[packing].shape.dim(0) - 1);
}

}  // namespace

const OpDef& qkv_split_rope_op() {
  static const OpDef op{
      .name = "qkv_split_rope",
      .check = check_split,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_qkv_split_rope(rope_desc_of(params, a, 1), params.as<RopeParams>().kv_heads, a.inputs[0],
                                           as_i32(a.inputs[1]), a.outputs[0], a.outputs[1], a.outputs[2], stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::qkv_split_rope(rope_desc_of(params, a, 1), params.as<RopeParams>().kv_heads, a.inputs[0],
                                          as_i32(a.inputs[1]), a.outputs[0], a.outputs[1], a.outputs[2]);
          },
  };
  return op;
}
SG_REGISTER_OP(qkv_split_rope_op);

const OpDef& qkv_merge_rope_backward_op() {
  static const OpDef op{
      .name = "qkv_merge_rope_backward",
      .check = check_merge,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_qkv_merge_rope_backward(rope_desc_of(params, a, 3), params.as<RopeParams>().kv_heads,
                                                    a.inputs[0], a.inputs[1], a.inputs[2], as_i32(a.inputs[3]),
                                                    a.outputs[0], stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::qkv_merge_rope_backward(rope_desc_of(params, a, 3), params.as<RopeParams>().kv_heads,
                                                   a.inputs[0], a.inputs[1], a.inputs[2], as_i32(a.inputs[3]),
                                                   a.outputs[0]);
          },
  };
  return op;
}
SG_REGISTER_OP(qkv_merge_rope_backward_op);

const OpDef& attention_forward_op() {
  static const OpDef op{
      .name = "attention_forward",
      .check = check_forward,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_attention_forward(desc_of(params, a, 3), a.inputs[0], a.inputs[1], a.inputs[2],
                                              as_i32(a.inputs[3]), a.outputs[0], static_cast<float*>(a.outputs[1]),
                                              stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::attention_forward(desc_of(params, a, 3), a.inputs[0], a.inputs[1], a.inputs[2],
                                             as_i32(a.inputs[3]), a.outputs[0], static_cast<float*>(a.outputs[1]));
          },
  };
  return op;
}
SG_REGISTER_OP(attention_forward_op);

const OpDef& attention_backward_op() {
  static const OpDef op{
      .name = "attention_backward",
      .check = check_backward,
      .launch_cuda =
          [](const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
            kernels::launch_attention_backward(desc_of(params, a, 6), a.inputs[0], a.inputs[1], a.inputs[2],
                                               a.inputs[3], static_cast<const float*>(a.inputs[4]), a.inputs[5],
                                               as_i32(a.inputs[6]), a.outputs[0], a.outputs[1], a.outputs[2],
                                               a.outputs[3], stream);
          },
      .run_host =
          [](const OpParams& params, const KernelArgs& a) {
            kernels::host::attention_backward(desc_of(params, a, 6), a.inputs[0], a.inputs[1], a.inputs[2],
                                              a.inputs[3], static_cast<const float*>(a.inputs[4]), a.inputs[5],
                                              as_i32(a.inputs[6]), a.outputs[0], a.outputs[1], a.outputs[2]);
          },
  };
  return op;
}
SG_REGISTER_OP(attention_backward_op);

QkvSplit qkv_split_rope(Context& ctx, const RopeParams& params, const Tensor& qkv, const Tensor& cu_seqlens) {
  std::vector<Tensor> out = ctx.call(qkv_split_rope_op(), params, {qkv, cu_seqlens});
  return {out[0], out[1], out[2]};
}

Tensor qkv_merge_rope_backward(Context& ctx, const RopeParams& params, const Tensor& dq, const Tensor& dk,
                               const Tensor& dv, const Tensor& cu_seqlens) {
  return ctx.call(qkv_merge_rope_backward_op(), params, {dq, dk, dv, cu_seqlens}).at(0);
}

AttentionForward attention_forward(Context& ctx, const AttentionParams& params, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& cu_seqlens) {
  std::vector<Tensor> out = ctx.call(attention_forward_op(), params, {q, k, v, cu_seqlens});
  return {out[0], out[1]};
}

AttentionGrads attention_backward(Context& ctx, const AttentionParams& params, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  const Tensor& cu_seqlens) {
  std::vector<Tensor> grads =
      ctx.call(attention_backward_op(), params, {q, k, v, out, lse, dout, cu_seqlens});
  return {grads[0], grads[1], grads[2]};
}

}  // namespace stepgraph::ops
