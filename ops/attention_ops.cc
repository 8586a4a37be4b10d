#include "ops/attention_ops.h"

#include <cstdio>
#include <tuple>
#include <vector>

#include "engine/error.h"
#include "ops/op_registration.h"
#include "ops/operands.h"

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

// cu_seqlens int32 [S + 1] with S >= 1; returns S.
std::int64_t check_packing(std::string_view op, const TensorMeta& cu_seqlens) {
  SG_CHECK(cu_seqlens.dtype == DType::kInt32 && cu_seqlens.shape.rank() == 1 && cu_seqlens.shape.dim(0) >= 2, "op ", op,
           ": cu_seqlens must be int32 [sequences + 1] with at least one sequence, got ", dtype_name(cu_seqlens.dtype),
           " ", cu_seqlens.shape);
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

// --- operands ---------------------------------------------------------------

// The operands the ops' structs share, in the order each op takes them.
template <typename O, typename V>
void visit_qkv(O& o, V& v) {
  v({"q"}, o.q);
  v({"k"}, o.k);
  v({"v"}, o.v);
}

template <typename O, typename V>
void visit_grads(O& o, V& v) {
  v({"dq"}, o.dq);
  v({"dk"}, o.dk);
  v({"dv"}, o.dv);
}

// What a backward op reads of its forward after q, k, v: out, lse and dout.
template <typename O, typename V>
void visit_forward_results(O& o, V& v) {
  v({"out"}, o.out);
  v({"lse"}, o.lse);
  v({"dout"}, o.dout);
}

template <typename O, typename V>
void visit_segments(O& o, V& v) {
  v({"q_offsets"}, o.q_offsets);
  v({"kv_ranges"}, o.kv_ranges);
}

template <typename F>
struct QkvSplitOperands {
  F qkv;         // [tokens, (heads + 2 kv_heads) * head_dim]
  F cu_seqlens;  // int32 [sequences + 1]
};

template <typename F, typename V>
void visit_operands(const RopeParams&, QkvSplitOperands<F>& o, V& v) {
  v({"qkv"}, o.qkv);
  v({"cu_seqlens"}, o.cu_seqlens);
}

template <typename F>
struct QkvMergeOperands {
  F dq, dk, dv;
  F cu_seqlens;
};

template <typename F, typename V>
void visit_operands(const RopeParams&, QkvMergeOperands<F>& o, V& v) {
  visit_grads(o, v);
  v({"cu_seqlens"}, o.cu_seqlens);
}

// The rotation at given positions (int32 [tokens]) instead of cu_seqlens'.
template <typename F>
struct QkvSplitAtOperands {
  F qkv;
  F positions;  // int32 [tokens]
};

template <typename F, typename V>
void visit_operands(const RopeParams&, QkvSplitAtOperands<F>& o, V& v) {
  v({"qkv"}, o.qkv);
  v({"positions"}, o.positions);
}

template <typename F>
struct QkvMergeAtOperands {
  F dq, dk, dv;
  F positions;
};

template <typename F, typename V>
void visit_operands(const RopeParams&, QkvMergeAtOperands<F>& o, V& v) {
  visit_grads(o, v);
  v({"positions"}, o.positions);
}

template <typename F>
struct AttentionForwardOperands {
  F q, k, v;
  F cu_seqlens;
};

template <typename F, typename V>
void visit_operands(const AttentionParams&, AttentionForwardOperands<F>& o, V& v) {
  visit_qkv(o, v);
  v({"cu_seqlens"}, o.cu_seqlens);
}

template <typename F>
struct AttentionBackwardOperands {
  F q, k, v;
  F out;   // the forward's output
  F lse;   // fp32 [heads, tokens]: the forward's log-sum-exp
  F dout;  // the output's gradient
  F cu_seqlens;
};

template <typename F, typename V>
void visit_operands(const AttentionParams&, AttentionBackwardOperands<F>& o, V& v) {
  visit_qkv(o, v);
  visit_forward_results(o, v);
  v({"cu_seqlens"}, o.cu_seqlens);
}

template <typename F>
struct QkvSplitOutputs {
  F q, k, v;  // q and k rotated
};

template <typename F, typename V>
void visit_operands(const RopeParams&, QkvSplitOutputs<F>& o, V& v) {
  visit_qkv(o, v);
}

template <typename F>
struct AttentionForwardOutputs {
  F out;  // q's shape and dtype
  F lse;  // fp32 [heads, tokens]
};

template <typename F, typename V>
void visit_operands(const AttentionParams&, AttentionForwardOutputs<F>& o, V& v) {
  v({"out"}, o.out);
  v({"lse"}, o.lse);
}

template <typename F>
struct AttentionBackwardOutputs {
  F dq, dk, dv;
  F scratch;  // fp32: the kernel's workspace
};

template <typename F, typename V>
void visit_operands(const AttentionParams&, AttentionBackwardOutputs<F>& o, V& v) {
  visit_grads(o, v);
  v({"scratch"}, o.scratch);
}

// Segment attention: the queries' segments and the kv ranges each reads.
template <typename F>
struct SegmentAttentionForwardOperands {
  F q;          // [Tq, heads * head_dim]
  F k, v;       // [Tk, kv_heads * head_dim]
  F q_offsets;  // int32 [segments + 1]
  F kv_ranges;  // int32 [segments, 2]
};

template <typename F, typename V>
void visit_operands(const AttentionParams&, SegmentAttentionForwardOperands<F>& o, V& v) {
  visit_qkv(o, v);
  visit_segments(o, v);
}

template <typename F>
struct SegmentAttentionBackwardOperands {
  F q, k, v;
  F out;   // the forward's output [Tq, heads * head_dim]
  F lse;   // fp32 [heads, Tq]
  F dout;  // the output's gradient
  F q_offsets;
  F kv_ranges;
};

template <typename F, typename V>
void visit_operands(const AttentionParams&, SegmentAttentionBackwardOperands<F>& o, V& v) {
  visit_qkv(o, v);
  visit_forward_results(o, v);
  visit_segments(o, v);
}

constexpr std::string_view kSplit = "qkv_split_rope";
constexpr std::string_view kMerge = "qkv_merge_rope_backward";
constexpr std::string_view kSplitAt = "qkv_split_rope_at";
constexpr std::string_view kMergeAt = "qkv_merge_rope_backward_at";
constexpr std::string_view kForward = "attention_forward";
constexpr std::string_view kBackward = "attention_backward";
constexpr std::string_view kSegmentForward = "segment_attention_forward";
constexpr std::string_view kSegmentBackward = "segment_attention_backward";

// --- QKV split ----------------------------------------------------------------

std::vector<TensorMeta> check_split(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_metas<QkvSplitOperands>(kSplit, p, inputs);
  const std::int64_t sequences = check_packing(kSplit, o.cu_seqlens);
  SG_CHECK(o.qkv.shape.rank() == 2, "op ", kSplit, ": qkv must be [tokens, (heads + 2 kv_heads) * head_dim], got ",
           o.qkv.shape);
  const std::int64_t tokens = o.qkv.shape.dim(0);
  const DType dtype = o.qkv.dtype;
  kernels::check_qkv_rope(describe(p, dtype, tokens, sequences), p.kv_heads);
  expect_heads(kSplit, "qkv", o.qkv, tokens, p.heads + 2 * p.kv_heads, p.head_dim, dtype);
  return output_metas(p, QkvSplitOutputs<TensorMeta>{.q = {Shape{tokens, p.heads * p.head_dim}, dtype},
                                                     .k = {Shape{tokens, p.kv_heads * p.head_dim}, dtype},
                                                     .v = {Shape{tokens, p.kv_heads * p.head_dim}, dtype}});
}

std::vector<TensorMeta> check_merge(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_metas<QkvMergeOperands>(kMerge, p, inputs);
  const std::int64_t sequences = check_packing(kMerge, o.cu_seqlens);
  SG_CHECK(o.dq.shape.rank() == 2, "op ", kMerge, ": dq must be [tokens, heads * head_dim], got ", o.dq.shape);
  const std::int64_t tokens = o.dq.shape.dim(0);
  const DType dtype = o.dq.dtype;
  kernels::check_qkv_rope(describe(p, dtype, tokens, sequences), p.kv_heads);
  expect_heads(kMerge, "dq", o.dq, tokens, p.heads, p.head_dim, dtype);
  expect_heads(kMerge, "dk", o.dk, tokens, p.kv_heads, p.head_dim, dtype);
  expect_heads(kMerge, "dv", o.dv, tokens, p.kv_heads, p.head_dim, dtype);
  return {{Shape{tokens, (p.heads + 2 * p.kv_heads) * p.head_dim}, dtype}};
}

// positions int32 [tokens].
void check_positions(std::string_view op, const TensorMeta& positions, std::int64_t tokens) {
  SG_CHECK(positions.dtype == DType::kInt32 && positions.shape == (Shape{tokens}), "op ", op,
           ": positions must be int32 [", tokens, " tokens] (each token's rotary position), got ",
           dtype_name(positions.dtype), " ", positions.shape);
}

std::vector<TensorMeta> check_split_at(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_metas<QkvSplitAtOperands>(kSplitAt, p, inputs);
  SG_CHECK(o.qkv.shape.rank() == 2, "op ", kSplitAt, ": qkv must be [tokens, (heads + 2 kv_heads) * head_dim], got ",
           o.qkv.shape);
  const std::int64_t tokens = o.qkv.shape.dim(0);
  const DType dtype = o.qkv.dtype;
  kernels::check_qkv_rope(describe(p, dtype, tokens, 1), p.kv_heads);
  expect_heads(kSplitAt, "qkv", o.qkv, tokens, p.heads + 2 * p.kv_heads, p.head_dim, dtype);
  check_positions(kSplitAt, o.positions, tokens);
  return output_metas(p, QkvSplitOutputs<TensorMeta>{.q = {Shape{tokens, p.heads * p.head_dim}, dtype},
                                                     .k = {Shape{tokens, p.kv_heads * p.head_dim}, dtype},
                                                     .v = {Shape{tokens, p.kv_heads * p.head_dim}, dtype}});
}

std::vector<TensorMeta> check_merge_at(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_metas<QkvMergeAtOperands>(kMergeAt, p, inputs);
  SG_CHECK(o.dq.shape.rank() == 2, "op ", kMergeAt, ": dq must be [tokens, heads * head_dim], got ", o.dq.shape);
  const std::int64_t tokens = o.dq.shape.dim(0);
  const DType dtype = o.dq.dtype;
  kernels::check_qkv_rope(describe(p, dtype, tokens, 1), p.kv_heads);
  expect_heads(kMergeAt, "dq", o.dq, tokens, p.heads, p.head_dim, dtype);
  expect_heads(kMergeAt, "dk", o.dk, tokens, p.kv_heads, p.head_dim, dtype);
  expect_heads(kMergeAt, "dv", o.dv, tokens, p.kv_heads, p.head_dim, dtype);
  check_positions(kMergeAt, o.positions, tokens);
  return {{Shape{tokens, (p.heads + 2 * p.kv_heads) * p.head_dim}, dtype}};
}

// --- attention ----------------------------------------------------------------

// q, k, v [T, (H | Hkv) D] of one dtype, packed by cu_seqlens; returns the descriptor.
template <typename Operands>
kernels::AttentionDesc check_qkv(std::string_view op, const AttentionParams& p, const Operands& o) {
  const std::int64_t sequences = check_packing(op, o.cu_seqlens);
  SG_CHECK(o.q.shape.rank() == 2, "op ", op, ": q must be [tokens, heads * head_dim], got ", o.q.shape);
  const kernels::AttentionDesc desc = describe(p, o.q, sequences);
  kernels::check_attention(desc);
  expect_heads(op, "q", o.q, desc.tokens, p.heads, p.head_dim, desc.dtype);
  expect_heads(op, "k", o.k, desc.tokens, p.kv_heads, p.head_dim, desc.dtype);
  expect_heads(op, "v", o.v, desc.tokens, p.kv_heads, p.head_dim, desc.dtype);
  return desc;
}

std::vector<TensorMeta> check_forward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_metas<AttentionForwardOperands>(kForward, p, inputs);
  const kernels::AttentionDesc d = check_qkv(kForward, p, o);
  return output_metas(
      p, AttentionForwardOutputs<TensorMeta>{.out = o.q, .lse = {Shape{d.heads, d.tokens}, DType::kFloat32}});
}

std::vector<TensorMeta> check_backward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_metas<AttentionBackwardOperands>(kBackward, p, inputs);
  const kernels::AttentionDesc d = check_qkv(kBackward, p, o);
  expect_heads(kBackward, "out", o.out, d.tokens, d.heads, d.head_dim, d.dtype);
  SG_CHECK(o.lse == (TensorMeta{Shape{d.heads, d.tokens}, DType::kFloat32}), "op ", kBackward, ": lse must be fp32 [",
           d.heads, ", ", d.tokens, "], got ", dtype_name(o.lse.dtype), " ", o.lse.shape);
  expect_heads(kBackward, "dout", o.dout, d.tokens, d.heads, d.head_dim, d.dtype);
  const auto scratch = static_cast<std::int64_t>((kernels::attention_backward_workspace_bytes(d) + 3) / 4);
  return output_metas(
      p, AttentionBackwardOutputs<TensorMeta>{
             .dq = o.q, .dk = o.k, .dv = o.v, .scratch = {Shape{scratch > 0 ? scratch : 1}, DType::kFloat32}});
}

// --- segment attention ----------------------------------------------------------

// q [Tq, H D], k, v [Tk, Hkv D] of one dtype, q_offsets int32 [G + 1], kv_ranges int32 [G, 2].
template <typename Operands>
kernels::SegmentAttentionDesc check_segment_operands(std::string_view op, const AttentionParams& p,
                                                     const Operands& o) {
  SG_CHECK(o.q_offsets.dtype == DType::kInt32 && o.q_offsets.shape.rank() == 1 && o.q_offsets.shape.dim(0) >= 2,
           "op ", op, ": q_offsets must be int32 [segments + 1] with at least one segment, got ",
           dtype_name(o.q_offsets.dtype), " ", o.q_offsets.shape);
  const std::int64_t segments = o.q_offsets.shape.dim(0) - 1;
  SG_CHECK(o.kv_ranges.dtype == DType::kInt32 && o.kv_ranges.shape == (Shape{segments, 2}), "op ", op,
           ": kv_ranges must be int32 [", segments, " segments, 2] (each segment's first and end kv token), got ",
           dtype_name(o.kv_ranges.dtype), " ", o.kv_ranges.shape);
  SG_CHECK(o.q.shape.rank() == 2 && o.k.shape.rank() == 2, "op ", op,
           ": q must be [query tokens, heads * head_dim] and k [kv tokens, kv_heads * head_dim], got ", o.q.shape,
           " and ", o.k.shape);
  const kernels::SegmentAttentionDesc desc{.attention = describe(p, o.q, segments), .kv_tokens = o.k.shape.dim(0)};
  kernels::check_segment_attention(desc);
  expect_heads(op, "q", o.q, desc.attention.tokens, p.heads, p.head_dim, desc.attention.dtype);
  expect_heads(op, "k", o.k, desc.kv_tokens, p.kv_heads, p.head_dim, desc.attention.dtype);
  expect_heads(op, "v", o.v, desc.kv_tokens, p.kv_heads, p.head_dim, desc.attention.dtype);
  return desc;
}

std::vector<TensorMeta> check_segment_forward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_metas<SegmentAttentionForwardOperands>(kSegmentForward, p, inputs);
  const kernels::SegmentAttentionDesc d = check_segment_operands(kSegmentForward, p, o);
  return output_metas(p, AttentionForwardOutputs<TensorMeta>{
                             .out = o.q, .lse = {Shape{p.heads, d.attention.tokens}, DType::kFloat32}});
}

std::vector<TensorMeta> check_segment_backward(const OpParams& params, std::span<const TensorMeta> inputs) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_metas<SegmentAttentionBackwardOperands>(kSegmentBackward, p, inputs);
  const kernels::SegmentAttentionDesc d = check_segment_operands(kSegmentBackward, p, o);
  const std::int64_t tq = d.attention.tokens;
  expect_heads(kSegmentBackward, "out", o.out, tq, p.heads, p.head_dim, d.attention.dtype);
  SG_CHECK(o.lse == (TensorMeta{Shape{p.heads, tq}, DType::kFloat32}), "op ", kSegmentBackward,
           ": lse must be fp32 [", p.heads, ", ", tq, "], got ", dtype_name(o.lse.dtype), " ", o.lse.shape);
  expect_heads(kSegmentBackward, "dout", o.dout, tq, p.heads, p.head_dim, d.attention.dtype);
  const auto scratch = static_cast<std::int64_t>((kernels::segment_attention_backward_workspace_bytes(d) + 3) / 4);
  return output_metas(p, AttentionBackwardOutputs<TensorMeta>{
                             .dq = o.q, .dk = o.k, .dv = o.v, .scratch = {Shape{scratch}, DType::kFloat32}});
}

template <typename Operands>
kernels::SegmentAttentionDesc segment_desc_of(const AttentionParams& p, const Operands& o) {
  return {.attention = describe(p, *o.q.meta, o.q_offsets.shape().dim(0) - 1), .kv_tokens = o.k.shape().dim(0)};
}

std::int64_t sequences_of(const Operand& cu_seqlens) { return cu_seqlens.shape().dim(0) - 1; }

template <typename Operands>
kernels::AttentionDesc desc_of(const AttentionParams& p, const Operands& o) {
  return describe(p, *o.q.meta, sequences_of(o.cu_seqlens));
}

kernels::RopeDesc rope_desc_of(const RopeParams& p, const Operand& first, const Operand& cu_seqlens) {
  return describe(p, first.dtype(), first.shape().dim(0), sequences_of(cu_seqlens));
}

// --- kernel calls ---------------------------------------------------------------

// An op's CUDA launcher and host reference take the same arguments but the
// stream: each call_* binds its op's operands and outputs and calls `kernel`,
// kernels::launch_* with the stream or kernels::host::* without one;
// launch_with and run_host_with make the OpDef's functions of them.

constexpr auto call_split = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_args<QkvSplitOperands>(p, a);
  const auto out = bind_outputs<QkvSplitOutputs>(p, a);
  kernel(rope_desc_of(p, o.qkv, o.cu_seqlens), p.kv_heads, o.qkv.data, o.cu_seqlens.as<const std::int32_t>(),
         out.q.data, out.k.data, out.v.data, stream...);
};

constexpr auto call_merge = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_args<QkvMergeOperands>(p, a);
  kernel(rope_desc_of(p, o.dq, o.cu_seqlens), p.kv_heads, o.dq.data, o.dk.data, o.dv.data,
         o.cu_seqlens.as<const std::int32_t>(), a.outputs[0], stream...);
};

constexpr auto call_split_at = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_args<QkvSplitAtOperands>(p, a);
  const auto out = bind_outputs<QkvSplitOutputs>(p, a);
  kernel(describe(p, o.qkv.dtype(), o.qkv.shape().dim(0), 1), p.kv_heads, o.qkv.data,
         o.positions.as<const std::int32_t>(), out.q.data, out.k.data, out.v.data, stream...);
};

constexpr auto call_merge_at = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<RopeParams>();
  const auto o = bind_args<QkvMergeAtOperands>(p, a);
  kernel(describe(p, o.dq.dtype(), o.dq.shape().dim(0), 1), p.kv_heads, o.dq.data, o.dk.data, o.dv.data,
         o.positions.as<const std::int32_t>(), a.outputs[0], stream...);
};

constexpr auto call_forward = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_args<AttentionForwardOperands>(p, a);
  const auto out = bind_outputs<AttentionForwardOutputs>(p, a);
  kernel(desc_of(p, o), o.q.data, o.k.data, o.v.data, o.cu_seqlens.as<const std::int32_t>(), out.out.data,
         out.lse.as<float>(), stream...);
};

// Calls `args` with `kernel`: the host reference (no stream) takes them as they
// are, the launcher also the workspace (the scratch output) and the stream.
template <typename Kernel, typename Args, typename... Stream>
void call_with_workspace(Kernel kernel, const Args& args, void* workspace, Stream... stream) {
  if constexpr (sizeof...(Stream) == 0) {
    std::apply(kernel, args);
  } else {
    std::apply([&](const auto&... arg) { kernel(arg..., workspace, stream...); }, args);
  }
}

constexpr auto call_backward = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_args<AttentionBackwardOperands>(p, a);
  const auto out = bind_outputs<AttentionBackwardOutputs>(p, a);
  call_with_workspace(
      kernel,
      std::tuple(desc_of(p, o), o.q.data, o.k.data, o.v.data, o.out.data, o.lse.as<const float>(), o.dout.data,
                 o.cu_seqlens.as<const std::int32_t>(), out.dq.data, out.dk.data, out.dv.data),
      out.scratch.data, stream...);
};

constexpr auto call_segment_forward = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_args<SegmentAttentionForwardOperands>(p, a);
  const auto out = bind_outputs<AttentionForwardOutputs>(p, a);
  kernel(segment_desc_of(p, o), o.q.data, o.k.data, o.v.data, o.q_offsets.as<const std::int32_t>(),
         o.kv_ranges.as<const std::int32_t>(), out.out.data, out.lse.as<float>(), stream...);
};

constexpr auto call_segment_backward = [](const OpParams& params, const KernelArgs& a, auto kernel, auto... stream) {
  const auto& p = params.as<AttentionParams>();
  const auto o = bind_args<SegmentAttentionBackwardOperands>(p, a);
  const auto out = bind_outputs<AttentionBackwardOutputs>(p, a);
  call_with_workspace(kernel,
                      std::tuple(segment_desc_of(p, o), o.q.data, o.k.data, o.v.data, o.out.data,
                                 o.lse.as<const float>(), o.dout.data, o.q_offsets.as<const std::int32_t>(),
                                 o.kv_ranges.as<const std::int32_t>(), out.dq.data, out.dk.data, out.dv.data),
                      out.scratch.data, stream...);
};

template <const auto& kCall, auto kLaunch>
void launch_with(const OpParams& params, const KernelArgs& a, CUstream_st* stream) {
  kCall(params, a, kLaunch, stream);
}

template <const auto& kCall, auto kHost>
void run_host_with(const OpParams& params, const KernelArgs& a) {
  kCall(params, a, kHost);
}

}  // namespace

const OpDef& qkv_split_rope_op() {
  static const OpDef op{
      .name = kSplit,
      .check = check_split,
      .launch_cuda = launch_with<call_split, kernels::launch_qkv_split_rope>,
      .run_host = run_host_with<call_split, kernels::host::qkv_split_rope>,
  };
  return op;
}
SG_REGISTER_OP(qkv_split_rope_op);

const OpDef& qkv_merge_rope_backward_op() {
  static const OpDef op{
      .name = kMerge,
      .check = check_merge,
      .launch_cuda = launch_with<call_merge, kernels::launch_qkv_merge_rope_backward>,
      .run_host = run_host_with<call_merge, kernels::host::qkv_merge_rope_backward>,
  };
  return op;
}
SG_REGISTER_OP(qkv_merge_rope_backward_op);

const OpDef& qkv_split_rope_at_op() {
  static const OpDef op{
      .name = kSplitAt,
      .check = check_split_at,
      .launch_cuda = launch_with<call_split_at, kernels::launch_qkv_split_rope_at>,
      .run_host = run_host_with<call_split_at, kernels::host::qkv_split_rope_at>,
  };
  return op;
}
SG_REGISTER_OP(qkv_split_rope_at_op);

const OpDef& qkv_merge_rope_backward_at_op() {
  static const OpDef op{
      .name = kMergeAt,
      .check = check_merge_at,
      .launch_cuda = launch_with<call_merge_at, kernels::launch_qkv_merge_rope_backward_at>,
      .run_host = run_host_with<call_merge_at, kernels::host::qkv_merge_rope_backward_at>,
  };
  return op;
}
SG_REGISTER_OP(qkv_merge_rope_backward_at_op);

const OpDef& attention_forward_op() {
  static const OpDef op{
      .name = kForward,
      .check = check_forward,
      .launch_cuda = launch_with<call_forward, kernels::launch_attention_forward>,
      .run_host = run_host_with<call_forward, kernels::host::attention_forward>,
  };
  return op;
}
SG_REGISTER_OP(attention_forward_op);

const OpDef& attention_backward_op() {
  static const OpDef op{
      .name = kBackward,
      .check = check_backward,
      .launch_cuda = launch_with<call_backward, kernels::launch_attention_backward>,
      .run_host = run_host_with<call_backward, kernels::host::attention_backward>,
  };
  return op;
}
SG_REGISTER_OP(attention_backward_op);

const OpDef& segment_attention_forward_op() {
  static const OpDef op{
      .name = kSegmentForward,
      .check = check_segment_forward,
      .launch_cuda = launch_with<call_segment_forward, kernels::launch_segment_attention_forward>,
      .run_host = run_host_with<call_segment_forward, kernels::host::segment_attention_forward>,
  };
  return op;
}
SG_REGISTER_OP(segment_attention_forward_op);

const OpDef& segment_attention_backward_op() {
  static const OpDef op{
      .name = kSegmentBackward,
      .check = check_segment_backward,
      .launch_cuda = launch_with<call_segment_backward, kernels::launch_segment_attention_backward>,
      .run_host = run_host_with<call_segment_backward, kernels::host::segment_attention_backward>,
  };
  return op;
}
SG_REGISTER_OP(segment_attention_backward_op);

AttentionForward segment_attention_forward(Context& ctx, const AttentionParams& params, const Tensor& q,
                                           const Tensor& k, const Tensor& v, const Tensor& q_offsets,
                                           const Tensor& kv_ranges) {
  const auto r = bind_results<AttentionForwardOutputs>(
      params, ctx.call(segment_attention_forward_op(), params,
                       flatten(kSegmentForward, params,
                               SegmentAttentionForwardOperands<Tensor>{q, k, v, q_offsets, kv_ranges})));
  return {.out = r.out, .lse = r.lse};
}

AttentionGrads segment_attention_backward(Context& ctx, const AttentionParams& params, const Tensor& q,
                                          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                                          const Tensor& dout, const Tensor& q_offsets, const Tensor& kv_ranges) {
  const auto grads = bind_results<AttentionBackwardOutputs>(
      params, ctx.call(segment_attention_backward_op(), params,
                       flatten(kSegmentBackward, params,
                               SegmentAttentionBackwardOperands<Tensor>{q, k, v, out, lse, dout, q_offsets,
                                                                        kv_ranges})));
  return {.dq = grads.dq, .dk = grads.dk, .dv = grads.dv};
}

QkvSplit qkv_split_rope(Context& ctx, const RopeParams& params, const Tensor& qkv, const Tensor& cu_seqlens) {
  const auto out = bind_results<QkvSplitOutputs>(
      params,
      ctx.call(qkv_split_rope_op(), params, flatten(kSplit, params, QkvSplitOperands<Tensor>{qkv, cu_seqlens})));
  return {.q = out.q, .k = out.k, .v = out.v};
}

Tensor qkv_merge_rope_backward(Context& ctx, const RopeParams& params, const Tensor& dq, const Tensor& dk,
                               const Tensor& dv, const Tensor& cu_seqlens) {
  return ctx
      .call(qkv_merge_rope_backward_op(), params,
            flatten(kMerge, params, QkvMergeOperands<Tensor>{dq, dk, dv, cu_seqlens}))
      .at(0);
}

QkvSplit qkv_split_rope_at(Context& ctx, const RopeParams& params, const Tensor& qkv, const Tensor& positions) {
  const auto out = bind_results<QkvSplitOutputs>(
      params,
      ctx.call(qkv_split_rope_at_op(), params, flatten(kSplitAt, params, QkvSplitAtOperands<Tensor>{qkv, positions})));
  return {.q = out.q, .k = out.k, .v = out.v};
}

Tensor qkv_merge_rope_backward_at(Context& ctx, const RopeParams& params, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, const Tensor& positions) {
  return ctx
      .call(qkv_merge_rope_backward_at_op(), params,
            flatten(kMergeAt, params, QkvMergeAtOperands<Tensor>{dq, dk, dv, positions}))
      .at(0);
}

AttentionForward attention_forward(Context& ctx, const AttentionParams& params, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& cu_seqlens) {
  const auto r = bind_results<AttentionForwardOutputs>(
      params, ctx.call(attention_forward_op(), params,
                       flatten(kForward, params, AttentionForwardOperands<Tensor>{q, k, v, cu_seqlens})));
  return {.out = r.out, .lse = r.lse};
}

AttentionGrads attention_backward(Context& ctx, const AttentionParams& params, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  const Tensor& cu_seqlens) {
  const auto grads = bind_results<AttentionBackwardOutputs>(
      params,
      ctx.call(attention_backward_op(), params,
               flatten(kBackward, params, AttentionBackwardOperands<Tensor>{q, k, v, out, lse, dout, cu_seqlens})));
  return {.dq = grads.dq, .dk = grads.dk, .dv = grads.dv};
}

}  // namespace stepgraph::ops
