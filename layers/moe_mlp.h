// MoEMLP: a mixture-of-experts MLP without its residual, every step on the
// device (no host read anywhere, so the whole layer is capturable):
//
//   norm -> router (Linear hidden -> experts, no bias) -> top-k softmax gates
//        -> stable permutation by expert -> grouped fc1 (+bias) -> GeLU
//        -> grouped fc2 (+bias) -> unpermute, y[t] = sum_j gate[t,j] out[t,j]
//
// Dropless: every token reaches its k experts (no capacity). Gates: See Note
// [Router top-k and gates] in kernels/moe_routing.h (k = 2 renormalizes over
// the two chosen experts). The router's gradient flows through the gates; the
// expert choice itself has none. Optional load balancing: See Note [MoE load
// balancing].
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "layers/grouped_linear.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/parameter.h"
#include "ops/moe_balance_ops.h"
#include "ops/moe_ops.h"

namespace stepgraph {

// Note [Tensor-parallel MoE]
// With a tensor-parallel communicator of N ranks, every expert's MLP is split
// the way LayerNormMLP is (See Note [Sequence-parallel LayerNormMLP] in
// layers/layernorm_mlp.h), with the tokens sequence-parallel outside:
//   forward   x [T/N, H] -> norm (this rank's tokens) -> all-gather -> [T, H]
//             -> router on all T tokens -> top-k, gates, plan -> permute
//             -> fc1 column-parallel (rank r: rows [r F/N, (r+1) F/N) of every
//                expert's weight and bias) -> GeLU (elementwise: exact on a slice)
//             -> fc2 row-parallel (the matching columns; its bias added by rank 0)
//             -> unpermute with the gates -> partial y [T, H]
//             -> reduce-scatter -> y [T/N, H]
// The router's weights are whole on every rank (drawn from the same seed) and
// its input is the all-gathered tokens, the same bits everywhere, so every rank
// computes the same logits, experts, gates and plan: the routing needs no
// communication and the split sizes never leave the device. The unpermute is
// linear in the expert outputs, so the gated partial sums add up to the whole
// output; reducing after it moves T rows instead of T k.
//   backward  dy [T/N, H] -> all-gather -> dy [T, H], the same on every rank
//             -> dy_perm[t, j] = gate[t, j] dy[t]: whole and the same everywhere
//             -> fc2, GeLU, fc1 backward on this rank's slices (their weight and
//                bias gradients are this rank's slices; fc2's bias gradient is
//                the whole one, the same on every rank)
//             -> the experts' d normed [T, H]: a partial sum over the ranks
// d gate[t, j] = <dy[t], out[t, j]> needs the whole expert output out = sum_r
// out_r, which no rank holds. It is linear in out, so each rank takes the dot
// with its partial out_r and an all-reduce (sum) of those fp32 [T, k] values
// (4 k bytes per token, tiny beside the [T, H] collectives) gives the exact d
// gate, up to the order of the fp32 additions; every rank receives the same
// reduced bits. So d logits, the router's weight gradient (d logits^T normed,
// over all T tokens) and its d normed (d logits W_router) are the same on every
// rank with no further collective. We keep the router's weight gradient
// replicated rather than computing it on each rank's tokens and all-reducing
// it: the router GEMM is tiny (E outputs), it spares a collective on the
// backward's path, and bit-identical gradients keep the replicated router
// weights identical under the optimizer with no communication. The router's d
// normed is whole while the experts' is partial: rank 0 adds it before the
// reduce-scatter, so the sum holds it once (as fc2's bias in the forward).
//             -> d normed reduce-scattered -> [T/N, H] -> norm backward on this
//                rank's tokens; gamma and beta gradients all-reduced
// Every rank issues, per step: all-gather, reduce-scatter (forward);
// all-gather, all-reduce (d gates), reduce-scatter, all-reduce of the norm's
// gradients (backward). Each rank's slices are the slices of the weights one
// rank draws from the same seed, so N ranks compute what one rank computes on
// the same global tokens, up to the order of fp32 additions (fc2's partial
// sums, fc1's data gradients, d gates). ffn must divide by N; the token shards
// must be equal (the collectives check it).

// Note [Expert-parallel MoE]
// With an expert-parallel communicator of P ranks (E % P == 0), rank r holds
// the L = E / P whole experts [r L, (r + 1) L): their fc1 and fc2 weights and
// biases are the rows of the one-rank layer's [E, ...] parameters drawn from
// the same seed, so expert e is the same expert whichever rank holds it. Each
// rank has its own tokens; the norm and the router are replicated (the same
// seed everywhere) and see only this rank's tokens:
//   forward   x [T, H] -> norm -> router -> top-k, gates, plan over all E
//             -> permute: x_perm [R, H], R = T k, grouped by global expert
//             -> ep_counts (every rank's splits) -> ep_dispatch: rows [P R, H]
//                grouped by local expert, within one by source rank, and the
//                local splits [L] (Note [Expert-parallel exchange] in
//                ops/moe_exchange_ops.h)
//             -> fc1 -> GeLU -> fc2 over the L local experts
//             -> ep_combine: y_perm [R, H] back in x_perm's order
//             -> unpermute with the gates -> y [T, H]
//   backward  the mirror: dy_perm -> ep_dispatch (ep_combine_backward) -> fc2,
//             GeLU, fc1 backward -> ep_combine (ep_dispatch_backward) ->
//             d x_perm, then the router and the norm on this rank's tokens.
// The receive buffer holds P R rows, the bound no routing exceeds (every
// token of every rank choosing this rank's experts), so nothing is dropped and
// no shape depends on the routing; the local splits add up to at most P R.
// The experts' saved activations (fc1's input and output, fc2's input) are
// those P R rows: P times the rows of the layer without EP, the price of the
// bound until a smaller configured capacity exists.
// fc1 and fc2 run with SplitSum::kAtMostRows: the rows past the sum belong to
// no expert, the grouped products write zeros there and leave them out of the
// weight and bias gradients, and GeLU of those zeros is zero (its gradient
// there too), so the padding reaches nothing. A sum above P R or a negative
// split still sets the experts' error word.
// Expert e's rows arrive by source rank in rank order, each rank's in its
// token order: the order in which one rank sees them on the ranks' tokens
// concatenated in rank order. So y, dx and every local expert's weight and
// bias gradients equal the one-rank layer's on that global batch bit for bit
// (tested on host thread worlds; the bf16 CUDA products start a group's tiles
// at its first row, so they keep that order too).
// The norm's and router's gradients are this rank's tokens' share: sum them
// over the group as data-parallel gradients (expert_parameters() lists the
// others, which are whole per rank and never summed across the group); the sum
// equals the one-rank gradient up to the order of fp32 additions.
// Refused: EP with tensor-parallel experts (a rank would hold slices of some
// experts: not built), and FP8 experts under EP (each rank's tensor-wise
// scales would cover only its experts and rows, so the products would not be
// the one-rank layer's).
// Note [MoE load balancing]
// Two methods, each off by default and on by a config value:
// - The Switch auxiliary loss (aux_loss_coef = coef > 0):
//     aux = coef E sum_e f_e P_e
//   f_e: the fraction of the layer's T k (token, slot) assignments routed to
//   expert e (the plan's splits / (T k): no gradient), P_e: the mean router
//   probability of e over the T tokens (softmax of the unbiased logits:
//   differentiable). Its gradient (kernels/moe_balance.h) is added to the
//   router's d logits in the backward, times the factor the language-model
//   loss's gradient carries (MoEBalanceSetup: 1/N over N data-parallel
//   ranks, and the dynamic loss scale S where the optimizer keeps one), so
//   the step minimizes loss + aux. f and P are each rank's, over the tokens it
//   routes (Switch's and Megatron's default): under data or expert
//   parallelism every rank's aux is of its own tokens and the summed
//   gradients are those of the ranks' mean aux, as with the loss; under
//   tensor parallelism every rank routes all the group's tokens, so every
//   rank computes the same aux and the same router gradient. The forward
//   returns the value (Forward::aux_loss, fp32 [1]); it is reported beside
//   the loss, never added to it.
// - Auxiliary-loss-free balancing (DeepSeek-V3; bias_update_rate = rate > 0):
//   a persistent per-expert bias b fp32 [E], starting at 0, is added to the
//   router logits for the top-k choice only; the gates are the unbiased
//   logits' (Note [Router top-k and gates]), so the bias has no gradient and
//   the router's backward is unchanged. At the end of the layer's backward,
//   on the device, b_e += rate * sign(mean load - load_e), load_e the
//   (token, slot) assignments to e in the step summed over
//   MoEBalanceSetup::load_group (an int32 all-reduce of the splits: the
//   step's gradient group, so every rank keeps the same bias; under expert
//   parallelism ep_counts already holds every EP rank's splits, but the
//   group may be wider (EP x DP), so the all-reduce serves both). The sign
//   compares integers, exact on every rank. The next step's choice reads
//   the new bias; a step the optimizer skips as non-finite still moves it
//   (its counts are finite). The bias is a StateTensor ("<name>.expert_bias"):
//   checkpoints hold it and a resume continues exactly.
struct MoEBalanceSetup {
  // The group the expert loads are summed over (the step's data-parallel
  // group); null: this rank's loads alone.
  Communicator* load_group = nullptr;
  // The aux loss gradient's factor: the language-model loss's (1/N over N
  // data-parallel ranks).
  float loss_factor = 1.0f;
  // fp32 [3] dynamic loss-scale state (AdamW::loss_scale_state), or undefined.
  Tensor loss_scale;
};

struct MoEMLPConfig {
  std::int64_t hidden = 0;
  std::int64_t ffn = 0;  // per expert
  std::int64_t experts = 0;
  int topk = 2;  // 1 or 2
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;  // bf16 or fp32
  // FP8 expert products (Note [FP8 GroupedLinear]: current or delayed
  // scaling, bf16); the router stays 16-bit (its E outputs are few).
  std::optional<Fp8Recipe> fp8;
  // 16-bit experts keep fc1's output only and compute GeLU again right
  // before fc2's backward (as LayerNormMLP's Note [Recomputed activation]):
  // [tokens * k, ffn] 16-bit elements less per block at the step's peak.
  // The forward's GeLU reads the same 16-bit pre-activation, so the
  // gradients are the same bits. FP8 experts save fc2's input quantized and
  // ignore it.
  bool recompute_activation = false;
  // Load balancing (Note [MoE load balancing]): the Switch auxiliary loss's
  // coefficient (0: off; Switch used 1e-2) and the expert bias's update rate
  // (0: no bias; DeepSeek-V3 used 1e-3).
  float aux_loss_coef = 0.0f;
  float bias_update_rate = 0.0f;
};

class MoEMLP {
 public:
  // With N tensor-parallel ranks, x, y, dy and dx are this rank's token
  // shard [tokens / N, hidden] and everything in Saved past the norm covers
  // all the tokens (See Note [Tensor-parallel MoE]). With P expert-parallel
  // ranks everything is this rank's tokens except fc1, pre and fc2, which
  // hold the P tokens * k rows dispatched to its experts (See Note
  // [Expert-parallel MoE]).
  struct FwdArgs {
    Tensor x;  // [tokens, hidden]
  };
  struct Saved {
    Norm::Saved norm;
    Linear::Saved router;      // its input: the (all-gathered) normed tokens
    Tensor logits;             // [tokens, experts]
    ops::RouterResult routed;  // experts, gates [tokens, k]
    ops::MoEPlan plan;
    Tensor ep_counts;          // expert-parallel: int32 [P, E], every rank's splits; else undefined
    GroupedLinear::Saved fc1;  // its input: the permuted normed rows (expert-parallel: the dispatched rows)
    Tensor pre;                // fc1's output, before GeLU
    GroupedLinear::Saved fc2;  // its input: GeLU(pre) (undefined with recompute_activation)
    // The expert outputs [tokens * k, hidden] in expert order (a partial sum
    // when sharded; expert-parallel: combined back from the experts' ranks).
    Tensor expert_out;
  };
  struct Forward {
    Tensor y;  // [tokens, hidden]
    Saved saved;
    Tensor aux_loss;  // fp32 [1] with aux_loss_coef > 0 (Note [MoE load balancing]); else undefined
  };
  // dy, and optionally the residual stream's gradient (the input's shape),
  // returned added to dx: the norm's own arguments, its backward fuses the add.
  using BwdArgs = Norm::BwdArgs;

  // `tensor_parallel`: a communicator of N ranks shards every expert's ffn
  // and the tokens (Note [Tensor-parallel MoE]); null is the plain layer.
  // ffn must divide by N.
  // `expert_parallel`: a communicator of P ranks over which the experts are
  // spread, E / P whole experts a rank (Note [Expert-parallel MoE]); null
  // holds all of them. Not with `tensor_parallel`.
  MoEMLP(Context& ctx, const std::string& name, const MoEMLPConfig& config, std::uint32_t seed,
         Communicator* tensor_parallel = nullptr, Communicator* expert_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;  // dx; writes every grad

  // Error if the routing or the experts' splits went wrong in a step since the
  // last check (device error words, read once each: after a step, never inside one).
  void check_errors(Context& ctx) const;

  const MoEMLPConfig& config() const { return config_; }
  // How the balancing meets the step (Note [MoE load balancing]); the step
  // sets it once, before tracing. The default: one rank, factor 1.
  void set_balance(const MoEBalanceSetup& setup) { balance_ = setup; }
  // The expert bias, fp32 [E] (undefined with bias_update_rate 0).
  const Tensor& expert_bias() const { return expert_bias_; }
  // The expert bias as checkpoint state; empty without it.
  std::vector<StateTensor> state() const;
  Communicator* tensor_parallel() const { return tp_; }
  Communicator* expert_parallel() const { return ep_; }
  std::vector<Parameter*> parameters();
  // fc1's and fc2's weights and biases: under expert parallelism this rank's
  // experts, whose gradients are whole (never summed over the group).
  std::vector<Parameter*> expert_parameters();
  // fc1 and fc2 with an FP8 recipe; empty without one.
  std::vector<GroupedLinear*> fp8_experts();

 private:
  int ranks() const { return tp_ != nullptr ? tp_->world_size() : 1; }
  ops::AuxLossParams aux_params() const;
  // The bias update at the end of the backward (Note [MoE load balancing]).
  void update_expert_bias(Context& ctx, const Saved& saved) const;

  std::string name_;
  MoEMLPConfig config_;
  Communicator* tp_ = nullptr;
  Communicator* ep_ = nullptr;
  Norm norm_;
  Linear router_;
  GroupedLinear fc1_;  // column-parallel when sharded; this rank's experts under EP
  GroupedLinear fc2_;  // row-parallel when sharded; this rank's experts under EP
  Tensor routing_error_;  // int32 [1], the plan's error word
  Tensor expert_bias_;    // fp32 [E]: Note [MoE load balancing]
  MoEBalanceSetup balance_;
};

}  // namespace stepgraph
