// LayerNorm and RMSNorm ops over the last dimension (kernels/norm.h). Leading
// dimensions are flattened into rows. Statistics and parameter gradients are
// fp32; the backward's reduction scratch is one more output.
#pragma once

#include <string>

#include "engine/context.h"
#include "engine/op.h"
#include "kernels/norm.h"

namespace stepgraph::ops {

struct NormParams {
  kernels::NormKind kind = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  // norm_backward_into_ only: one more input, dx_residual (x's shape and
  // dtype), added to dx in the same pass (a residual stream's gradient).
  bool dx_residual = false;

  bool operator==(const NormParams&) const = default;
  std::string to_string() const;
};

struct NormForward {
  Tensor y;
  Tensor mean;  // [rows] fp32; undefined for RMSNorm
  Tensor rstd;  // [rows] fp32
};

struct NormBackward {
  Tensor dx;
  Tensor dgamma;  // [hidden] fp32
  Tensor dbeta;   // [hidden] fp32; undefined for RMSNorm
};

// beta is ignored (may be undefined) for RMSNorm.
NormForward norm_forward(Context& ctx, const NormParams& params, const Tensor& x, const Tensor& gamma,
                         const Tensor& beta = {});
// mean is ignored (may be undefined) for RMSNorm.
NormBackward norm_backward(Context& ctx, const NormParams& params, const Tensor& dy, const Tensor& x,
                           const Tensor& mean, const Tensor& rstd, const Tensor& gamma);

// norm_backward writing dgamma and dbeta (fp32 [hidden], existing tensors:
// a layer's gradients; beta's ignored for RMSNorm) in place instead of new
// outputs, so no copy follows; returns dx.
// With dx_residual defined (x's shape and dtype), returns dx + dx_residual,
// rounded once: the residual add of the stream's gradient fused into the
// norm's backward (params.dx_residual is set from it).
Tensor norm_backward_into_(Context& ctx, const NormParams& params, const Tensor& dy, const Tensor& x, const Tensor& mean,
                          const Tensor& rstd, const Tensor& gamma, const Tensor& dgamma, const Tensor& dbeta = {},
                          const Tensor& dx_residual = {});

const OpDef& norm_forward_op();
const OpDef& norm_backward_op();
const OpDef& norm_backward_into_op();

}  // namespace stepgraph::ops
