#include "layers/multihead_attention.h"

#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "layers/context_parallel_attention.h"
#include "layers/layer_checks.h"
#include "ops/collective_ops.h"
#include "ops/elementwise_ops.h"
#include "ops/gemm_ops.h"
#include "ops/row_ops.h"

namespace stepgraph {
namespace {

// The config with its defaults resolved, checked before the projections are
// built; with `tp`, also how its heads split (Note [Tensor-parallel attention]).
MultiheadAttentionConfig resolved(Context& ctx, const std::string& label, MultiheadAttentionConfig c,
                                  Communicator* tp) {
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
  if (tp == nullptr) return c;  // overlap is the collectives' (as LayerNormMLP's): none here
  tp->check_device(ctx.device(), label);
  const std::int64_t n = tp->world_size();
  SG_CHECK_CODE(c.heads % n == 0, ErrorCode::kUnsupported, label, ": heads ", c.heads, " (kv_heads ", c.kv_heads,
                ") do not split over the tensor-parallel size ", n, " of ", tp->describe(),
                "; make heads a multiple of the TP size");
  SG_CHECK_CODE(c.kv_heads % n == 0 || n % c.kv_heads == 0, ErrorCode::kUnsupported, label, ": heads ", c.heads,
                ", kv_heads ", c.kv_heads, " at tensor-parallel size ", n,
                ": the kv heads neither split over the ranks nor divide them; make kv_heads a multiple or a divisor "
                "of the TP size (Note [Tensor-parallel attention])");
  SG_CHECK_CODE(c.kv_heads % n == 0 || !c.fp8, ErrorCode::kUnsupported, label, ": heads ", c.heads, ", kv_heads ",
                c.kv_heads, " at tensor-parallel size ", n,
                ": copies of kv heads (more ranks than kv heads) with FP8 projections are not supported; make "
                "kv_heads a multiple of the TP size, or run the projections in 16 bits");
  c.overlap.check(label);
  return c;
}

// How many ranks hold a copy of each kv head: 1 where the kv heads split
// over the ranks (Note [Tensor-parallel attention]).
std::int64_t kv_copies_of(const MultiheadAttentionConfig& c, Communicator* tp) {
  if (tp == nullptr || c.kv_heads % tp->world_size() == 0) return 1;
  return tp->world_size() / c.kv_heads;
}

// The QKV projection (fc1 of the overlap) or the output projection.
LinearConfig projection_config(const MultiheadAttentionConfig& c, bool qkv, bool split, std::int64_t kv_copies) {
  const MLPOverlap overlap = split ? c.overlap : MLPOverlap{};
  LinearConfig out{.in_features = qkv ? c.hidden : c.heads * c.head_dim,
                   .out_features = qkv ? (c.heads + 2 * c.kv_heads) * c.head_dim : c.hidden,
                   .dtype = c.dtype,
                   .tensor_parallel = !split ? TensorParallelMode::kNone
                                      : qkv  ? TensorParallelMode::kColumn
                                             : TensorParallelMode::kRow,
                   .sequence_parallel = split && c.sequence_parallel,
                   .fprop_overlap = qkv ? overlap.fc1_fprop : overlap.fc2_fprop,
                   .dgrad_overlap = qkv ? overlap.fc1_dgrad : overlap.fc2_dgrad,
                   .fp8 = c.fp8};
  // Split by heads: each rank's q, k and v heads (Note [Tensor-parallel attention]).
  if (qkv && split) {
    const std::int64_t kv = c.kv_heads * c.head_dim;
    out.out_blocks = {{.rows = c.heads * c.head_dim},
                      {.rows = kv, .copies = kv_copies},
                      {.rows = kv, .copies = kv_copies}};
  }
  return out;
}

}  // namespace

MultiheadAttention::MultiheadAttention(Context& ctx, const std::string& name, const MultiheadAttentionConfig& config,
                                       std::uint32_t seed, Communicator* tensor_parallel,
                                       Communicator* context_parallel)
    : label_(layer_label("MultiheadAttention", name)),
      config_(resolved(ctx, label_, config, tensor_parallel)),
      tp_(tensor_parallel),
      cp_(context_parallel),
      kv_copies_(kv_copies_of(config_, tp_)),
      qkv_(ctx, name + ".qkv",
           LayerNormLinearConfig{.norm = config_.norm,
                                 .eps = config_.eps,
                                 .linear = projection_config(config_, true, tp_ != nullptr, kv_copies_)},
           seed, tp_),
      proj_(ctx, name + ".proj", projection_config(config_, false, tp_ != nullptr, kv_copies_), seed + 1, tp_) {
  if (cp_ != nullptr) cp_->check_device(ctx.device(), label_ + " (context parallel)");
  if (kv_copies_ > 1) {
    // sum_over_copies' [D, D] identity, in the layer's dtype.
    const std::int64_t d = config_.head_dim;
    identity_ = ctx.persistent(name + ".kv_copies.identity", {Shape{d, d}, config_.dtype});
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(identity_.bytes()));
    for (std::int64_t i = 0; i < d * d; ++i) {
      store_from_float(config_.dtype, bytes.data(), i, i / d == i % d ? 1.0f : 0.0f);
    }
    ctx.copy_from_host(identity_, bytes.data(), bytes.size());
  }
}

ops::AttentionParams MultiheadAttention::attention_params() const {
  return {.heads = local_heads(), .kv_heads = local_kv_heads(), .head_dim = config_.head_dim,
          .causal = config_.causal};
}

ops::RopeParams MultiheadAttention::rope_params() const {
  return {.heads = local_heads(), .kv_heads = local_kv_heads(), .head_dim = config_.head_dim,
          .base = config_.rope_base};
}

std::int64_t MultiheadAttention::all_tokens(std::int64_t local_tokens) const {
  return tp_ != nullptr && config_.sequence_parallel ? local_tokens * ranks() : local_tokens;
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
  SG_CHECK(args.plan.has_value() == (cp_ != nullptr), label_, " forward: ",
           cp_ != nullptr ? "the layer is context-parallel over " + cp_->describe() +
                                " but args.plan is empty; make the rank's plan once per step with "
                                "ops::context_parallel_plan from the global cu_seqlens and pass it"
                          : std::string("args.plan is given but the layer has no context-parallel communicator; "
                                        "build it with one, or leave args.plan empty"));
  // Sequence-parallel: QKV all-gathers the normed shards, so q, k, v hold
  // every token (of this context-parallel rank).
  const LayerNormLinear::Forward qkv = qkv_.forward(ctx, {args.x});
  const ops::QkvSplit split = cp_ != nullptr ? ops::qkv_split_rope_at(ctx, rope_params(), qkv.y, args.plan->positions)
                                             : ops::qkv_split_rope(ctx, rope_params(), qkv.y, args.cu_seqlens);
  const ops::AttentionForward attended =
      cp_ != nullptr
          ? context_parallel_attention_forward(ctx, *cp_, attention_params(), *args.plan, split.q, split.k, split.v)
          : ops::attention_forward(ctx, attention_params(), split.q, split.k, split.v, args.cu_seqlens);
  const Linear::Forward projected = proj_.forward(ctx, {attended.out});
  return {projected.y, Saved{.qkv = qkv.saved,
                             .q = split.q,
                             .k = split.k,
                             .v = split.v,
                             .out = attended.out,
                             .lse = attended.lse,
                             .cu_seqlens = args.cu_seqlens,
                             .plan = args.plan,
                             .proj = projected.saved}};
}

Tensor MultiheadAttention::backward(Context& ctx, const Saved& saved, const BwdArgs& args) const {
  check_input(label_, "backward", "dy", args.dy, {"tokens", config_.hidden}, config_.dtype);
  const std::int64_t tokens = all_tokens(args.dy.shape().dim(0));
  check_input(label_, "backward", "saved.out", saved.out, {tokens, local_heads() * config_.head_dim}, config_.dtype,
              "the forward's attention output");
  SG_CHECK(
      saved.plan.has_value() == (cp_ != nullptr), label_, " backward: saved.plan ",
      cp_ != nullptr ? "is empty but the layer is context-parallel" : "is set but the layer is not context-parallel",
      "; pass the Saved of this layer's forward");
  const Tensor d_out = proj_.backward(ctx, saved.proj, {args.dy});
  const ops::AttentionGrads grads =
      cp_ != nullptr ? context_parallel_attention_backward(ctx, *cp_, attention_params(), *saved.plan, saved.q, saved.k,
                                                           saved.v, saved.out, saved.lse, d_out)
                     : ops::attention_backward(ctx, attention_params(), saved.q, saved.k, saved.v, saved.out, saved.lse,
                                               d_out, saved.cu_seqlens);
  const Tensor d_qkv = merge_rope(ctx, saved, grads.dq, grads.dk, grads.dv);
  if (kv_copies_ == 1) return qkv_.backward(ctx, saved.qkv, {d_qkv, args.dx_residual});
  // Copies of a kv head: dx takes each rank's own part of dk and dv (the
  // column-parallel sum adds them), the weight gradients the parts of every
  // rank holding the copy, so the copies' gradients, and the copies after
  // AdamW, stay equal (Note [Tensor-parallel attention]).
  const Tensor d_qkv_weights =
      merge_rope(ctx, saved, grads.dq, sum_over_copies(ctx, grads.dk), sum_over_copies(ctx, grads.dv));
  return qkv_.backward(ctx, saved.qkv, {.dy = d_qkv, .dx_residual = args.dx_residual, .dy_weights = d_qkv_weights});
}

Tensor MultiheadAttention::merge_rope(Context& ctx, const Saved& saved, const Tensor& dq, const Tensor& dk,
                                      const Tensor& dv) const {
  if (saved.plan) return ops::qkv_merge_rope_backward_at(ctx, rope_params(), dq, dk, dv, saved.plan->positions);
  return ops::qkv_merge_rope_backward(ctx, rope_params(), dq, dk, dv, saved.cu_seqlens);
}

Tensor MultiheadAttention::sum_over_copies(Context& ctx, const Tensor& part) const {
  // [kv_heads T, D] blocks, one a kv head: each rank writes its part into its
  // copy's block and zeros into the others, and the all-reduce (the same bits
  // on every rank) sums each block over the ranks sharing that head; the
  // block is read out by a GEMM with the identity (exact: one product a term).
  const std::int64_t tokens = part.shape().dim(0);
  const std::int64_t head = tp_->rank() / kv_copies_;
  Tensor zeros = ops::fill(ctx, {part.shape(), DType::kFloat32}, 0.0f);
  if (part.dtype() != DType::kFloat32) zeros = ops::cast(ctx, zeros, part.dtype());
  const Tensor blocks = ops::empty(ctx, {Shape{config_.kv_heads * tokens, part.shape().dim(1)}, part.dtype()});
  for (std::int64_t h = 0; h < config_.kv_heads; ++h) {
    ops::copy_rows_(ctx, blocks, h == head ? part : zeros, h * tokens);
  }
  const Tensor sums = ops::all_reduce(ctx, *tp_, blocks, ReduceOp::kSum);
  return ops::gemm(ctx, sums, identity_,
                   {.trans_b = true, .out_dtype = part.dtype(), .rows = tokens, .a_row = head * tokens})
      .d;
}

}  // namespace stepgraph
