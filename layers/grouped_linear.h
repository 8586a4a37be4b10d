// GroupedLinear: E experts' linear layers over token rows grouped by expert,
// y_e = x_e W_e^T (+ b_e), with the split sizes a device tensor that is never
// read on the host, so the layer is capturable whatever the routing does
// (TransformerEngine's GroupedLinear reads the splits on the host instead).
//
// forward takes x [T, in] (rows grouped by expert: expert 0's rows first) and
// splits int32 [E] on the device; the split_offsets op turns the splits into
// offsets and validates them on the device: negative sizes or a sum other than
// T set this layer's error word and are clamped so every kernel stays in
// bounds. Call check_splits() after a step (outside any captured graph): it
// reads the word once and raises. See Note [Routing error word] in
// kernels/moe_routing.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/context.h"
#include "layers/parameter.h"

namespace stepgraph {

struct GroupedLinearConfig {
  std::int64_t experts = 0;
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  bool bias = true;
  DType dtype = DType::kBFloat16;  // bf16 (tensor cores), or fp32
};

class GroupedLinear {
 public:
  struct FwdArgs {
    Tensor x;       // [T, in_features], the config's dtype, grouped by expert
    Tensor splits;  // int32 [experts] on the device: rows per expert, summing to T
  };
  struct Saved {
    Tensor x;        // the caller's input (a reference)
    Tensor offsets;  // int32 [experts + 1], validated and clamped
  };
  struct Forward {
    Tensor y;  // [T, out_features]
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // [T, out_features]
  };

  GroupedLinear(Context& ctx, const std::string& name, const GroupedLinearConfig& config, std::uint32_t seed);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // Writes the weight (and bias) gradients; returns dx [T, in_features].
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  // Error if a split seen since the last check was negative or the splits did
  // not add up to the tokens. Reads the device word once and clears it: call
  // it after a step, never inside one.
  void check_splits(Context& ctx) const;

  const GroupedLinearConfig& config() const { return config_; }
  const std::string& name() const { return name_; }
  std::vector<Parameter*> parameters();

 private:
  std::string name_;
  GroupedLinearConfig config_;
  Parameter weight_;  // [experts, out, in]
  Parameter bias_;    // [experts, out], absent without bias
  Tensor error_word_;
};

// Reads a routing error word (int32 [1]) once; when it is set, clears it and
// raises an Error naming `what` and the problems its bits record.
void check_routing_error_word(Context& ctx, const Tensor& word, const std::string& what);

}  // namespace stepgraph
