#include "engine/half_precision.h"

#include <cmath>

#include "engine/error.h"

namespace stepgraph {

float fp16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = (bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  std::uint32_t wide;
  if (exponent == 0) {
    if (mantissa == 0) {
      wide = sign;
    } else {  // subnormal: value = mantissa * 2^-24
      const float value = std::ldexp(static_cast<float>(mantissa), -24);
      std::memcpy(&wide, &value, sizeof(wide));
      wide |= sign;
    }
  } else if (exponent == 0x1f) {
    wide = sign | 0x7f800000u | (mantissa << 13);
  } else {
    wide = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

std::uint16_t float_to_fp16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const float magnitude = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7e00u;
  if (magnitude >= 65520.0f) return sign | 0x7c00u;                  // rounds to infinity
  if (magnitude < 6.103515625e-05f) {                                // subnormal range: multiples of 2^-24
    const float scaled = std::nearbyint(std::ldexp(magnitude, 24));  // ties to even (default rounding mode)
    return sign | static_cast<std::uint16_t>(scaled);
  }
  // Normal: drop 13 mantissa bits with round to nearest, ties to even.
  std::uint32_t abs_bits = bits & 0x7fffffffu;
  const std::uint32_t rounding = 0xfffu + ((abs_bits >> 13) & 1u);
  abs_bits += rounding;
  const std::uint32_t exponent = (abs_bits >> 23) - 112;
  const std::uint32_t mantissa = (abs_bits >> 13) & 0x3ffu;
  return sign | static_cast<std::uint16_t>((exponent << 10) | mantissa);
}

float load_as_float(DType dtype, const void* base, std::int64_t i) {
  switch (dtype) {
    case DType::kFloat32: {
      float value;
      std::memcpy(&value, static_cast<const float*>(base) + i, sizeof(value));
      return value;
    }
    case DType::kBFloat16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    case DType::kFloat16: return fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default:
      SG_THROW(ErrorCode::kUnsupported, "dtype ", dtype_name(dtype), " is not a float format (fp32, bf16, fp16)");
  }
}

void store_from_float(DType dtype, void* base, std::int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: std::memcpy(static_cast<float*>(base) + i, &value, sizeof(value)); return;
    case DType::kBFloat16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(value); return;
    case DType::kFloat16: static_cast<std::uint16_t*>(base)[i] = float_to_fp16(value); return;
    default:
      SG_THROW(ErrorCode::kUnsupported, "dtype ", dtype_name(dtype), " is not a float format (fp32, bf16, fp16)");
  }
}

}  // namespace stepgraph
