#include "trainer/flag_values.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

namespace stepgraph::trainer {
namespace {

// Whole numbers: 2^N where that is how the bound is meant, else decimal.
std::string bound_text(std::uint64_t value) {
  for (int n = 16; n < 64; ++n) {
    if (value == (std::uint64_t{1} << n)) return fmt::format("2^{}", n);
    if (value == (std::uint64_t{1} << n) - 1) return fmt::format("2^{} - 1", n);
  }
  if (value == ~std::uint64_t{0}) return "2^64 - 1";
  return std::to_string(value);
}

std::string signed_text(std::int64_t value) {
  return value < 0 ? std::to_string(value) : bound_text(static_cast<std::uint64_t>(value));
}

template <typename T>
bool parse_whole(const std::string& text, T& value) {
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  const auto [at, error] = std::from_chars(text.data(), end, value, 10);
  return error == std::errc() && at == end;
}

}  // namespace

CLI::Validator whole_number(std::int64_t min, std::int64_t max) {
  const std::string range = fmt::format("[{}, {}]", signed_text(min), signed_text(max));
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        std::int64_t value = 0;
        if (!parse_whole(text, value)) {
          // Digits past int64's range read as a number, just too large (or small).
          std::string digits = text.starts_with('-') ? text.substr(1) : text;
          const bool all_digits = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
          if (all_digits) return fmt::format("{} is out of range: give a whole number in {}", text, range);
          return fmt::format("'{}' is not a whole number: give one in {}", text, range);
        }
        if (value < min || value > max)
          return fmt::format("{} is out of range: give a whole number in {}", text, range);
        return {};
      },
      "INT in " + range);
}

CLI::Validator unsigned_number(std::uint64_t max) {
  const std::string range = fmt::format("[0, {}]", bound_text(max));
  return CLI::Validator(
      [max, range](std::string& text) -> std::string {
        std::uint64_t value = 0;
        const bool all_digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
        if (!all_digits) return fmt::format("'{}' is not a whole number: give one in {}", text, range);
        if (!parse_whole(text, value) || value > max) {
          return fmt::format("{} is out of range: give a whole number in {}", text, range);
        }
        return {};
      },
      "UINT in " + range);
}

CLI::Validator real_number(double min, double max, Bound lower) {
  const std::string range = fmt::format("{}{:g}, {:g}]", lower == Bound::kExclusive ? "(" : "[", min, max);
  return CLI::Validator(
      [min, max, lower, range](std::string& text) -> std::string {
        const bool starts_blank = text.empty() || std::isspace(static_cast<unsigned char>(text[0]));
        char* end = nullptr;
        const double value = starts_blank ? 0 : std::strtod(text.c_str(), &end);
        if (starts_blank || end != text.c_str() + text.size()) {
          return fmt::format("'{}' is not a number: give one in {}", text, range);
        }
        if (!std::isfinite(value)) return fmt::format("{} is not a finite number: give one in {}", text, range);
        const bool above_min = lower == Bound::kExclusive ? value > min : value >= min;
        if (!above_min || value > max) return fmt::format("{} is out of range: give a number in {}", text, range);
        return {};
      },
      "NUMBER in " + range);
}

CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? "the value is empty: give one, or leave the flag out" : std::string();
      },
      "TEXT");
}

}  // namespace stepgraph::trainer
