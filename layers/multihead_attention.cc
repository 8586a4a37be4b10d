#include "layers/multihead_attention.h"

#include "engine/error.h"
#include "layers/layer_checks.h"

namespace stepgraph {
namespace {

// The config with its defaults resolved, checked before the projections are built.
MultiheadAttentionConfig resolved(const std::string& label, MultiheadAttentionConfig c) {
  SG_CHECK(c.hidden > 0 && c.heads > 0, label, ": hidden and heads must be > 0, got ", c.hidden, " and ", c.heads);
  SG_CHECK(c.head_dim != 0 || c.hidden % c.heads == 0, label, ": hidden (", c.hidden,
           ") must be a multiple of heads (", c.heads, "), or give head_dim");
  c.kv_heads = c.resolved_kv_heads();
  c.head_dim = c.resolved_head_dim();
  SG_CHECK(c.kv_heads > 0 && c.heads % c.kv_heads == 0, label, ": kv_heads (", c.kv_heads,
           ") must divide heads (", c.heads, ")");
  kernels::check_attention({.dtype = c.dtype, .tokens = 1, .sequences = 1, .heads = c.heads,
                            .kv_heads = c.kv_heads, .head_dim = c.head_dim, .causal = c.causal});
  kernels::check_rope({.dtype = c.dtype, .tokens = 1, .sequences = 1, .heads = c.heads, .head_dim = c.head_dim,
                       .base = c.rope_base});
  return c;
}

}  // namespace

MultiheadAttention::MultiheadAttention(Context& ctx, const std::string& name, const MultiheadAttentionConfig& config,
                                       std::uint32_t seed)
    : label_(layer_label("MultiheadAttention", name)),
      config_(resolved(label_, config)),
      qkv_(ctx, name + ".qkv",
           LayerNormLinearConfig{
               .norm = config_.norm,
               .eps = config_.eps,
               .linear = {.in_features = config_.hidden,
                          .out_features = (config_.heads + 2 * config_.kv_heads) * config_.head_dim,
                          .dtype = config_.dtype,
                          .fp8 = config_.fp8}},
           seed),
      proj_(ctx, name + ".proj",
            LinearConfig{.in_features = config_.heads * config_.head_dim,
                         .out_features = config_.hidden,
                         .dtype = config_.dtype,
                         .fp8 = config_.fp8},
            seed + 1) {}

ops::AttentionParams MultiheadAttention::attention_params() const {
  return {.heads = config_.heads, .kv_heads = config_.kv_heads, .head_dim = config_.head_dim,
          .causal = config_.causal};
}

ops::RopeParams MultiheadAttention::rope_params() const {
  return {.heads = config_.heads, .kv_heads = config_.kv_heads, .head_dim = config_.head_dim,
          .base = config_.rope_base};
}

std::vector<Linear*> MultiheadAttention::fp8_linears() {
  if (!config_.fp8) return {};
  return {&qkv_.linear(), &proj_};
}

std::vector<Parameter*> MultiheadAttention::parameters() {
  std::vector<Parameter*> out = qkv_.parameters();
  for (Parameter* p : proj_.parameters()) out.push_back(p);
  return out;
}

MultiheadAttention::Forward MultiheadAttention::forward(Context& ctx, const FwdArgs& args) const {
  check_input(label_, "forward", "x", args.x, {"tokens", config_.hidden}, config_.dtype);
  check_input(label_, "forward", "cu_seqlens", args.cu_seqlens, {"sequences + 1"}, DType::kInt32);
  const LayerNormLinear::Forward qkv = qkv_.forward(ctx, {args.x});
  const ops::QkvSplit split = ops::qkv_split_rope(ctx, rope_params(), qkv.y, args.cu_seqlens);
  const ops::AttentionForward attended =
      ops::attention_forward(ctx, attention_params(), split.q, split.k, split.v, args.cu_seqlens);
  const Linear::Forward projected = proj_.forward(ctx, {attended.out});
  return {projected.y, Saved{.qkv = qkv.saved,
                             .q = split.q,
                             .k = split.k,
                             .v = split.v,
                             .out = attended.out,
                             .lse = attended.lse,
                             .cu_seqlens = args.cu_seqlens,
                             .proj = projected.saved}};
}

Tensor MultiheadAttention::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "dy", args.dy, {"tokens", config_.hidden}, config_.dtype);
  const std::int64_t tokens = args.dy.shape().dim(0);
  check_input(label_, "backward", "saved.out", saved.out, {tokens, config_.heads * config_.head_dim}, config_.dtype,
              "the forward's attention output");
  const Tensor d_out = proj_.backward(ctx, saved.proj, {args.dy});
  const ops::AttentionGrads grads = ops::attention_backward(ctx, attention_params(), saved.q, saved.k, saved.v,
                                                            saved.out, saved.lse, d_out, saved.cu_seqlens);
  const Tensor d_qkv = ops::qkv_merge_rope_backward(ctx, rope_params(), grads.dq, grads.dk, grads.dv,
                                                    saved.cu_seqlens);
  return qkv_.backward(ctx, saved.qkv, {d_qkv, args.dx_residual});
}

}  // namespace stepgraph
