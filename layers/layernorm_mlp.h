// LayerNormMLP: norm -> fc1 -> GeLU -> fc2, TransformerEngine's MLP block
// without its residual. The bias and the GeLU of fc1 are fused into one
// cuBLASLt epilogue (GELU_AUX_BIAS, which keeps the pre-activation for the
// backward), fc2's bias into another (BIAS); the backward fuses GeLU's
// derivative and fc1's bias gradient into fc2's dgrad (DGELU_BGRAD) and fc2's
// bias gradient into its wgrad (BGRADB). In fp32 (where cuBLASLt has no
// GeLU epilogues) GeLU and its derivative run as separate ops and fc1's bias
// gradient comes fused into fc1's wgrad instead: the same math, unfused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/norm.h"
#include "layers/parameter.h"

namespace stepgraph {

struct LayerNormMLPConfig {
  std::int64_t hidden = 0;
  std::int64_t ffn = 0;
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
};

class LayerNormMLP {
 public:
  struct FwdArgs {
    Tensor x;  // [tokens, hidden]
  };
  struct Saved {
    Norm::Saved norm;
    Tensor normed;  // fc1's input
    Tensor pre;     // fc1's output before GeLU (the epilogue's aux)
    Tensor act;     // GeLU(pre): fc2's input
  };
  struct Forward {
    Tensor y;  // [tokens, hidden]
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;
  };

  LayerNormMLP(Context& ctx, const std::string& name, const LayerNormMLPConfig& config, std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;  // dx; writes every grad

  const LayerNormMLPConfig& config() const { return config_; }
  std::vector<Parameter*> parameters();

 private:
  bool fused_gelu() const { return config_.dtype != DType::kFloat32; }

  std::string label_;  // "LayerNormMLP 'name'", for argument errors
  LayerNormMLPConfig config_;
  Norm norm_;
  Parameter w1_;  // [ffn, hidden]
  Parameter b1_;  // [ffn]
  Parameter w2_;  // [hidden, ffn]
  Parameter b2_;  // [hidden]
};

}  // namespace stepgraph
