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
//
// Tensor parallelism (with a communicator of N ranks; See Note
// [Tensor-parallel MoE] in layers/moe_mlp.h): kColumn holds out_features / N
// rows of every expert's weight and bias (rank r's rows [r out/N, (r+1) out/N)),
// kRow holds in_features / N columns of every expert's weight and the whole
// bias, which only rank 0 adds, so the ranks' partial outputs sum to the one-
// rank layer's output with the bias once. The layer itself moves no bytes:
// a kRow output is a partial sum the caller reduces, a kColumn input is the
// caller's gathered tokens. The config keeps the whole layer's sizes; each
// rank's slices are the slices of the weights one rank draws from the seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "layers/parameter.h"

namespace stepgraph {

// How a GroupedLinear splits over tensor-parallel ranks (ignored without a
// communicator, where the layer is whole).
enum class GroupedParallel : std::uint8_t {
  kNone,    // no communicator allowed
  kColumn,  // out_features sharded: each rank's output columns are whole
  kRow,     // in_features sharded: each rank's output is a partial sum
};

struct GroupedLinearConfig {
  std::int64_t experts = 0;
  std::int64_t in_features = 0;   // the whole layer's, also when sharded
  std::int64_t out_features = 0;  // the whole layer's, also when sharded
  bool bias = true;
  DType dtype = DType::kBFloat16;  // bf16 (tensor cores), or fp32
  GroupedParallel parallel = GroupedParallel::kNone;
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

  // `tensor_parallel`: a communicator of N ranks shards the layer as
  // config.parallel says (kColumn or kRow); null is the whole layer.
  GroupedLinear(Context& ctx, const std::string& name, const GroupedLinearConfig& config, std::uint32_t seed,
                Communicator* tensor_parallel = nullptr);

  // x is [T, local_in()]; y is [T, local_out()] (a partial sum for kRow).
  Forward forward(Context& ctx, const FwdArgs& args) const;
  // Writes the weight (and bias) gradients; returns dx [T, in_features].
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  // Error if a split seen since the last check was negative or the splits did
  // not add up to the tokens. Reads the device word once and clears it: call
  // it after a step, never inside one.
  void check_splits(Context& ctx) const;

  const GroupedLinearConfig& config() const { return config_; }
  const std::string& name() const { return name_; }
  // This rank's features: the config's, divided by the ranks on the sharded side.
  std::int64_t local_in() const;
  std::int64_t local_out() const;
  std::vector<Parameter*> parameters();

 private:
  std::string name_;
  GroupedLinearConfig config_;
  int ranks_ = 1;  // tensor-parallel ranks (1 without a communicator)
  int rank_ = 0;
  Parameter weight_;  // [experts, local_out, local_in]
  Parameter bias_;    // [experts, local_out], absent without bias
  Tensor error_word_;
};

// Reads a routing error word (int32 [1]) once; when it is set, clears it and
// raises an Error naming `what` and the problems its bits record.
void check_routing_error_word(Context& ctx, const Tensor& word, const std::string& what);

}  // namespace stepgraph
