// Host references of the activation kernels: the same fp32 formulas as the
// device, element by element, results rounded to the dtype (nearest even).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/activation.h"

namespace stepgraph::kernels::host {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

void check_args(const char* op, DType dtype, std::int64_t n, std::initializer_list<const void*> pointers) {
  SG_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16, op, ": dtype ",
           dtype_name(dtype), " is not supported; use bf16, fp16 or fp32");
  SG_CHECK(n >= 0, op, ": element count must be >= 0, got ", n);
  if (n == 0) return;
  for (const void* pointer : pointers) SG_CHECK(pointer != nullptr, op, ": null pointer for ", n, " elements");
}

float load(DType dtype, const void* base, std::int64_t i) {
  switch (dtype) {
    case DType::kFloat32: {
      float value;
      std::memcpy(&value, static_cast<const float*>(base) + i, sizeof(value));
      return value;
    }
    case DType::kBFloat16: return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    default: return fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);  // checked: fp16
  }
}

void store(DType dtype, void* base, std::int64_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: std::memcpy(static_cast<float*>(base) + i, &value, sizeof(value)); return;
    case DType::kBFloat16: static_cast<std::uint16_t*>(base)[i] = float_to_bf16(value); return;
    default: static_cast<std::uint16_t*>(base)[i] = float_to_fp16(value); return;  // checked: fp16
  }
}

float gelu_tanh(float x) {
  const float t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  return 0.5f * x * (1.0f + t);
}

float gelu_tanh_grad(float x) {
  const float t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  const float sech2 = 1.0f - t * t;
  const float inner = sech2 == 0.0f ? 0.0f : 0.5f * x * sech2 * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return 0.5f * (1.0f + t) + inner;
}

}  // namespace

void gelu_forward(DType dtype, const void* x, void* y, std::int64_t n) {
  check_args("host gelu_forward", dtype, n, {x, y});
  for (std::int64_t i = 0; i < n; ++i) store(dtype, y, i, gelu_tanh(load(dtype, x, i)));
}

void gelu_backward(DType dtype, const void* dy, const void* x, void* dx, std::int64_t n) {
  check_args("host gelu_backward", dtype, n, {dy, x, dx});
  for (std::int64_t i = 0; i < n; ++i) {
    store(dtype, dx, i, load(dtype, dy, i) * gelu_tanh_grad(load(dtype, x, i)));
  }
}

void residual_add(DType dtype, const void* a, const void* b, void* out, std::int64_t n) {
  check_args("host residual_add", dtype, n, {a, b, out});
  for (std::int64_t i = 0; i < n; ++i) store(dtype, out, i, load(dtype, a, i) + load(dtype, b, i));
}

}  // namespace stepgraph::kernels::host
