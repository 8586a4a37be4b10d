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
//
// Expert parallelism (See Note [Expert-parallel MoE] in layers/moe_mlp.h):
// config.held_experts whole experts from config.first_expert on, each
// initialised as the layer of all config.experts draws it, with one split per
// held expert; config.split_sum = kAtMostRows lets the splits cover fewer rows
// than x has (a receive buffer sized by its bound): the rows past their sum
// are in no group, so y (and pre) and the products' dx are zero there and no
// weight or bias gradient reads them, whatever x and dy hold there (with
// input_activation, dx there is GeLU's derivative at input_pre times zero).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "kernels/moe_routing.h"
#include "layers/activation.h"
#include "layers/fp8_operand.h"
#include "layers/parameter.h"

namespace stepgraph {

// How a GroupedLinear splits over tensor-parallel ranks (ignored without a
// communicator, where the layer is whole).
enum class GroupedParallel : std::uint8_t {
  kNone,    // no communicator allowed
  kColumn,  // out_features sharded: each rank's output columns are whole
  kRow,     // in_features sharded: each rank's output is a partial sum
};

// Note [FP8 GroupedLinear]
// With GroupedLinearConfig::fp8 (current or delayed scaling, bf16 layers)
// the three grouped products run on FP8 operands (Note [FP8 grouped GEMM] in
// kernels/grouped_gemm_ws.cu), as an FP8 Linear's do (Note [FP8 Linear] in
// linear.h): x in E4M3 row-wise for the forward and column-wise [in, T] for
// the weight gradient (kept instead of the 16-bit x); dy in the gradient
// format, row-wise for dgrad and column-wise [out, T] for wgrad; W [E, out,
// in] as the matrix [E * out, in], row-wise in the forward (quantized on the
// weight-gradient stream) and column-wise [in, E * out] for dgrad, quantized
// again in the backward with the forward's scale. One tensor-wise scale per
// tensor: the whole stacked weight shares one (its amax is the largest over
// every expert), so does every token's activation. Delayed scaling keeps an
// amax history per tensor and updates it at the end of the backward; a
// sliced tensor's amax (W always, x of kRow, dy of kColumn) is max-all-
// reduced over the tensor-parallel group first. The recipe's fast-
// accumulation fields choose each product's accumulation as for cuBLASLt
// (the forward fast, the backward split by default). Block scaling is not built
// for grouped products (an Error): the kernel applies tensor-wise scales in
// its epilogue, while 128-blocks along the reduction need each block's
// partial sums scaled in the main loop. Token counts, in and out features
// must be multiples of 16.
struct GroupedLinearConfig {
  std::int64_t experts = 0;
  std::int64_t in_features = 0;   // the whole layer's, also when sharded
  std::int64_t out_features = 0;  // the whole layer's, also when sharded
  bool bias = true;
  DType dtype = DType::kBFloat16;  // bf16 (tensor cores), or fp32
  GroupedParallel parallel = GroupedParallel::kNone;
  // FP8 products (Note [FP8 GroupedLinear]); nullopt runs the 16-bit ones.
  std::optional<Fp8Recipe> fp8;
  // As a Linear's (Note [Linear epilogues] in layers/linear.h), as ops after
  // the grouped products: y = activation(x W_e^T + b_e) keeping Forward::pre;
  // dx the gradient of the pre-activation the input was made from
  // (BwdArgs::input_pre), and a saved x left undefined made again from it
  // before the backward's products.
  LinearActivation activation = LinearActivation::kNone;
  LinearActivation input_activation = LinearActivation::kNone;
  // Expert parallelism: this layer holds experts [first_expert, first_expert
  // + held_experts) of the `experts`, whole; 0 holds them all.
  std::int64_t first_expert = 0;
  std::int64_t held_experts = 0;
  // What the splits add up to: x's rows, or at most them (rows past the sum
  // are padding, left out of every product). A plain value: it enters the
  // split_offsets op's params, so graph keys see it.
  kernels::SplitSum split_sum = kernels::SplitSum::kEqualsRows;
};

class GroupedLinear {
 public:
  struct FwdArgs {
    Tensor x;       // [T, in_features], the config's dtype, grouped by expert
    Tensor splits;  // int32 [local_experts()] on the device: rows per expert, summing to T (at most T: split_sum)
  };
  struct Saved {
    Tensor x;        // the caller's input (a reference); FP8: undefined
    Tensor offsets;  // int32 [experts + 1], validated and clamped
    // FP8 (Note [FP8 GroupedLinear]): x's column-wise copy [in, T] with its
    // scale_inv; W's scale (current scaling: the data gradient quantizes W's
    // column-wise copy again with it); this step's amaxes of x and W
    // (delayed scaling's histories take them at the end of the backward).
    Tensor x_fp8_t;
    Tensor x_scale_inv;
    Tensor w_scale;
    Tensor w_scale_inv;
    Tensor x_amax;
    Tensor w_amax;
  };
  struct Forward {
    Tensor y;    // [T, out_features]
    Tensor pre;  // with an activation: y before it; else undefined
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // [T, out_features]
    // config.input_activation: the pre-activation the input was made from, the input's shape.
    Tensor input_pre;
  };

  // `tensor_parallel`: a communicator of N ranks shards the layer as
  // config.parallel says (kColumn or kRow); null is the whole layer.
  GroupedLinear(Context& ctx, const std::string& name, const GroupedLinearConfig& config, std::uint32_t seed,
                Communicator* tensor_parallel = nullptr);

  // x is [T, local_in()]; y is [T, local_out()] (a partial sum for kRow).
  Forward forward(Context& ctx, const FwdArgs& args) const;
  // Writes the weight (and bias) gradients; returns dx [T, in_features]
  // (config.input_activation: the gradient of input_pre).
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  // Error if a split seen since the last check was negative or the splits did
  // not add up to the tokens (exceeded them, with kAtMostRows). Reads the device word once and clears it: call
  // it after a step, never inside one.
  void check_splits(Context& ctx) const;

  const GroupedLinearConfig& config() const { return config_; }
  const std::string& name() const { return name_; }
  // This rank's features: the config's, divided by the ranks on the sharded side.
  std::int64_t local_in() const;
  std::int64_t local_out() const;
  // The experts this layer holds: held_experts, or all of them.
  std::int64_t local_experts() const;
  std::vector<Parameter*> parameters();
  // FP8 delayed scaling's histories and scales of x, W and dy; empty otherwise.
  std::vector<StateTensor> state() const { return state_; }
  // FP8: quantizations that met a non-finite amax, counted on the device (as
  // Linear::non_finite_amaxes); a model may share one counter among layers.
  std::int64_t non_finite_amaxes(Context& ctx) const;
  void share_non_finite_counter(const Tensor& counter);
  // FP8 delayed scaling under data parallelism: x's and dy's amaxes are
  // max-all-reduced over `group` before their histories (Linear::set_amax_group).
  void set_amax_group(Communicator* group) { amax_group_ = group; }

 private:
  Forward forward_fp8(Context& ctx, const Tensor& x, const Tensor& offsets, const Tensor& bias) const;
  Tensor backward_fp8(Context& ctx, const Saved& saved, const Tensor& dy) const;
  Tensor backward_16bit(Context& ctx, const Saved& saved, const BwdArgs& args) const;
  // The tensor-parallel group when the tensor is a slice of the whole layer's.
  Communicator* slices_of(bool sharded) const { return sharded ? tp_ : nullptr; }

  std::string name_;
  std::string label_;
  GroupedLinearConfig config_;
  Communicator* tp_ = nullptr;
  int ranks_ = 1;  // tensor-parallel ranks (1 without a communicator)
  int rank_ = 0;
  Parameter weight_;  // [experts, local_out, local_in]
  Parameter bias_;    // [experts, local_out], absent without bias
  Tensor error_word_;
  detail::DelayedState x_state_, w_state_, dy_state_;  // FP8 delayed scaling
  std::optional<detail::Fp8WeightCache> w_cache_;       // Fp8Recipe::cache_weights (Note [FP8 weight cache])
  std::function<void(Context&)> weight_cache_hook() const;
  std::vector<StateTensor> state_;
  Tensor non_finite_;  // FP8: [1] int32
  Communicator* amax_group_ = nullptr;
};

// Reads a routing error word (int32 [1]) once; when it is set, clears it and
// raises an Error naming `what` and the problems its bits record.
void check_routing_error_word(Context& ctx, const Tensor& word, const std::string& what);

}  // namespace stepgraph
