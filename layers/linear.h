// Linear: y = x W^T (+ b), on cuBLASLt with the bias fused into the epilogue.
//
// Forward takes FwdArgs and returns the output with a Saved struct: what the
// backward needs, with every flag resolved at forward time into a plain
// value. The saved input is the caller's tensor itself (a reference, never a
// copy). Backward writes the parameter gradients (fp32 main grads) when
// wgrad is on and returns dx when dgrad is on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/parameter.h"

namespace stepgraph {

struct LinearConfig {
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  bool bias = true;
  DType dtype = DType::kBFloat16;
  bool dgrad = true;  // compute dx in backward
  bool wgrad = true;  // compute parameter gradients in backward
};

class Linear {
 public:
  struct FwdArgs {
    Tensor x;  // [tokens, in_features], the config's dtype
  };
  struct Saved {
    Tensor x;  // the caller's input (a reference)
    bool dgrad = true;
    bool wgrad = true;
  };
  struct Forward {
    Tensor y;  // [tokens, out_features]
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // [tokens, out_features]
  };

  Linear(Context& ctx, const std::string& name, const LinearConfig& config, std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // dx, or an undefined tensor when dgrad is off.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  const LinearConfig& config() const { return config_; }
  std::vector<Parameter*> parameters();
  const Parameter& weight() const { return weight_; }

 private:
  std::string label_;  // "Linear 'name'", for argument errors
  LinearConfig config_;
  Parameter weight_;  // [out, in]
  Parameter bias_;    // [out], absent without bias
};

}  // namespace stepgraph
