// Element types of tensors.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace stepgraph {

enum class DType : std::uint8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat8E4M3,  // OCP FP8 E4M3 (finite, max 448)
  kFloat8E5M2,  // OCP FP8 E5M2
  kInt32,
  kInt64,
};

inline constexpr std::array<DType, 7> kAllDTypes = {
    DType::kFloat32,    DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
    DType::kFloat8E5M2, DType::kInt32,    DType::kInt64,
};

// Bytes per element.
constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16: return 2;
    case DType::kFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
    case DType::kFloat8E5M2: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

constexpr bool is_floating_point(DType dtype) { return dtype != DType::kInt32 && dtype != DType::kInt64; }

constexpr bool is_fp8(DType dtype) { return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2; }

// Stable short names: "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int32", "int64".
std::string_view dtype_name(DType dtype);

// The inverse of dtype_name; also accepts "float32", "bfloat16", "float16".
// Throws Error(kInvalidArgument) listing the valid names.
DType parse_dtype(std::string_view name);

}  // namespace stepgraph
