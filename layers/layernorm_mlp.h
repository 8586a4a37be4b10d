// LayerNormMLP: norm -> fc1 -> GeLU -> fc2, TransformerEngine's MLP block
// without its residual, composed of a Norm and two Linears in every
// precision and parallel mode. fc1 carries GeLU as its activation and fc2
// GeLU's derivative as its input activation (Note [Linear epilogues] in
// layers/linear.h): in 16 bits fc1's GEMM adds the bias and applies GeLU,
// keeping the pre-activation in 16 bits (GELU_AUX_BIAS), fc2's adds its bias
// (BIAS); the backward fuses GeLU's derivative and fc1's bias gradient into
// fc2's data gradient (DGELU_BGRAD) and fc2's bias gradient into its weight
// gradient (BGRADB). In fp32 and FP8 (no GeLU epilogues there) GeLU and its
// derivative run as ops of their own and fc1's bias gradient comes from
// fc1's weight gradient instead: the same math, unfused.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/parameter.h"

namespace stepgraph {

// Note [Sequence-parallel LayerNormMLP]
// With a tensor-parallel communicator of N ranks (Megatron's tensor and
// sequence parallelism), each rank holds 1/N of the tokens outside the MLP
// (its input and output are [tokens / N, hidden]) and 1/N of the ffn inside
// it: fc1 is a column-parallel and fc2 a row-parallel Linear, both
// sequence-parallel (Note [Column- and row-parallel Linear] in
// layers/linear.h). The forward normalises its token shard; fc1 all-gathers
// the normalised tokens and runs its ffn slice with GeLU; fc2 multiplies by
// its slice and reduce-scatters the partial sums back to token shards (its
// bias added by rank 0's GEMM only, so the sum holds it once). The backward
// mirrors it: fc2 all-gathers dy, the weight gradients of the slices are
// local, fc1 reduce-scatters d_normed, and the norm's gamma and beta
// gradients (of this rank's tokens only) are all-reduced across the ranks.
// Each rank's slices are the slices of the weights one rank would draw from
// the same seed, so N ranks compute what one computes, up to the order of
// the fp32 additions of fc2's partial sums. How each of the four collectives
// meets its GEMM (none, bulk, ring_exchange, pipelined) is the config's
// `overlap`, handed to the Linears: See Note [Communication-GEMM overlap].
//
// Note [FP8 LayerNormMLP]
// With config.fp8, fc1 and fc2 are FP8 Linears with the recipe
// (Note [FP8 Linear]): the same parameters under the same names and seeds,
// the norm in 16 bits, GeLU between them as its own op, fc1's and fc2's
// scaling state their own. Under tensor parallelism they shard as the
// 16-bit ones do (Note [FP8 Linear] for how FP8 meets the collectives); the
// overlap's four modes must be none or bulk. With current or delayed
// scaling and no tensor parallelism, the norm writes fc1's FP8 input, GeLU
// fc2's, and GeLU's backward fc1's FP8 output gradient in their own passes
// (config.fp8_fused; Note [Fused FP8 operands] in layers/linear.h): the
// operands' makers then apply GeLU and its derivative, not the Linears; the
// 16-bit normed and act are never written, and current scaling reads pre
// twice (amax, then the copies) instead of writing act and reading it twice.
struct LayerNormMLPConfig {
  std::int64_t hidden = 0;
  std::int64_t ffn = 0;
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
  // Tensor-parallel only: how each collective meets its GEMM.
  MLPOverlap overlap;
  // FP8 fc1 and fc2 (Note [FP8 LayerNormMLP]); nullopt runs them in 16 bits.
  std::optional<Fp8Recipe> fp8;
  // FP8 with tensor-wise scaling and no tensor parallelism: the norm, GeLU
  // and GeLU's backward write the FP8 copies fc1 and fc2 read in their own
  // pass (Note [Fused FP8 operands] in layers/linear.h). false quantizes in
  // the Linears instead: the same bits, a 16-bit tensor more written and read
  // per fused kernel.
  bool fp8_fused = true;
  // 16-bit only: keep fc1's pre-activation but not GeLU's output, and
  // compute GeLU again in the backward for fc2's weight gradient (Note
  // [Recomputed activation]).
  bool recompute_activation = false;
};

// Note [Recomputed activation]
// fc2's weight gradient reads GeLU(pre), [tokens, ffn] in 16 bits: the
// largest activation a block saves, with pre beside it (GeLU's derivative
// reads pre). With recompute_activation the forward keeps pre only, and the
// backward computes GeLU(pre) again on the weight-gradient stream right
// before fc2's weight gradient, one block at a time: tokens x ffn x 2 bytes
// less per block at the step's peak, for one GeLU pass per block. The
// recomputed GeLU reads the 16-bit pre-activation where the forward's
// epilogue read the fp32 sum, so fc2's weight gradient differs from the
// saved one in the last bits of some elements, and training drifts from
// the saving model by that much (losses within 1e-3 in tests); eager and
// graph still agree bit for bit.

class LayerNormMLP {
 public:
  struct FwdArgs {
    Tensor x;  // [tokens, hidden]
  };
  struct Saved {
    Norm::Saved norm;
    Tensor pre;         // fc1's output before GeLU (the epilogue's aux); fc2's backward reads it
    Linear::Saved fc1;  // its x: the normed input (sequence-parallel: all-gathered; FP8: undefined)
    Linear::Saved fc2;  // its x: GeLU(pre) (FP8, recompute_activation: undefined)
  };
  struct Forward {
    Tensor y;  // [tokens, hidden]
    Saved saved;
  };
  // dy, and optionally the residual stream's gradient (the input's shape),
  // returned added to dx: the norm's own arguments, its backward fuses the add.
  using BwdArgs = Norm::BwdArgs;

  // `tensor_parallel`: a communicator of N ranks shards the layer (Note
  // [Sequence-parallel LayerNormMLP]); null (or one rank with no
  // communicator) is the plain layer. ffn must divide by N.
  LayerNormMLP(Context& ctx, const std::string& name, const LayerNormMLPConfig& config, std::uint32_t seed,
               Communicator* tensor_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;  // dx; writes every grad

  const LayerNormMLPConfig& config() const { return config_; }
  Communicator* tensor_parallel() const { return tp_; }
  std::vector<Parameter*> parameters();
  // FP8: fc1 and fc2, for their owner to reach their scaling state,
  // non-finite counter and amax group (Linear); empty without FP8.
  std::vector<Linear*> fp8_linears();

 private:
  std::string label_;  // "LayerNormMLP 'name'", for argument errors
  LayerNormMLPConfig config_;
  Communicator* tp_ = nullptr;
  // The norm and GeLU write the Linears' FP8 operands (Note [FP8 LayerNormMLP]).
  bool quantized_operands_ = false;
  Norm norm_;
  Linear fc1_;  // [ffn, hidden] (column-parallel: this rank's ffn / N rows), GeLU as its activation
  Linear fc2_;  // [hidden, ffn] (row-parallel: this rank's ffn / N columns), GeLU's derivative on its dx
};

}  // namespace stepgraph
