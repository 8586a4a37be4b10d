// Host conversions between fp32 and the 16-bit float formats, bit-exact with
// the device's round-to-nearest-even conversions (__float2bfloat16_rn,
// __float2half_rn). Host references keep bf16/fp16 tensors as these raw bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "engine/dtype.h"

namespace stepgraph {

inline float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline std::uint16_t float_to_bf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
  }
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // to nearest, ties to even
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

// IEEE binary16.
float fp16_to_float(std::uint16_t bits);
std::uint16_t float_to_fp16(float value);

// Element `i` of an fp32, bf16 or fp16 array widened to fp32, and stored back
// rounded to nearest even: what every host reference reads and writes.
// Other dtypes are an Error(kUnsupported).
float load_as_float(DType dtype, const void* base, std::int64_t i);
void store_from_float(DType dtype, void* base, std::int64_t i, float value);

}  // namespace stepgraph
