// MultiheadAttention: TransformerEngine's attention block without the
// residual add (the caller adds it, as for LayerNormMLP):
//
//   x [T, hidden] -> LayerNorm -> QKV Linear (+bias) [T, (H + 2 Hkv) D]
//     -> split, rotary embedding of q and k (one fused op)
//     -> causal attention over the packed sequences -> [T, H D]
//     -> output projection Linear (+bias) -> y [T, hidden]
//
// The tokens are sequences packed end to end; cu_seqlens int32 [S + 1]
// (kernels/attention.h) says where each starts. It is read on the device
// only, so a captured step replays with any packing of the same T and S that
// the host writes into the (persistent, bound) cu_seqlens between replays.
// kv_heads < heads is grouped-query attention (1: multi-query).
//
// Note [Tensor-parallel attention]
// With a tensor-parallel communicator of N ranks (Megatron's tensor
// parallelism) the heads are split over the ranks: rank r holds query heads
// [r H/N, (r+1) H/N) and key/value heads [r Hkv/N, (r+1) Hkv/N).
//   QKV       a column-parallel Linear (Note [Column- and row-parallel
//             Linear] in layers/linear.h) whose fused [(H + 2 Hkv) D, hidden]
//             weight is split by heads, not by contiguous rows: its three row
//             blocks (q, k, v: LinearConfig::out_blocks) are each split over
//             the ranks, so rank r holds the rows of its own q, k and v heads
//             of the weight (and bias) one rank draws from the same seed, in
//             the fused layout qkv_split_rope reads: [(H + 2 Hkv)/N D, hidden].
//   attention rotary, the causal packed attention and its deterministic
//             backward run unchanged on the H/N and Hkv/N local heads: query
//             head h reads kv head h / (H / Hkv), and with Hkv % N == 0 every
//             local query head's kv head is local too, at the same place.
//   proj      a row-parallel Linear over the H/N D local features: each rank's
//             product is a partial sum over the heads, added across the ranks
//             (rank 0's GEMM adds the bias).
// No collective runs between QKV and the projection in the forward.
// GQA and MQA, which is built:
//   kv_heads % N == 0   the kv heads split as above (MHA always, as
//                       heads % N == 0).
//   N % kv_heads == 0   (more ranks than kv heads; MQA at any N) each rank
//                       holds one kv head, a copy of the one its query heads
//                       read (kv head r / c, c = N / kv_heads ranks sharing
//                       it: LinearOutBlock::copies). Its dk and dv are each
//                       rank's part, from its own query heads: the data
//                       gradient takes them as they are (the column-parallel
//                       sum adds the parts), and the weight and bias
//                       gradients take them summed over the c ranks sharing
//                       the copy (an all-reduce over the TP group of
//                       [kv_heads T, D] blocks, a rank's part in its head's
//                       block and zeros in the others), so
//                       every copy gets the same gradient and stays equal
//                       through AdamW. 16-bit projections only (an FP8 layer's
//                       scaling state takes one dy a step): an Error with FP8.
//   otherwise           (heads % N != 0, or kv_heads and N not dividing one
//                       another) an Error naming heads, kv_heads and the TP
//                       size.
// With MultiheadAttentionConfig::sequence_parallel (what ResidualStack uses)
// x and y are this rank's token shard [T/N, hidden]: the norm runs on the
// shard, QKV all-gathers the normed tokens before its GEMM (and reduce-
// scatters d_normed back in the backward), the projection reduce-scatters its
// partial sums to token shards (and all-gathers dy first in the backward),
// and the norm's gamma and beta gradients, of this rank's tokens only, are
// all-reduced (LayerNormLinear). cu_seqlens describes the whole gathered T
// tokens, which attention sees on every rank. Without it x and y are every
// token, replicated, and the collectives are all-reduces. How each collective
// meets its GEMM is the config's `overlap`, the MLP's four values (fc1: QKV,
// fc2: the projection; Note [Communication-GEMM overlap]). FP8 projections
// shard as every FP8 Linear does, with the amaxes of their slices
// max-all-reduced (Note [FP8 Linear]); their overlaps must be none or bulk.
// N ranks compute what one computes, up to the fp32 order of the
// projection's partial sums and of QKV's data-gradient sums.
//
// Note [Context-parallel attention layer]
// With a context-parallel communicator of M ranks each rank holds T/M of
// the global batch's T tokens in the zig-zag layout (Note [Context-parallel
// token layout] in kernels/context_parallel_plan.h): x and y are its rows
// (under TP with sequence parallelism its TP rank's shard of them, the TP
// collectives acting within the CP rank's T/M tokens). cu_seqlens is the
// packing of all T, and FwdArgs::plan the rank's plan of it, made once per
// step by the caller (ResidualStack) with ops::context_parallel_plan, not
// once per layer. QKV and the projection are as without CP (every parameter
// is replicated over the CP ranks, each seeing its own tokens); the rotary
// embedding rotates each token at its position in its sequence (the plan's
// positions, qkv_split_rope_at) and attention is context-parallel (Note
// [Context-parallel attention by all-gather]): queries local, K/V gathered,
// dK/dV reduce-scattered back. The parameter gradients are this rank's
// tokens' only: the caller sums them over the CP ranks (as over data-
// parallel ones: TrainStep's gradient group is data x context parallel).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/layernorm_linear.h"
#include "layers/linear.h"
#include "ops/attention_ops.h"
#include "ops/context_parallel_ops.h"

namespace stepgraph {

struct MultiheadAttentionConfig {
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;  // 0: heads
  std::int64_t head_dim = 0;  // 0: hidden / heads
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
  bool causal = true;
  float rope_base = 10000.0f;  // the rotary embedding's base (all of head_dim rotates)
  // FP8 QKV and output projections (Note [FP8 Linear]); attention itself stays 16-bit.
  std::optional<Fp8Recipe> fp8;
  // Tensor-parallel only (Note [Tensor-parallel attention]): x and y are
  // token shards, and how each collective meets its GEMM (fc1_*: QKV's,
  // fc2_*: the projection's).
  bool sequence_parallel = true;
  MLPOverlap overlap;

  std::int64_t resolved_kv_heads() const { return kv_heads != 0 ? kv_heads : heads; }
  std::int64_t resolved_head_dim() const { return head_dim != 0 ? head_dim : (heads > 0 ? hidden / heads : 0); }
};

class MultiheadAttention {
 public:
  struct FwdArgs {
    Tensor x;           // [T, hidden] (sequence-parallel: this rank's [T/N, hidden])
    Tensor cu_seqlens;  // int32 [S + 1], over all T tokens
    // Context-parallel only (and then required): this rank's plan of
    // cu_seqlens (Note [Context-parallel attention layer]).
    std::optional<ops::ContextParallelPlan> plan;
  };
  struct Saved {
    LayerNormLinear::Saved qkv;
    // Every token's (gathered under sequence parallelism), this rank's heads.
    Tensor q, k, v;  // rotated q and k, v: [T, (H | Hkv)/N D]
    Tensor out;      // attention's output [T, H/N D] (also the projection's saved input)
    Tensor lse;      // fp32 [H/N, T]
    Tensor cu_seqlens;
    std::optional<ops::ContextParallelPlan> plan;  // context-parallel: the forward's
    Linear::Saved proj;
  };
  struct Forward {
    Tensor y;  // x's shape
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // y's shape
    // Optional, x's shape: returned added to dx, fused into the norm's
    // backward (the residual stream's gradient: Norm::BwdArgs).
    Tensor dx_residual;
  };

  // `tensor_parallel`: the group the heads are split across (Note
  // [Tensor-parallel attention]); `context_parallel`: the group the tokens
  // are split across (Note [Context-parallel attention layer]); null is
  // the plain layer.
  MultiheadAttention(Context& ctx, const std::string& name, const MultiheadAttentionConfig& config, std::uint32_t seed,
                     Communicator* tensor_parallel = nullptr, Communicator* context_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // dx; writes every parameter gradient.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  const MultiheadAttentionConfig& config() const { return config_; }
  Communicator* tensor_parallel() const { return tp_; }
  Communicator* context_parallel() const { return cp_; }
  // This rank's query and key/value heads (all of them without a communicator).
  std::int64_t local_heads() const { return config_.heads / ranks(); }
  std::int64_t local_kv_heads() const { return config_.kv_heads * kv_copies_ / ranks(); }
  // The norm's, the QKV projection's, then the output projection's.
  std::vector<Parameter*> parameters();
  // FP8: the QKV and output projections (as LayerNormMLP::fp8_linears).
  std::vector<Linear*> fp8_linears();

 private:
  ops::AttentionParams attention_params() const;
  ops::RopeParams rope_params() const;
  int ranks() const { return tp_ != nullptr ? tp_->world_size() : 1; }
  // Under sequence parallelism the projections see every rank's tokens.
  std::int64_t all_tokens(std::int64_t local_tokens) const;
  // The sum of `part` (this rank's gradient of its kv head copy, [T, D]) over
  // the ranks holding the same copy.
  Tensor sum_over_copies(Context& ctx, const Tensor& part) const;
  // dqkv from dq, dk, dv: rotated back at cu_seqlens' positions, or the plan's.
  Tensor merge_rope(Context& ctx, const Saved& saved, const Tensor& dq, const Tensor& dk, const Tensor& dv) const;

  std::string label_;
  MultiheadAttentionConfig config_;
  Communicator* tp_ = nullptr;
  Communicator* cp_ = nullptr;
  std::int64_t kv_copies_ = 1;  // ranks holding each kv head (Note [Tensor-parallel attention])
  Tensor identity_;             // [D, D], with copies: see sum_over_copies
  LayerNormLinear qkv_;
  Linear proj_;
};

}  // namespace stepgraph
