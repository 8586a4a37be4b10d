// Host references of kernels/elementwise.h: the same contracts, run now on
// the host in fp32. Used by the host device and by the kernel tests.
#pragma once

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels::host {

// The row classes of a column sum (Note [Column sums in a fixed order] in
// kernels/elementwise.h), shared by the kernel and the host reference.
inline constexpr int kColumnSumLanes = 64;

void fill_f32(float* out, float value, std::int64_t n);
void copy_f32(float* out, const float* x, std::int64_t n);
void axpy_f32(float* out, const float* y, const float* x, float alpha, std::int64_t n);
void add_f32(float* out, const float* a, const float* b, std::int64_t n);
void mul_f32(float* out, const float* a, const float* b, std::int64_t n);
// Summed in double and rounded once: the reference the GPU sum is compared to.
void sum_f32(float* out, const float* x, std::int64_t n);

// out[i] = convert(x[i]) between fp32, bf16 and fp16, as launch_cast.
void cast(DType from, DType to, const void* x, void* out, std::int64_t n);
// See Note [Column sums in a fixed order] (kernels/elementwise.h): the same order, the same bits.
void column_sum(DType dtype, std::int64_t rows, std::int64_t cols, const void* x, float* out);

}  // namespace stepgraph::kernels::host
