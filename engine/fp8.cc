#include "engine/fp8.h"

#include <cmath>

#include "engine/error.h"

namespace stepgraph {
namespace {

struct Layout {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  std::uint8_t max_code;  // the largest finite magnitude's code
};

constexpr Layout layout_of(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? Layout{4, 3, 7, 0x7e} : Layout{5, 2, 15, 0x7b};
}

constexpr std::uint8_t kNan = 0x7f;  // E4M3's NaN, and a NaN of E5M2 (exponent all ones, mantissa non-zero)

}  // namespace

std::string_view fp8_format_name(Fp8Format format) { return format == Fp8Format::kE4M3 ? "e4m3" : "e5m2"; }

DType fp8_dtype(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
}

float fp8_max(Fp8Format format) { return fp8_to_float(format, layout_of(format).max_code); }

float fp8_to_float(Fp8Format format, std::uint8_t code) {
  const Layout l = layout_of(format);
  const bool negative = (code & 0x80) != 0;
  const int magnitude = code & 0x7f;
  const int exponent = magnitude >> l.mantissa_bits;
  const int mantissa = magnitude & ((1 << l.mantissa_bits) - 1);
  const int all_ones = (1 << l.exponent_bits) - 1;
  float value;
  if (format == Fp8Format::kE4M3 && magnitude == 0x7f) {
    value = NAN;
  } else if (format == Fp8Format::kE5M2 && exponent == all_ones) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), 1 - l.bias - l.mantissa_bits);  // subnormal
  } else {
    value = std::ldexp(static_cast<float>(mantissa + (1 << l.mantissa_bits)), exponent - l.bias - l.mantissa_bits);
  }
  return negative ? -value : value;
}

std::uint8_t float_to_fp8(Fp8Format format, float value) {
  if (std::isnan(value)) return kNan;
  const Layout l = layout_of(format);
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float magnitude = std::fabs(value);
  // Past the largest finite value (infinities too) saturates: a value that
  // would round up beyond it is clamped, one that rounds down to it is it.
  if (magnitude > fp8_max(format)) return sign | l.max_code;
  // The grid spacing at this magnitude: subnormal below 2^(1 - bias), else
  // 2^(exponent - mantissa bits). Dividing by a power of two is exact, and
  // nearbyint rounds to nearest even (the default rounding mode).
  int exponent = 1 - l.bias;
  if (magnitude >= std::ldexp(1.0f, 1 - l.bias)) {
    int e2 = 0;
    std::frexp(magnitude, &e2);  // magnitude = f * 2^e2, f in [0.5, 1)
    exponent = e2 - 1;
  }
  const float quanta = std::nearbyint(std::ldexp(magnitude, l.mantissa_bits - exponent));
  // quanta counts steps of 2^(exponent - mantissa bits): below 2^mantissa it
  // is a subnormal's mantissa, else implicit one + mantissa; rounding up to
  // 2^(mantissa + 1) carries into the next exponent, as the encoding does.
  const int steps = static_cast<int>(quanta);
  int code;
  if (exponent == 1 - l.bias && steps < (1 << l.mantissa_bits)) {
    code = steps;  // subnormal (or zero)
  } else {
    code = ((exponent + l.bias) << l.mantissa_bits) + (steps - (1 << l.mantissa_bits));
  }
  if (code > l.max_code) code = l.max_code;
  return static_cast<std::uint8_t>(sign | code);
}

void check_fp8_device(int compute_major, int compute_minor, const std::string& device_name) {
  SG_CHECK_CODE(compute_major >= 9, ErrorCode::kUnsupported, "FP8 needs a Hopper GPU (compute capability 9.0) or "
                "later; ", device_name, " is ", compute_major, ".", compute_minor,
                (compute_major == 8 && compute_minor == 9
                     ? " (cuBLASLt's tensor-wise FP8 runs there, but this build's FP8 kernels are sm_90a)"
                     : " and has no FP8 tensor cores"),
                "; run the layers without an FP8 recipe");
}

}  // namespace stepgraph
