// LayerNorm and RMSNorm layers (one class, the kind chosen in the config):
// y = norm(x) * gamma (+ beta). Parameter gradients are fp32 main grads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "kernels/norm.h"
#include "layers/parameter.h"

namespace stepgraph {

struct NormConfig {
  kernels::NormKind kind = kernels::NormKind::kLayerNorm;
  std::int64_t hidden = 0;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;
};

class Norm {
 public:
  struct FwdArgs {
    Tensor x;  // [..., hidden]
  };
  struct Saved {
    Tensor x;     // the caller's input (a reference)
    Tensor mean;  // undefined for RMSNorm
    Tensor rstd;
  };
  struct Forward {
    Tensor y;
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;
  };

  Norm(Context& ctx, const std::string& name, const NormConfig& config);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;  // dx; writes the grads

  const NormConfig& config() const { return config_; }
  std::vector<Parameter*> parameters();
  // The gradients backward writes (gamma's, and beta's for LayerNorm).
  std::vector<Tensor> gradients() const;

 private:
  bool layernorm() const { return config_.kind == kernels::NormKind::kLayerNorm; }

  std::string label_;  // "Norm 'name'", for argument errors
  NormConfig config_;
  Parameter gamma_;
  Parameter beta_;  // LayerNorm only
};

}  // namespace stepgraph
