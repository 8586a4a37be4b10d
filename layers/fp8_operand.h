// What FP8 layers (Linear, GroupedLinear) share: an operand quantized for
// their GEMMs with the scale_inv each copy is read with, and delayed
// scaling's persistent state of one tensor (Note [FP8 Linear] in linear.h,
// Note [FP8 scaling] in engine/fp8_recipe.h).
#pragma once

#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/fp8_recipe.h"
#include "kernels/fp8_block_scales.h"
#include "layers/parameter.h"

namespace stepgraph::detail {

// An FP8 operand as a layer's GEMMs read it, each copy with the scale_inv
// its GEMM must use: current scaling computes the scale in the step (amax,
// then scale, then quantize); delayed scaling quantizes with the state's
// scale, and the amax goes into its history at the end of the backward;
// block scaling gives each copy its own block scales (1 x 128 for
// activations and gradients, 128 x 128 for weights).
struct Fp8Copies {
  Tensor rowwise;  // [rows, cols]
  Tensor rowwise_scale_inv;
  Tensor columnwise;  // [cols, rows]
  Tensor columnwise_scale_inv;
  Tensor amax;   // tensor-wise scaling: max |t|
  Tensor scale;  // tensor-wise scaling: what t was quantized with
  std::optional<kernels::BlockShape> blocks;
  Tensor non_finite;  // [1] int32: current and block scaling met a non-finite amax (scale 1 then)
};

// Delayed scaling's state of one tensor: persistent, updated inside the step.
struct DelayedState {
  Tensor history;  // [amax_history_len] fp32
  Tensor scale;    // [1] fp32
  Tensor scale_inv;
};

// A tensor's state named `prefix`.{amax_history, scale, scale_inv}: an empty
// history and scale 1 until the first step's amax comes in. Appends the
// three to `named` (what checkpoints save).
DelayedState make_delayed_state(Context& ctx, const std::string& prefix, const Fp8Recipe& recipe,
                                std::vector<StateTensor>& named);

// `t` (rows of its last dimension) into the FP8 copies asked for, scaled as
// `recipe` says: block scaling with blocks of `shape`; delayed scaling with
// `delayed` (the state's scale); current scaling from t's amax, the largest
// over `amax_group` when t is a tensor-parallel slice (null: t is whole here).
Fp8Copies quantize_for_gemm(Context& ctx, const Fp8Recipe& recipe, const Tensor& t, Fp8Format format, bool rowwise,
                            bool columnwise, const DelayedState& delayed, kernels::BlockShape shape,
                            Communicator* amax_group);

// Note [FP8 weight cache]
// With Fp8Recipe::cache_weights a layer quantizes its weight once per
// optimizer step instead of in every forward (row-wise) and backward
// (column-wise): right after the optimizer updates the weight, inside the
// step (Parameter::after_update, run by AdamW on the weight-gradient stream
// beside the rest of the backward), into persistent row- and column-wise
// copies with their scale_inv and the weight's amax; the forward's and the
// data gradient's GEMMs read them. The copies are made with the scale the
// uncached layer would use at its next forward (current scaling: the new
// weight's amax; delayed: the state's scale, which the backward has already
// updated), so the cached layer computes what the uncached one does, bit for
// bit. They are remade at construction and whenever the value changes
// outside a step (sync_copy_from_master: checkpoint loads, the C API), so
// nothing reads a stale copy. A step that must not change the weights (the
// non-finite skip, Note [Non-finite steps] in optim/adamw.h) skips the
// refresh with the update. Cost: two bytes a weight element of persistent
// memory, against two FP8 copies made and freed in every step without it.
// Tensor-wise scaling only.
struct Fp8WeightCache {
  Tensor rowwise;     // [rows, cols] in the forward format
  Tensor columnwise;  // [cols, rows]
  Tensor scale_inv;   // [1] fp32: what both copies were quantized with, inverted
  Tensor amax;        // [1] fp32: the weight's max |w| at the refresh (delayed scaling's history takes it)
};

// Persistent tensors `prefix`.{rowwise, columnwise, scale_inv, amax} for a
// weight read as the matrix [rows, cols] (rows of its last dimension).
Fp8WeightCache make_weight_cache(Context& ctx, const std::string& prefix, const Tensor& weight,
                                 const Fp8Recipe& recipe);

// Quantizes `weight` into `cache` as the recipe says (the scale from the
// weight's amax, the largest over `amax_group`; or delayed's state scale),
// counting a non-finite amax into `non_finite_counter`. A hook for
// Parameter::after_update: every argument is held by value.
void refresh_weight_cache(Context& ctx, const Fp8Recipe& recipe, const Tensor& weight, const DelayedState& delayed,
                          Communicator* amax_group, const Fp8WeightCache& cache, const Tensor& non_finite_counter);

// The copies a layer's GEMMs read from the cache (Fp8Copies' roles).
Fp8Copies cached_copies(const Fp8WeightCache& cache);

// refresh_weight_cache as a Parameter::after_update hook, every argument held by value.
std::function<void(Context&)> weight_cache_hook(const Fp8Recipe& recipe, const Tensor& weight,
                                                const DelayedState& delayed, Communicator* amax_group,
                                                const Fp8WeightCache& cache, const Tensor& non_finite_counter);

// A layer's tally of quantizations that met a non-finite amax (Note [FP8
// scaling]): [1] int32 on the device, 0 to begin with; a model may share one
// among its layers (one read a step).
Tensor make_non_finite_counter(Context& ctx, const std::string& name);
// Its count (a device read: after a step, never inside one); 0 when undefined.
std::int64_t read_non_finite_counter(Context& ctx, const Tensor& counter);
// An Error naming `label` unless `counter` is [1] int32.
void check_non_finite_counter(std::string_view label, const Tensor& counter);

// One tensor's amax on its way into its delayed-scaling state at the end of
// a layer's backward, after the GEMMs read the old scales.
struct AmaxUpdate {
  Tensor amax;
  DelayedState state;
  Fp8Format format;
  bool sliced = false;         // a tensor-parallel slice: the largest over `tensor_parallel` first
  bool data_parallel = false;  // then the largest over `amax_group` (x and dy; W is alike on every rank)
};
// Rolls each amax into its history and updates its scale, so every rank keeps
// the same scales; a non-finite amax leaves its state as it was and is
// counted into `non_finite_counter`.
void update_delayed_scaling(Context& ctx, const Fp8Recipe& recipe, std::initializer_list<AmaxUpdate> updates,
                            Communicator* tensor_parallel, Communicator* amax_group,
                            const Tensor& non_finite_counter);

// The defined ones of `flags`.
std::vector<Tensor> defined(std::initializer_list<Tensor> flags);

}  // namespace stepgraph::detail
