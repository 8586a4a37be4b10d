// Mixture-of-experts routing on the device: everything between the router's
// logits and the grouped GEMMs, with no value ever read back to the host, so
// a whole MoE layer is capturable. Dropless: no capacity, no token dropped.
//
//   router_topk        logits [T, E] -> experts int32 [T, k], gates fp32 [T, k]
//   router_backward    d gates [T, k] -> d logits [T, E]
//   moe_plan           experts [T, k] -> splits int32 [E], offsets int32 [E+1],
//                      positions int32 [T*k], sources int32 [T*k]
//   split_offsets      splits int32 [E] -> offsets int32 [E+1], validated
//                      (summing to the rows, or at most to them: SplitSum)
//   moe_permute        x [T, H] -> x_perm [T*k, H]    x_perm[r] = x[sources[r]]
//   moe_unpermute      y_perm [T*k, H] -> y [T, H]    y[t] = sum_j gate[t,j] y_perm[positions[t*k+j]]
//                      (no gates: weight 1, which is also permute's backward)
//   moe_unpermute_backward  dy [T, H] -> dy_perm [T*k, H], d gates [T, k]
//
// Note [Router top-k and gates]
// p = softmax(logits) over the E experts (fp32 math). The k experts are the k
// largest logits (the same order as p); ties go to the lower expert index, and
// a NaN logit ranks below every number, so the choice is exact and identical on
// host and device. Gates:
//   k = 1: gate = p[e1]                          (the softmax probability)
//   k = 2: gate_j = p[e_j] / (p[e1] + p[e2])     (renormalized over the two:
//          a softmax over the two chosen logits)
// The backward is the exact derivative of these gates w.r.t. every logit (for
// k = 2 the unchosen logits get zero gradient).
// With an expert bias b [E] (Note [MoE load balancing] in layers/moe_mlp.h)
// the k experts are the k largest l + b (the same order and ties), while p
// and the gates above stay those of the unbiased logits: the bias steers the
// choice and never the weights, so the backward is unchanged.
//
// Note [Stable permutation]
// Entry i = t*k + j is (token t, slot j). The permuted order groups entries by
// expert (expert 0's rows first) and keeps entry order inside an expert, so
// positions depend only on the experts chosen, never on thread timing: the
// plan counts per chunk of entries, scans the counts in a fixed order, then
// ranks each entry inside its chunk with warp votes. No atomics on positions.
//
// Note [Routing error word]
// Bad split sizes (negative, or not adding up to the token count, or with
// SplitSum::kAtMostRows adding up to more) and expert
// indices outside [0, E) never stop a launch: the kernels clamp so every
// later kernel stays in bounds, and OR a bit into an int32 error word on the
// device (kSplitNegative, kSplitSumMismatch, kExpertOutOfRange). The word is
// sticky; the host reads it once per step, outside any captured graph, and
// raises. Host references do the same (they set the word, they do not throw).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

inline constexpr std::int32_t kSplitNegative = 1;
inline constexpr std::int32_t kSplitSumMismatch = 2;
inline constexpr std::int32_t kExpertOutOfRange = 4;

// Most experts a layer may have (the plan keeps per-expert counters in
// shared memory).
inline constexpr std::int64_t kMaxExperts = 1024;
// The experts a token is routed to: the router and the permutation handle one
// or two (the trainer's --topk, the layers' topk).
inline constexpr int kMaxTopk = 2;

struct RouterDesc {
  DType logits_type = DType::kBFloat16;  // bf16, fp16 or fp32; d logits share it
  std::int64_t tokens = 0;
  std::int64_t experts = 0;
  int topk = 2;
};

// topk in [1, kMaxTopk], 1 <= topk <= experts <= kMaxExperts, tokens in [1, 2^31).
void check_router(const RouterDesc& desc);

// `bias` (fp32 [E], may be null): added to the logits for the choice of
// experts only; the gates are of the unbiased logits (Note [Router top-k and gates]).
void launch_router_topk(const RouterDesc& desc, const void* logits, std::int32_t* experts, float* gates,
                        cudaStream_t stream, const float* bias = nullptr);
void launch_router_backward(const RouterDesc& desc, const float* dgates, const void* logits,
                            const std::int32_t* experts, const float* gates, void* dlogits, cudaStream_t stream);

struct PlanDesc {
  std::int64_t tokens = 0;
  std::int64_t experts = 0;
  int topk = 1;
  std::int64_t entries() const { return tokens * topk; }
};

void check_plan(const PlanDesc& desc);
// Scratch of launch_moe_plan (per-chunk counts); needs no initialization.
std::size_t moe_plan_workspace_bytes(const PlanDesc& desc);
// experts [T*k] -> splits [E], offsets [E+1], positions [T*k], sources [T*k].
// An out-of-range expert counts as expert 0 and sets kExpertOutOfRange.
void launch_moe_plan(const PlanDesc& desc, const std::int32_t* experts, std::int32_t* splits, std::int32_t* offsets,
                     std::int32_t* positions, std::int32_t* sources, void* workspace, std::int32_t* error_word,
                     cudaStream_t stream);

// What the splits of `tokens` rows must add up to. kAtMostRows: the splits
// cover the leading rows and the rows past their sum belong to no group
// (padding: the grouped GEMMs write them as zeros and leave them out of every
// gradient sum), as in an expert-parallel receive buffer sized by its bound
// (Note [Expert-parallel MoE] in layers/moe_mlp.h).
enum class SplitSum : std::uint8_t {
  kEqualsRows,  // sum(splits) == tokens
  kAtMostRows,  // sum(splits) <= tokens
};

// offsets[0] = 0, offsets[e+1] = offsets[e] + splits[e], with negative splits
// taken as 0 and every offset clamped to `tokens`; a negative split, or a sum
// that breaks `sum`, sets the error word (see Note [Routing error word]).
void launch_split_offsets(std::int64_t experts, std::int64_t tokens, const std::int32_t* splits, std::int32_t* offsets,
                          std::int32_t* error_word, cudaStream_t stream, SplitSum sum = SplitSum::kEqualsRows);

struct PermuteDesc {
  DType dtype = DType::kBFloat16;  // of x, y, dy: bf16, fp16 or fp32
  std::int64_t tokens = 0;
  std::int64_t hidden = 0;
  int topk = 1;
  std::int64_t entries() const { return tokens * topk; }
};

void check_permute(const PermuteDesc& desc);
void launch_moe_permute(const PermuteDesc& desc, const void* x, const std::int32_t* sources, void* x_perm,
                        cudaStream_t stream);
// gates may be null (weight 1).
void launch_moe_unpermute(const PermuteDesc& desc, const void* y_perm, const std::int32_t* positions,
                          const float* gates, void* y, cudaStream_t stream);
// dy_perm[positions[i]] = gates[i] * dy[i / k]; dgates[i] = <dy[i / k], y_perm[positions[i]]>.
void launch_moe_unpermute_backward(const PermuteDesc& desc, const void* dy, const void* y_perm,
                                   const std::int32_t* positions, const float* gates, void* dy_perm, float* dgates,
                                   cudaStream_t stream);

namespace host {
void router_topk(const RouterDesc& desc, const void* logits, std::int32_t* experts, float* gates,
                 const float* bias = nullptr);
void router_backward(const RouterDesc& desc, const float* dgates, const void* logits, const std::int32_t* experts,
                     const float* gates, void* dlogits);
void moe_plan(const PlanDesc& desc, const std::int32_t* experts, std::int32_t* splits, std::int32_t* offsets,
              std::int32_t* positions, std::int32_t* sources, std::int32_t* error_word);
void split_offsets(std::int64_t experts, std::int64_t tokens, const std::int32_t* splits, std::int32_t* offsets,
                   std::int32_t* error_word, SplitSum sum = SplitSum::kEqualsRows);
void moe_permute(const PermuteDesc& desc, const void* x, const std::int32_t* sources, void* x_perm);
void moe_unpermute(const PermuteDesc& desc, const void* y_perm, const std::int32_t* positions, const float* gates,
                   void* y);
void moe_unpermute_backward(const PermuteDesc& desc, const void* dy, const void* y_perm, const std::int32_t* positions,
                            const float* gates, void* dy_perm, float* dgates);
}  // namespace host

}  // namespace stepgraph::kernels
