// FP8 recipes: how a layer's GEMM inputs are scaled into FP8, as
// plain values. Two recipes built separately with the same fields are equal,
// hash equal and give equal graph keys (the same captured graph); any changed
// field is another key (a new capture). A layer without a recipe runs bf16.
// CUDA-free.
//
//   Fp8Recipe recipe = Fp8Recipe::delayed();     // history 1024, max, margin 0
//   recipe.margin = 1;
//   recipe.check();                              // an Error naming a field out of range
//   key.add("fp8", recipe);                      // graphs/graph_key.h: the fields that count, nested
//
// Note [FP8 scaling]
// A tensor x goes to FP8 as q = saturate(round(x * scale)) with scale_inv =
// 1 / scale kept beside q for the GEMM (its alpha):
//  - current: scale = fp8_max / amax(x) of this very tensor (one pass for
//    amax, fused with the cast where the kernel can);
//  - delayed: scale from the amax history of earlier steps (a persistent
//    device buffer of amax_history_len entries per tensor): amax = max of
//    the history or its most recent entry, scale = fp8_max / amax / 2^margin,
//    kept unchanged when amax is 0 or not finite (Transformer Engine's rule);
//  - block: one scale per 1 x 128 block of an activation's rows and per
//    128 x 128 block of a weight, fp8_max / the block's amax rounded down
//    to a power of two when power_of_two_scales (exact scale_inv).
// Formats: E4M3 everywhere, or hybrid: E4M3 forward, E5M2 for gradients.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "engine/fp8.h"

namespace stepgraph {

enum class Fp8Scaling : std::uint8_t { kCurrent, kDelayed, kBlock };
enum class Fp8Formats : std::uint8_t { kE4M3, kHybrid };
enum class AmaxReduction : std::uint8_t { kMax, kMostRecent };
// What a step that meets a non-finite amax does (the layers count them on the
// device, Linear::non_finite_amaxes): keep that tensor's scale and go on, or
// stop the run with an Error at the next check_errors. Skipping the whole
// optimizer step is the optimizer's non-finite skip.
enum class NonFiniteAmax : std::uint8_t { kSkipStep, kStop };

std::string_view fp8_scaling_name(Fp8Scaling scaling);  // "current", "delayed", "block"
// Parses "current", "delayed", "block"; anything else is an Error listing them.
Fp8Scaling parse_fp8_scaling(std::string_view name);

struct Fp8Recipe {
  Fp8Scaling scaling = Fp8Scaling::kCurrent;
  Fp8Formats formats = Fp8Formats::kHybrid;
  // delayed only (ignored, and not part of the key, otherwise)
  int amax_history_len = 1024;  // [1, 65536]
  AmaxReduction amax_reduction = AmaxReduction::kMax;
  int margin = 0;  // [0, 32]: scales divided by 2^margin
  // block only
  bool power_of_two_scales = true;
  // cuBLASLt's fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM) for the
  // forward GEMMs and for the gradient GEMMs.
  bool fast_accumulation_forward = true;
  bool fast_accumulation_backward = false;
  NonFiniteAmax on_non_finite = NonFiniteAmax::kSkipStep;
  // Tensor-wise scaling: quantize each FP8 weight once per optimizer step,
  // right after its update, into persistent row- and column-wise copies the
  // step's GEMMs read, so they are never stale.
  // Costs the copies' two bytes a weight element of persistent memory.
  bool cache_weights = false;

  static Fp8Recipe current();
  static Fp8Recipe delayed(int amax_history_len = 1024, AmaxReduction reduction = AmaxReduction::kMax,
                           int margin = 0);
  static Fp8Recipe block();
  // current(), delayed() or block(): the engine's recipe for `scaling`.
  static Fp8Recipe of(Fp8Scaling scaling);

  // The format of forward tensors (activations, weights) and of gradients.
  Fp8Format forward_format() const { return Fp8Format::kE4M3; }
  Fp8Format gradient_format() const {
    return formats == Fp8Formats::kHybrid ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  }

  // An Error (kInvalidArgument) naming the first field out of range.
  void check() const;

  // Calls visit(name, value) for each field that counts for this scaling, in
  // a fixed order; value is std::string_view, int or bool. Fields the scaling
  // ignores (a delayed recipe's history for current scaling) are left out,
  // so they change neither equality, hash nor graph key.
  template <typename Visit>
  void for_each_field(Visit&& visit) const;

  std::size_t hash() const;
  std::string to_string() const;  // "{scaling=delayed, formats=hybrid, amax_history_len=1024, ...}"

  bool operator==(const Fp8Recipe& other) const;
};

std::string_view fp8_formats_name(Fp8Formats formats);           // "e4m3", "hybrid"
std::string_view amax_reduction_name(AmaxReduction reduction);   // "max", "most_recent"
std::string_view non_finite_amax_name(NonFiniteAmax behaviour);  // "skip_step", "stop"

template <typename Visit>
void Fp8Recipe::for_each_field(Visit&& visit) const {
  visit("scaling", fp8_scaling_name(scaling));
  visit("formats", fp8_formats_name(formats));
  if (scaling == Fp8Scaling::kDelayed) {
    visit("amax_history_len", amax_history_len);
    visit("amax_reduction", amax_reduction_name(amax_reduction));
    visit("margin", margin);
  }
  if (scaling == Fp8Scaling::kBlock) visit("power_of_two_scales", power_of_two_scales);
  visit("fast_accumulation_forward", fast_accumulation_forward);
  visit("fast_accumulation_backward", fast_accumulation_backward);
  visit("on_non_finite", non_finite_amax_name(on_non_finite));
  if (cache_weights) visit("cache_weights", cache_weights);
}

}  // namespace stepgraph
