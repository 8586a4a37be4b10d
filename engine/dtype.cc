#include "engine/dtype.h"

#include <string>

#include "engine/error.h"

namespace stepgraph {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat8E4M3: return "fp8_e4m3";
    case DType::kFloat8E5M2: return "fp8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  SG_THROW(ErrorCode::kInternal, "unknown DType value ", static_cast<int>(dtype));
}

DType parse_dtype(std::string_view name) {
  for (DType dtype : kAllDTypes) {
    if (dtype_name(dtype) == name) return dtype;
  }
  if (name == "float32") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float16") return DType::kFloat16;
  std::string valid;
  for (DType dtype : kAllDTypes) {
    valid += valid.empty() ? "" : ", ";
    valid += dtype_name(dtype);
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown dtype '", name, "'; valid names: ", valid);
}

}  // namespace stepgraph
