// LayerNormLinear: norm -> Linear (TransformerEngine's fused QKV/projection
// input block), each part's backward in reverse.
//
// Tensor-parallel (a communicator, and config.linear.tensor_parallel =
// kColumn): the linear is column-parallel (Note [Column- and row-parallel
// Linear]). Without sequence parallelism the norm runs on every token on
// every rank (replicated input, so its gradients agree without a
// collective). With config.linear.sequence_parallel the input is this rank's
// token shard [tokens / N, hidden]: the norm runs on the shard, the linear
// all-gathers the normalised tokens before its GEMM and reduce-scatters
// d_normed back to the shard in the backward, and the norm's gamma and beta
// gradients (of this rank's tokens only) are all-reduced across the ranks,
// as in Note [Sequence-parallel LayerNormMLP].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/linear.h"
#include "layers/norm.h"

namespace stepgraph {

struct LayerNormLinearConfig {
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  LinearConfig linear;  // in_features is the normalized hidden size
  // FP8 with tensor-wise scaling and no tensor parallelism: the norm writes
  // the Linear's FP8 input in its own pass (Note [Fused FP8 operands] in
  // layers/linear.h); false: the Linear quantizes the 16-bit normed input
  // (the same bits).
  bool fp8_fused = true;
};

class LayerNormLinear {
 public:
  struct FwdArgs {
    Tensor x;
  };
  struct Saved {
    Norm::Saved norm;
    Linear::Saved linear;  // its x is the normed input (sequence-parallel: all-gathered)
  };
  struct Forward {
    Tensor y;
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;
    // Optional, the input's shape: returned added to dx, fused into the
    // norm's backward (the residual stream's gradient: Norm::BwdArgs).
    Tensor dx_residual;
    // Optional, dy's shape, 16-bit layers only: what the weight and bias
    // gradients read instead of dy (the data gradient still reads dy): dy
    // with the rows of copied weight rows summed over the ranks that hold
    // them (LinearOutBlock::copies, Note [Tensor-parallel attention]).
    Tensor dy_weights;
  };

  // `tensor_parallel`: the group a column-parallel linear is split across
  // (see above); null is the plain layer.
  LayerNormLinear(Context& ctx, const std::string& name, const LayerNormLinearConfig& config, std::uint32_t seed,
                  Communicator* tensor_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // dx (undefined when the linear's dgrad is off); writes every grad.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  std::vector<Parameter*> parameters();
  const Linear& linear() const { return linear_; }
  Linear& linear() { return linear_; }

 private:
  bool sequence_parallel() const;

  std::string label_;  // "LayerNormLinear 'name'", for argument errors
  Norm norm_;
  Linear linear_;
  bool fp8_fused_ = true;  // LayerNormLinearConfig::fp8_fused
};

}  // namespace stepgraph
