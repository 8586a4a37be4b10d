#include "engine/fp8_recipe.h"

#include <sstream>

#include "engine/error.h"

namespace stepgraph {

std::string_view fp8_scaling_name(Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::kCurrent: return "current";
    case Fp8Scaling::kDelayed: return "delayed";
    case Fp8Scaling::kBlock: return "block";
  }
  return "?";
}

Fp8Scaling parse_fp8_scaling(std::string_view name) {
  for (Fp8Scaling scaling : {Fp8Scaling::kCurrent, Fp8Scaling::kDelayed, Fp8Scaling::kBlock}) {
    if (name == fp8_scaling_name(scaling)) return scaling;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "FP8 scaling '", name, "' is not one of current, delayed, block");
}

std::string_view fp8_formats_name(Fp8Formats formats) { return formats == Fp8Formats::kE4M3 ? "e4m3" : "hybrid"; }

std::string_view amax_reduction_name(AmaxReduction reduction) {
  return reduction == AmaxReduction::kMax ? "max" : "most_recent";
}

std::string_view non_finite_amax_name(NonFiniteAmax behaviour) {
  return behaviour == NonFiniteAmax::kSkipStep ? "skip_step" : "stop";
}

Fp8Recipe Fp8Recipe::current() { return Fp8Recipe{}; }

Fp8Recipe Fp8Recipe::delayed(int amax_history_len, AmaxReduction reduction, int margin) {
  Fp8Recipe recipe;
  recipe.scaling = Fp8Scaling::kDelayed;
  recipe.amax_history_len = amax_history_len;
  recipe.amax_reduction = reduction;
  recipe.margin = margin;
  return recipe;
}

Fp8Recipe Fp8Recipe::block() {
  Fp8Recipe recipe;
  recipe.scaling = Fp8Scaling::kBlock;
  // Per-block scales leave E5M2's range unneeded (DeepSeek-V3, TransformerEngine's
  // default), and cuBLASLt's block-scaled GEMMs have no fast accumulation.
  recipe.formats = Fp8Formats::kE4M3;
  recipe.fast_accumulation_forward = false;
  return recipe;
}

Fp8Recipe Fp8Recipe::of(Fp8Scaling scaling) {
  switch (scaling) {
    case Fp8Scaling::kCurrent: return current();
    case Fp8Scaling::kDelayed: return delayed();
    case Fp8Scaling::kBlock: return block();
  }
  SG_THROW(ErrorCode::kInvalidArgument, "FP8 recipe: scaling ", static_cast<int>(scaling),
           " is not current, delayed or block");
}

void Fp8Recipe::check() const {
  SG_CHECK(scaling == Fp8Scaling::kCurrent || scaling == Fp8Scaling::kDelayed || scaling == Fp8Scaling::kBlock,
           "FP8 recipe: scaling ", static_cast<int>(scaling), " is not current, delayed or block");
  SG_CHECK(formats == Fp8Formats::kE4M3 || formats == Fp8Formats::kHybrid, "FP8 recipe: formats ",
           static_cast<int>(formats), " is not e4m3 or hybrid");
  if (scaling == Fp8Scaling::kDelayed) {
    SG_CHECK(amax_history_len >= 1 && amax_history_len <= 65536,
             "FP8 recipe: amax_history_len must be in [1, 65536], got ", amax_history_len);
    SG_CHECK(amax_reduction == AmaxReduction::kMax || amax_reduction == AmaxReduction::kMostRecent,
             "FP8 recipe: amax_reduction ", static_cast<int>(amax_reduction), " is not max or most_recent");
    SG_CHECK(margin >= 0 && margin <= 32, "FP8 recipe: margin must be in [0, 32], got ", margin);
  }
  if (scaling == Fp8Scaling::kBlock) {
    SG_CHECK(!fast_accumulation_forward && !fast_accumulation_backward,
             "FP8 recipe: block scaling has no fast accumulation (cuBLASLt's block-scaled GEMMs lack it); set "
             "fast_accumulation_forward and fast_accumulation_backward false");
  }
  SG_CHECK(on_non_finite == NonFiniteAmax::kSkipStep || on_non_finite == NonFiniteAmax::kStop,
           "FP8 recipe: on_non_finite ", static_cast<int>(on_non_finite), " is not skip_step or stop");
  SG_CHECK_CODE(!cache_weights || scaling != Fp8Scaling::kBlock, ErrorCode::kUnsupported,
                "FP8 recipe: cache_weights is built for tensor-wise scaling (current, delayed), not block scaling");
}

std::string Fp8Recipe::to_string() const {
  std::ostringstream out;
  out << "{";
  bool first = true;
  for_each_field([&](std::string_view name, const auto& value) {
    out << (first ? "" : ", ") << name << "=";
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, bool>) {
      out << (value ? "true" : "false");
    } else {
      out << value;
    }
    first = false;
  });
  out << "}";
  return out.str();
}

std::size_t Fp8Recipe::hash() const {
  // FNV-1a over the canonical text: equal recipes hash equal everywhere.
  std::uint64_t h = 1469598103934665603ull;
  for (const char c : to_string()) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return static_cast<std::size_t>(h);
}

bool Fp8Recipe::operator==(const Fp8Recipe& other) const { return to_string() == other.to_string(); }

}  // namespace stepgraph
