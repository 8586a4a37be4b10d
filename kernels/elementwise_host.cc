#include "kernels/elementwise_host.h"

#include <algorithm>

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

void column_sum(DType dtype, std::int64_t rows, std::int64_t cols, const void* x, float* out) {
  constexpr int kLanes = kColumnSumLanes;  // Note [Column sums in a fixed order]
  for (std::int64_t c = 0; c < cols; ++c) {
    float partial[kLanes] = {};
    for (int k = 0; k < kLanes; ++k)
      for (std::int64_t r = k; r < rows; r += kLanes) partial[k] += load_as_float(dtype, x, r * cols + c);
    float total = partial[0];
    for (int k = 1; k < kLanes; ++k) total += partial[k];
    out[c] = total;
  }
}

void cast(DType from, DType to, const void* x, void* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) store_from_float(to, out, i, load_as_float(from, x, i));
}

}  // namespace stepgraph::kernels::host
