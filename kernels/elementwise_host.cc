#include "kernels/elementwise_host.h"

#include <algorithm>
#include <cstring>

#include "engine/error.h"
#include "engine/half_precision.h"

namespace stepgraph::kernels::host {

void fill_f32(float* out, float value, std::int64_t n) { std::fill(out, out + n, value); }

void copy_f32(float* out, const float* x, std::int64_t n) { std::copy(x, x + n, out); }

void axpy_f32(float* out, const float* y, const float* x, float alpha, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = y[i] + alpha * x[i];
}

void add_f32(float* out, const float* a, const float* b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void mul_f32(float* out, const float* a, const float* b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

void sum_f32(float* out, const float* x, std::int64_t n) {
  double acc = 0.0;
  for (std::int64_t i = 0; i < n; ++i) acc += x[i];
  out[0] = static_cast<float>(acc);
}

namespace {

float load(DType dtype, const void* x, std::int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(x)[i];
    case DType::kBFloat16: return bf16_to_float(static_cast<const std::uint16_t*>(x)[i]);
    case DType::kFloat16: return fp16_to_float(static_cast<const std::uint16_t*>(x)[i]);
    default: SG_THROW(ErrorCode::kUnsupported, "cast: dtype ", dtype_name(dtype), " is not supported (fp32, bf16, fp16)");
  }
}

void store(DType dtype, void* out, std::int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(out)[i] = value; return;
    case DType::kBFloat16: static_cast<std::uint16_t*>(out)[i] = float_to_bf16(value); return;
    case DType::kFloat16: static_cast<std::uint16_t*>(out)[i] = float_to_fp16(value); return;
    default: SG_THROW(ErrorCode::kUnsupported, "cast: dtype ", dtype_name(dtype), " is not supported (fp32, bf16, fp16)");
  }
}

}  // namespace

void cast(DType from, DType to, const void* x, void* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) store(to, out, i, load(from, x, i));
}

}  // namespace stepgraph::kernels::host
