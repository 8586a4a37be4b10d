// Elementwise fp32 kernels and a deterministic sum. Each launcher checks its
// arguments, launches on the given stream (captured or not) and checks the
// launch. Host references with the same contracts are in elementwise_host.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"
#include "kernels/elementwise_host.h"

namespace stepgraph::kernels {

// out[i] = value
void launch_fill_f32(float* out, float value, std::int64_t n, cudaStream_t stream);

// out[i] = x[i]
void launch_copy_f32(float* out, const float* x, std::int64_t n, cudaStream_t stream);

// Byte copies and zero fills on `stream` (a copy or memset node under stream
// capture): the packing of gradient and weight buckets, any dtype.
void launch_copy_bytes(void* out, const void* x, std::size_t bytes, cudaStream_t stream);
void launch_zero_bytes(void* out, std::size_t bytes, cudaStream_t stream);

// out[i] = y[i] + alpha * x[i]; out may be y (in place).
void launch_axpy_f32(float* out, const float* y, const float* x, float alpha, std::int64_t n, cudaStream_t stream);

// In place: y[i] += alpha * x[i].
inline void launch_axpy_f32(float* y, const float* x, float alpha, std::int64_t n, cudaStream_t stream) {
  launch_axpy_f32(y, y, x, alpha, n, stream);
}

// out[i] = a[i] + b[i]
void launch_add_f32(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t stream);

// out[i] = a[i] * b[i]
void launch_mul_f32(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t stream);

// out[0] = sum of x[0..n). One block, a fixed summation order: the same
// inputs give the same bits on every run, eager or replayed.
void launch_sum_f32(float* out, const float* x, std::int64_t n, cudaStream_t stream);

// Note [Column sums in a fixed order]
// out[c] = sum over rows r of x[r, c] (x [rows, cols] fp32, bf16 or fp16; out
// fp32): kColumnSumLanes (64) partial sums per column, partial k over rows
// r = k, k + 64, k + 128, ... in increasing r, then added in order k =
// 0..63. The host reference adds in exactly that order, so the two agree
// bit for bit, and every launch gives the same bits (eager == graph). A
// block of 1024 threads takes 16 columns, a thread one column and one row
// class: a warp reads 2 rows x 16 columns (two full 32-byte sectors of bf16),
// and a 2048-column tensor fills 128 blocks (fewer, wider blocks left half of
// an H100's SMs idle). A bias's gradient from dy, where no GEMM epilogue
// fuses it (FP8 GEMMs). kColumnSumLanes lives in elementwise_host.h, which
// the host reference and this kernel share.
void launch_column_sum(DType dtype, std::int64_t rows, std::int64_t cols, const void* x, float* out,
                       cudaStream_t stream);

// out[i] = convert(x[i]) between fp32, bf16 and fp16 (round to nearest even).
// Sizes are in elements; any n.
void launch_cast(DType from, DType to, const void* x, void* out, std::int64_t n, cudaStream_t stream);

}  // namespace stepgraph::kernels
