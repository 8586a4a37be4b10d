// MoEMLP: a mixture-of-experts MLP without its residual, every step on the
// device (no host read anywhere, so the whole layer is capturable):
//
//   norm -> router (Linear hidden -> experts, no bias) -> top-k softmax gates
//        -> stable permutation by expert -> grouped fc1 (+bias) -> GeLU
//        -> grouped fc2 (+bias) -> unpermute, y[t] = sum_j gate[t,j] out[t,j]
//
// Dropless: every token reaches its k experts (no capacity). Gates: See Note
// [Router top-k and gates] in kernels/moe_routing.h (k = 2 renormalizes over
// the two chosen experts). The router's gradient flows through the gates; the
// expert choice itself has none. No auxiliary load-balancing loss.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/grouped_linear.h"
#include "layers/linear.h"
#include "layers/norm.h"
#include "layers/parameter.h"
#include "ops/moe_ops.h"

namespace stepgraph {

struct MoEMLPConfig {
  std::int64_t hidden = 0;
  std::int64_t ffn = 0;  // per expert
  std::int64_t experts = 0;
  int topk = 2;  // 1 or 2
  kernels::NormKind norm = kernels::NormKind::kLayerNorm;
  float eps = 1e-5f;
  DType dtype = DType::kBFloat16;  // bf16 or fp32
};

class MoEMLP {
 public:
  struct FwdArgs {
    Tensor x;  // [tokens, hidden]
  };
  struct Saved {
    Norm::Saved norm;
    Linear::Saved router;
    Tensor logits;             // [tokens, experts]
    ops::RouterResult routed;  // experts, gates [tokens, k]
    ops::MoEPlan plan;
    GroupedLinear::Saved fc1;  // its input: the permuted normed rows
    Tensor pre;                // fc1's output, before GeLU
    GroupedLinear::Saved fc2;  // its input: GeLU(pre)
    Tensor expert_out;         // fc2's output [tokens * k, hidden], expert order
  };
  struct Forward {
    Tensor y;  // [tokens, hidden]
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;
  };

  MoEMLP(Context& ctx, const std::string& name, const MoEMLPConfig& config, std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;  // dx; writes every grad

  // Error if the routing or the experts' splits went wrong in a step since the
  // last check (device error words, read once each: after a step, never inside one).
  void check_errors(Context& ctx) const;

  const MoEMLPConfig& config() const { return config_; }
  std::vector<Parameter*> parameters();

 private:
  std::string name_;
  MoEMLPConfig config_;
  Norm norm_;
  Linear router_;
  GroupedLinear fc1_;
  GroupedLinear fc2_;
  Tensor routing_error_;  // int32 [1], the plan's error word
};

}  // namespace stepgraph
