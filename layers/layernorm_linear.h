// LayerNormLinear: norm -> Linear (TransformerEngine's fused QKV/projection
// input block), each part's backward in reverse.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/linear.h"
#include "layers/norm.h"

namespace stepgraph {

struct LayerNormLinearConfig {
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  LinearConfig linear;  // in_features is the normalized hidden size
};

class LayerNormLinear {
 public:
  struct FwdArgs {
    Tensor x;
  };
  struct Saved {
    Norm::Saved norm;
    Linear::Saved linear;  // its x is the normed input
  };
  struct Forward {
    Tensor y;
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;
  };

  LayerNormLinear(Context& ctx, const std::string& name, const LayerNormLinearConfig& config, std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // dx (undefined when the linear's dgrad is off); writes every grad.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  std::vector<Parameter*> parameters();

 private:
  std::string label_;  // "LayerNormLinear 'name'", for argument errors
  Norm norm_;
  Linear linear_;
};

}  // namespace stepgraph
