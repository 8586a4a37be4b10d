// The activation a Linear or GroupedLinear applies to its output, and whose
// derivative the layer after applies to its data gradient, as a value of
// their configs (Note [Linear epilogues] in layers/linear.h).
#pragma once

#include <cstdint>
#include <string_view>

namespace stepgraph {

enum class LinearActivation : std::uint8_t { kNone, kGelu };

// "none", "gelu"
constexpr std::string_view linear_activation_name(LinearActivation activation) {
  switch (activation) {
    case LinearActivation::kNone: return "none";
    case LinearActivation::kGelu: return "gelu";
  }
  return "unknown";
}

}  // namespace stepgraph
