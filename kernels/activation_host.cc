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
  for (std::int64_t i = 0; i < n; ++i) store_from_float(dtype, y, i, gelu_tanh(load_as_float(dtype, x, i)));
}

void gelu_backward(DType dtype, const void* dy, const void* x, void* dx, std::int64_t n) {
  check_args("host gelu_backward", dtype, n, {dy, x, dx});
  for (std::int64_t i = 0; i < n; ++i) {
    store_from_float(dtype, dx, i, load_as_float(dtype, dy, i) * gelu_tanh_grad(load_as_float(dtype, x, i)));
  }
}

void residual_add(DType dtype, const void* a, const void* b, void* out, std::int64_t n) {
  check_args("host residual_add", dtype, n, {a, b, out});
  for (std::int64_t i = 0; i < n; ++i)
    store_from_float(dtype, out, i, load_as_float(dtype, a, i) + load_as_float(dtype, b, i));
}

}  // namespace stepgraph::kernels::host
