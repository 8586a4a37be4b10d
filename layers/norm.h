// LayerNorm and RMSNorm layers (one class, the kind chosen in the config):
// y = norm(x) * gamma (+ beta). Parameter gradients are fp32 main grads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "kernels/norm.h"
#include "layers/parameter.h"
#include "ops/fp8_fused_ops.h"

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
    // Optional, x's shape: added to dx in the norm's own pass (the residual
    // stream's gradient, so no separate add follows).
    Tensor dx_residual;
  };

  Norm(Context& ctx, const std::string& name, const NormConfig& config);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // The norm of x [tokens, hidden] writing its output's FP8 copies (and amax)
  // in the same pass, the 16-bit y only with params.keep_16bit
  // (ops::norm_fp8; Note [Fused FP8 operands] in layers/linear.h). The
  // backward is backward's, from the same Saved.
  struct Fp8Forward {
    ops::FusedFp8 out;
    Saved saved;
  };
  Fp8Forward forward_fp8(Context& ctx, const Tensor& x, const Tensor& scale, const ops::FusedFp8Params& params) const;
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
