// Counts read back from files (a checkpoint's step and data position, a
// manifest's world size): decimal digits only, as the trainer writes them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace stepgraph {

// The value of `text` where it is "0" or digits without a leading zero (no
// sign, space, '+', or other character) and at most `max`; nullopt otherwise,
// including for values past 2^64 - 1 (never wrapped).
inline std::optional<std::uint64_t> parse_decimal(std::string_view text, std::uint64_t max) {
  if (text.empty() || text.size() > 20 || (text.size() > 1 && text[0] == '0')) return std::nullopt;
  std::uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (value > (UINT64_MAX - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  if (value > max) return std::nullopt;
  return value;
}

}  // namespace stepgraph
