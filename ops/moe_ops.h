// Mixture-of-experts routing ops (kernels/moe_routing.h): everything between
// a router's logits and the grouped GEMMs, on the device, capturable.
//
//   auto [experts, gates] = ops::router_topk(ctx, logits, 2);            // [T, 2] each
//   ops::MoEPlan plan = ops::moe_plan(ctx, experts, error_word, E);      // splits, offsets, ...
//   Tensor x_perm = ops::moe_permute(ctx, x, plan.sources);              // [T*2, H], grouped by expert
//   ...grouped GEMMs over plan.offsets...
//   Tensor y = ops::moe_unpermute(ctx, y_perm, plan.positions, gates);   // [T, H]
//
// Error words are persistent int32 [1] tensors the caller owns: the ops OR a
// bit into them on bad input (never stopping the step); the caller reads them
// after the step (See Note [Routing error word] in kernels/moe_routing.h).
#pragma once

#include <cstdint>
#include <string>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/moe_routing.h"

namespace stepgraph::ops {

struct TopkParams {
  int topk = 2;
  bool operator==(const TopkParams&) const = default;
  std::string to_string() const;
};

struct MoEPlanParams {
  std::int64_t experts = 0;
  bool operator==(const MoEPlanParams&) const = default;
  std::string to_string() const;
};

struct SplitOffsetsParams {
  std::int64_t tokens = 0;
  // kAtMostRows: rows past the splits' sum are padding (kernels::SplitSum).
  kernels::SplitSum sum = kernels::SplitSum::kEqualsRows;
  bool operator==(const SplitOffsetsParams&) const = default;
  std::string to_string() const;
};

struct RouterResult {
  Tensor experts;  // int32 [T, k]: the chosen experts, best first
  Tensor gates;    // fp32 [T, k]
};

struct MoEPlan {
  Tensor splits;     // int32 [E]: rows per expert
  Tensor offsets;    // int32 [E+1]
  Tensor positions;  // int32 [T, k]: the row of (token, slot) in expert order
  Tensor sources;    // int32 [T*k]: the token of each row in expert order
};

struct UnpermuteGrads {
  Tensor dy_perm;  // [T*k, H]
  Tensor dgates;   // fp32 [T, k]
};

// logits [T, E] (bf16, fp16, fp32); topk 1 or 2 (See Note [Router top-k and gates]).
// bias fp32 [E] (optional): added to the logits for the choice only (Note
// [MoE load balancing] in layers/moe_mlp.h).
RouterResult router_topk(Context& ctx, const Tensor& logits, int topk, const Tensor& bias = {});
Tensor router_topk_backward(Context& ctx, const Tensor& dgates, const Tensor& logits, const RouterResult& routed);

// experts int32 [T, k] -> the stable permutation (See Note [Stable permutation]).
MoEPlan moe_plan(Context& ctx, const Tensor& experts, const Tensor& error_word, std::int64_t num_experts);

// splits int32 [E] -> offsets int32 [E+1], validated against `tokens` on the
// device: the sum must equal it, or with kAtMostRows not exceed it.
Tensor split_offsets(Context& ctx, const Tensor& splits, const Tensor& error_word, std::int64_t tokens,
                     kernels::SplitSum sum = kernels::SplitSum::kEqualsRows);

// x [T, H] -> x_perm [T*k, H] with x_perm[r] = x[sources[r]] (k = sources / T).
Tensor moe_permute(Context& ctx, const Tensor& x, const Tensor& sources);
// y_perm [T*k, H] -> y [T, H], y[t] = sum_j gates[t, j] y_perm[positions[t, j]];
// undefined gates mean weight 1 (the backward of moe_permute).
Tensor moe_unpermute(Context& ctx, const Tensor& y_perm, const Tensor& positions, const Tensor& gates = {});
UnpermuteGrads moe_unpermute_backward(Context& ctx, const Tensor& dy, const Tensor& y_perm, const Tensor& positions,
                                      const Tensor& gates);

const OpDef& router_topk_op();
const OpDef& router_topk_backward_op();
const OpDef& moe_plan_op();
const OpDef& split_offsets_op();
const OpDef& moe_permute_op();
const OpDef& moe_unpermute_op();
const OpDef& moe_unpermute_backward_op();

}  // namespace stepgraph::ops
