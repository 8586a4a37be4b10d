// Linear: y = x W^T (+ b), on cuBLASLt with the bias (and an activation)
// fused into the GEMMs' epilogues.
//
// Forward takes FwdArgs and returns the output with a Saved struct: what the
// backward needs, with every flag resolved at forward time into a plain
// value. The saved input is the caller's tensor itself (a reference, never a
// copy). Backward writes the parameter gradients (fp32 main grads) when
// wgrad is on and returns dx when dgrad is on. The modes are values of
// LinearConfig, each with its Note below: epilogues, tensor parallelism, FP8.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "kernels/fp8_block_scales.h"
#include "layers/activation.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/fp8_operand.h"
#include "layers/parameter.h"

namespace stepgraph {

// Note [Column- and row-parallel Linear]
// With a tensor-parallel communicator of N ranks (Megatron's tensor
// parallelism), rank r holds a slice of the [out, in] weight one rank would
// draw from the same seed (ParameterInit::row_blocks_from / columns_from), chosen
// by LinearConfig::tensor_parallel:
//
//   kColumn: rows [r out/N, (r+1) out/N) of W and the same slice of b
//     (with LinearConfig::out_blocks, that slice of each row block).
//     forward   x [T, in] (replicated) -> y [T, out/N]
//     backward  dy [T, out/N] -> dx = dy W_r, partial over out: all-reduced
//               to [T, in]; W_r and b_r gradients local.
//   kRow: columns [r in/N, (r+1) in/N) of W; b [out] whole on every rank.
//     forward   x [T, in/N] -> x W_r^T, a partial sum over in: all-reduced to
//               y [T, out]. Only rank 0's GEMM adds b (its epilogue), so the
//               sum holds it once.
//     backward  dy [T, out] (replicated) -> dx = dy W_r [T, in/N], local; W_r's
//               gradient local; b's from the whole dy, the same on every rank.
//
// With LinearConfig::sequence_parallel (Megatron's sequence parallelism)
// the tokens outside the tensor-parallel region are sharded instead of
// replicated: a column-parallel layer takes x [T/N, in], all-gathers it to
// [T, in] before its GEMM (and saves the gathered input for its weight
// gradient) and reduce-scatters dx back to [T/N, in] instead of
// all-reducing it; a row-parallel layer reduce-scatters its partial sums to
// y [T/N, out] instead of all-reducing them, and all-gathers dy to [T, out]
// first in the backward. Rank r's token shard is rows [r T/N, (r+1) T/N).
//
// A column-parallel layer followed by a row-parallel one (fc1, fc2 of an MLP;
// the attention projections) needs no collective between them: the column
// layer's [T, out/N] output is the row layer's [T, in/N] input. The
// collectives are ops (Note [Collectives are ops]) on the context's
// communication stream; weight gradients stay on the weight-gradient stream
// (WeightGradScope). N ranks compute what one rank computes, up to the fp32
// order of the additions that the reductions split across ranks. Without a
// communicator the layer is the plain one, op for op.

// How a Linear is split across a tensor-parallel group (Note [Column- and
// row-parallel Linear]).
enum class TensorParallelMode : std::uint8_t { kNone, kColumn, kRow };
std::string_view tensor_parallel_mode_name(TensorParallelMode mode);  // "none", "column", "row"

// Note [Linear epilogues]
// What runs around a Linear's GEMMs besides the product is a value of its
// config, so a layer built from Linears gets the fusions a hand-written
// block has:
//   bias              the forward GEMM adds b (cuBLASLt BIAS); the weight
//                     gradient sums dy over the tokens into b's gradient
//                     in the same GEMM (BGRADB).
//   activation gelu   y = GeLU(x W^T + b), and Forward::pre keeps x W^T + b,
//                     in the layer's dtype, for the backward of the Linear
//                     after (GELU_AUX_BIAS).
//   input_activation gelu
//                     the input was GeLU(pre), pre the Linear before's
//                     Forward::pre (BwdArgs::input_pre). The backward returns
//                     the gradient of pre, (dy W) * GeLU'(pre), with the
//                     Linear before's bias gradient from the same GEMM
//                     (DGELU_BGRAD, Backward::input_bias_grad, in the layer's
//                     dtype); that Linear's backward takes it as
//                     BwdArgs::bias_grad instead of summing its dy again.
//                     This data gradient is issued before the weight
//                     gradient: the Linear before goes on from it.
// Where cuBLASLt has no such epilogue (fp32 layers, FP8 GEMMs, no bias) the
// activation and its derivative run as ops of their own after the GEMM: the
// same math, unfused. A row-parallel Linear's output is a partial sum until
// its collective, and so is a column-parallel one's dx: the activation is
// refused on kRow, the input activation on kColumn. With input_activation,
// a Saved::x left undefined is made again from input_pre on the
// weight-gradient stream, right before the weight gradient reads it (Note
// [Recomputed activation] in layers/layernorm_mlp.h). GroupedLinear takes
// the same two fields, with GeLU and its derivative as ops (its grouped
// products have no epilogues).

// A row block of a column-parallel Linear's weight (LinearConfig::out_blocks).
struct LinearOutBlock {
  std::int64_t rows = 0;
  // How many consecutive ranks hold the same rows: 1 splits the block over
  // the N ranks; c (dividing N) splits it into N / c parts, rank r holding
  // part r / c. The copies' gradients are each rank's own: making them equal
  // (summing them over the ranks that share them) is the owner's (Note
  // [Tensor-parallel attention]).
  std::int64_t copies = 1;
};

struct LinearConfig {
  std::int64_t in_features = 0;   // the whole layer's, also when tensor-parallel
  std::int64_t out_features = 0;  // the whole layer's, also when tensor-parallel
  bool bias = true;
  DType dtype = DType::kBFloat16;
  bool dgrad = true;  // compute dx in backward
  bool wgrad = true;  // compute parameter gradients in backward
  // kColumn or kRow need a communicator at construction; kNone needs none.
  TensorParallelMode tensor_parallel = TensorParallelMode::kNone;
  // kColumn only: out_features is these row blocks of W end to end (their
  // rows sum to it), each split over the ranks on its own, so rank r holds
  // rows [r b/N, (r+1) b/N) of every block b (of a block with copies, its
  // part r / copies: LinearOutBlock), in block order (a fused QKV weight's
  // query, key and value heads: Note [Tensor-parallel attention] in
  // layers/multihead_attention.h). Empty: one block, the contiguous slice.
  std::vector<LinearOutBlock> out_blocks;
  bool sequence_parallel = false;  // token-sharded outside the layer; kColumn or kRow only
  // Tensor-parallel only: how the forward's and the data gradient's
  // collectives meet their GEMMs (Note [Communication-GEMM overlap]). With
  // sequence parallelism kColumn's forward all-gathers x (ring_exchange
  // fits) and its dgrad reduce-scatters dx (pipelined fits); kRow's forward
  // reduce-scatters y (pipelined) and its dgrad all-gathers dy
  // (ring_exchange). Without it the collectives are all-reduces: none or bulk.
  CommOverlap fprop_overlap = CommOverlap::kBulk;
  CommOverlap dgrad_overlap = CommOverlap::kBulk;
  // FP8 GEMMs (Note [FP8 Linear]); nullopt runs the 16-bit GEMMs.
  std::optional<Fp8Recipe> fp8;
  // Epilogues beyond the bias (Note [Linear epilogues]).
  LinearActivation activation = LinearActivation::kNone;        // forward: y = activation(x W^T + b)
  LinearActivation input_activation = LinearActivation::kNone;  // backward: dx is the gradient of the input's pre
};

// Note [FP8 Linear]
// With LinearConfig::fp8 the three products run as FP8 GEMMs (Note [FP8
// GEMMs] in kernels/gemm.h), each in the TN form Hopper needs:
//   forward  y  = x W^T     x row-wise [T, in] (E4M3), W row-wise [out, in] (E4M3)
//   dgrad    dx = dy W      dy row-wise [T, out], W's column-wise copy [in, out]
//   wgrad    dW = dy^T x    dy's column-wise copy [out, T], x's column-wise copy [in, T]
// Gradients are E5M2 with the hybrid formats, E4M3 otherwise. Scales are
// current (amax, then scale, then quantize, all inside the step); the
// forward keeps the transposed FP8 copies the backward reads, one byte an
// element, and not its 16-bit input (Saved::x stays undefined), so the
// caller's input can be freed after the forward. W's transposed copy is not
// kept: the data gradient quantizes it again from W (unchanged until the
// optimizer runs) with the forward's scale (current: saved; delayed: the
// state's, not updated before the backward's GEMMs; block: recomputed, the
// same), so the saved bytes are those of the activations alone. The bias
// rides the forward GEMM's epilogue; its gradient is a column sum of the
// 16-bit dy. Delayed scaling keeps an amax history and a
// scale per tensor (x, W, dy) in persistent memory: a step quantizes with
// the scales the earlier steps left, and the end of its backward rolls this
// step's amaxes in and updates the scales (after every GEMM that read them:
// the planner orders the writes after the reads), so nothing runs between
// replays. Block scaling (Fp8Recipe::block(): DeepSeek-V3's recipe) gives x
// and dy a scale per 1 x 128 block and W one per 128 x 128 tile, each copy
// with its own block scales in the layout its GEMM reads; tokens and
// features must then be multiples of 128. Token counts and features are
// multiples of 16 otherwise; each other case is an Error naming it. The
// weight is quantized in every forward, on the weight-gradient stream (idle
// in the forward), unless Fp8Recipe::cache_weights keeps its copies from one
// optimizer step to the next (Note [FP8 weight cache] in
// layers/fp8_operand.h).
//
// Tensor-parallel FP8 (Note [Column- and row-parallel Linear]) keeps
// the 16-bit layer's collectives, on 16-bit tensors: a
// sequence-parallel column layer gathers x before quantizing it, a
// sequence-parallel row layer gathers dy the same way, and partial sums
// (the row layer's y, the column layer's dx) leave the FP8 GEMMs in 16 bits
// before they are added. Where a quantized tensor is a slice (W always, x of
// a row layer, dy of a column layer) its amax is max-all-reduced over the
// tensor-parallel group (current scaling before the scale, delayed before
// the history), so each rank quantizes its slice with the scale one rank
// gives the whole tensor and N ranks compute what one computes, up to the
// fp32 order of the partial sums. Block scales are local to their blocks and
// need nothing. The collectives run none or bulk: an FP8 GEMM quantizes its
// whole operand first, so there is no shard-by-shard GEMM for ring_exchange
// or pipelined to overlap (an Error).
class Linear;
// The FP8 state (Linear::state) of `linears`, in their order.
std::vector<StateTensor> state_of(const std::vector<Linear*>& linears);

// Error (kInvalidArgument) when `count` non-finite amaxes were met and the
// recipe's on_non_finite is stop, naming `where`.
void check_non_finite_amaxes(std::int64_t count, const Fp8Recipe& recipe, std::string_view where);

// Note [Fused FP8 operands]
// The kernel that makes a Linear's input (the norm before fc1, GeLU before
// fc2) or its output gradient (GeLU's backward before fc1's) can write the
// FP8 copies the Linear's GEMMs read in the same pass (ops/fp8_fused_ops.h)
// instead of a 16-bit tensor the Linear reads again to quantize. The maker
// asks the Linear for the scale (input_scale, gradient_scale: delayed
// scaling's state, or current scaling's scale from the maker's own amax
// pass), quantizes with it and hands the copies over (forward_quantized,
// backward_quantized). Its bytes are those the Linear's own quantize would
// write, so the results equal forward's and backward's bit for bit. Tensor-
// wise scaling without tensor parallelism, in bf16 or fp16 layers only
// (takes_quantized_operands): block scales and the gathers of sequence
// parallelism need the 16-bit tensor, and the fused kernels read 16 bits.
// Whether a Linear of `config` takes them, `tensor_parallel` when it has a
// communicator (Linear::takes_quantized_operands of a built one).
bool takes_quantized_operands(const LinearConfig& config, bool tensor_parallel);

class Linear {
 public:
  struct FwdArgs {
    Tensor x;  // [tokens, in_features] (kRow: [tokens, in / N]; kColumn with SP: [tokens / N, in])
  };
  struct Saved {
    Tensor x;  // the caller's input (a reference); kColumn with SP: the all-gathered input; FP8: undefined
    bool dgrad = true;
    bool wgrad = true;
    // FP8: x's transposed copy the weight gradient reads, with its scale_inv.
    Tensor x_fp8_t;  // [in, tokens], when wgrad
    Tensor x_scale_inv;
    // FP8 with current scaling: the scale the forward quantized W with; the
    // data gradient quantizes W's transposed copy again with it (the same
    // bytes the forward would have kept: Note [FP8 Linear]).
    Tensor w_scale;
    Tensor w_scale_inv;
    // Delayed scaling: this step's amax of x and of W, rolled into their
    // histories at the end of the backward.
    Tensor x_amax;
    Tensor w_amax;
  };
  struct Forward {
    Tensor y;    // [tokens, out_features] (kColumn: [tokens, out / N]; kRow with SP: [tokens / N, out])
    Tensor pre;  // with an activation: y before it (Note [Linear epilogues]); else undefined
    Saved saved;
  };
  struct BwdArgs {
    Tensor dy;  // the forward's output's shape
    // config.input_activation: the pre-activation the input was made from,
    // the input's shape (the Linear before's Forward::pre).
    Tensor input_pre;
    // Optional: this Linear's bias gradient, [local out] in the layer's
    // dtype, made by the epilogue of the Linear after (its
    // Backward::input_bias_grad); the weight gradient then does not sum dy.
    Tensor bias_grad;
  };
  struct Backward {
    Tensor dx;  // undefined when dgrad is off; config.input_activation: the gradient of input_pre
    // config.input_activation fused into the data gradient's epilogue: the
    // Linear before's bias gradient (for its BwdArgs::bias_grad); else undefined.
    Tensor input_bias_grad;
  };

  // An operand quantized by its maker (Note [Fused FP8 operands]).
  struct QuantizedOperand {
    Tensor rowwise;     // [tokens, features] in the recipe's format
    Tensor columnwise;  // [features, tokens]: x when wgrad is on; dy when wgrad is on
    Tensor amax;        // [1] fp32, max |t| (delayed scaling's history takes it)
    Tensor value;       // dy only, with a bias: the 16-bit gradient its column sum reads
  };
  struct OperandScale {
    Tensor scale;       // [1] fp32: quantize with it
    Tensor scale_inv;   // [1] fp32: the GEMMs read it
    Tensor non_finite;  // current scaling: [1] int32, set when the amax was not finite
  };

  // `tensor_parallel`: the group the layer is split across (Note [Column- and
  // row-parallel Linear]); null is the plain layer.
  Linear(Context& ctx, const std::string& name, const LinearConfig& config, std::uint32_t seed,
         Communicator* tensor_parallel = nullptr);

  Forward forward(Context& ctx, const FwdArgs& args) const;
  // dx, or an undefined tensor when dgrad is off.
  Tensor backward(Context& ctx, const Saved& saved, const BwdArgs& args) const;
  // backward's dx with what its epilogue made for the Linear before (Note [Linear epilogues]).
  Backward backward_fused(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  // Note [Fused FP8 operands]. `amax`: current scaling's max |x| (or |dy|)
  // from the maker's amax pass; delayed scaling ignores it (may be undefined).
  bool takes_quantized_operands() const;
  OperandScale input_scale(Context& ctx, const Tensor& amax) const;
  OperandScale gradient_scale(Context& ctx, const Tensor& amax) const;
  Forward forward_quantized(Context& ctx, const QuantizedOperand& x, const OperandScale& scale) const;
  Tensor backward_quantized(Context& ctx, const Saved& saved, const QuantizedOperand& dy,
                            const OperandScale& scale) const;

  const LinearConfig& config() const { return config_; }
  Communicator* tensor_parallel() const { return tp_; }
  // This rank's part of the weight: [local_out_features, local_in_features].
  std::int64_t local_in_features() const;
  std::int64_t local_out_features() const;
  std::vector<Parameter*> parameters();
  // FP8 delayed scaling's histories and scales of x, W and dy; empty otherwise.
  std::vector<StateTensor> state() const;
  // FP8: how many quantizations met a non-finite amax, counted on the device
  // over every step (the scale stays, Note [FP8 scaling]); reading it
  // synchronizes. check_errors throws when there were some and the recipe
  // says stop. A model shares one counter among its layers (one read a step).
  std::int64_t non_finite_amaxes(Context& ctx) const;
  void check_errors(Context& ctx) const;
  void share_non_finite_counter(const Tensor& counter);
  // FP8 delayed scaling under data parallelism: this step's amaxes of x and
  // dy are max-all-reduced over `group` inside the step before they enter
  // the histories, so every rank keeps the same scales (W's amax is the same
  // on every rank already). Null: this rank's own amaxes.
  void set_amax_group(Communicator* group) { amax_group_ = group; }
  const Parameter& weight() const { return weight_; }

 private:
  int ranks() const { return tp_ != nullptr ? tp_->world_size() : 1; }
  // An Error unless `mode` fits the collective of `field` (`chunked`: the
  // chunked mode that fits it under sequence parallelism).
  void check_overlap(std::string_view field, CommOverlap mode, CommOverlap chunked) const;
  bool column() const { return config_.tensor_parallel == TensorParallelMode::kColumn; }
  bool row() const { return config_.tensor_parallel == TensorParallelMode::kRow; }
  bool sequence_parallel() const { return config_.sequence_parallel; }
  // The GEMMs' dtype has cuBLASLt's GeLU epilogues (16-bit, not FP8).
  bool fuses_gelu() const;
  Forward forward_fp8(Context& ctx, const FwdArgs& args) const;
  // The FP8 GEMMs once x [tokens, in] (or dy, with its 16-bit value for the
  // bias gradient) is quantized, by the Linear or by its maker.
  Forward forward_fp8_from(Context& ctx, const detail::Fp8Copies& x) const;
  Tensor backward_fp8_from(Context& ctx, const Saved& saved, const detail::Fp8Copies& dy, const Tensor& dy_value,
                           std::int64_t tokens) const;
  // FP8 tensor parallelism (Note [FP8 Linear]): every rank's token shards of
  // `shard` gathered; the ranks' partial sums added (all-reduce, or
  // reduce-scatter to token shards under sequence parallelism); the group
  // whose amaxes a tensor's scale takes the largest of (null: not sliced).
  Tensor gather_tokens(Context& ctx, const Tensor& shard, CommOverlap mode) const;
  Tensor sum_partials(Context& ctx, const Tensor& partial, CommOverlap mode) const;
  Communicator* slices_of(bool sharded) const;
  Tensor backward_fp8(Context& ctx, const Saved& saved, const BwdArgs& args) const;

  std::string label_;  // "Linear 'name'", for argument errors
  LinearConfig config_;
  Communicator* tp_ = nullptr;
  Parameter weight_;  // [out, in] (this rank's slice when tensor-parallel)
  Parameter bias_;    // [out] (kColumn: this rank's [out / N]), absent without bias
  // Delayed scaling's state of x, W and dy: persistent, updated inside the step.
  using DelayedState = detail::DelayedState;
  DelayedState x_state_, w_state_, dy_state_;
  // Fp8Recipe::cache_weights: W's copies, remade after each update (Note [FP8 weight cache]).
  std::optional<detail::Fp8WeightCache> w_cache_;
  std::function<void(Context&)> weight_cache_hook() const;  // for weight_.after_update
  // The scale an operand with `state` is quantized with (Note [Fused FP8 operands]).
  OperandScale operand_scale(Context& ctx, const Tensor& amax, const DelayedState& state, Fp8Format format) const;
  std::vector<StateTensor> state_;  // the three above by name
  Tensor non_finite_;               // FP8: [1] int32, see non_finite_amaxes
  Communicator* amax_group_ = nullptr;  // FP8 delayed: see set_amax_group
};

}  // namespace stepgraph
