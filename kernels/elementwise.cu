#include "engine/cuda_check.h"
#include "kernels/elementwise.h"
#include "kernels/launch_config.cuh"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {
namespace {

__global__ void fill_f32_kernel(float* out, float value, std::int64_t n) {
  grid_stride(n, [&](std::int64_t i) { out[i] = value; });
}

__global__ void copy_f32_kernel(float* out, const float* x, std::int64_t n) {
  grid_stride(n, [&](std::int64_t i) { out[i] = x[i]; });
}

__global__ void axpy_f32_kernel(float* out, const float* y, const float* x, float alpha, std::int64_t n) {
  grid_stride(n, [&](std::int64_t i) { out[i] = y[i] + alpha * x[i]; });
}

__global__ void add_f32_kernel(float* out, const float* a, const float* b, std::int64_t n) {
  grid_stride(n, [&](std::int64_t i) { out[i] = a[i] + b[i]; });
}

__global__ void mul_f32_kernel(float* out, const float* a, const float* b, std::int64_t n) {
  grid_stride(n, [&](std::int64_t i) { out[i] = a[i] * b[i]; });
}

constexpr int kSumThreads = 1024;

// Thread t sums x[t], x[t + 1024], ... in order; then a fixed tree over the
// 1024 partial sums. No atomics, so the result is bitwise reproducible.
__global__ void __launch_bounds__(kSumThreads) sum_f32_kernel(float* out, const float* x, std::int64_t n) {
  __shared__ float partial[kSumThreads];
  float acc = 0.0f;
  for (std::int64_t i = threadIdx.x; i < n; i += kSumThreads) acc += x[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int width = kSumThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = partial[0];
}

template <typename From, typename To>
__global__ void cast_kernel(const From* x, To* out, std::int64_t n) {
  grid_stride(n, [&](std::int64_t i) { out[i] = from_float<To>(to_float(x[i])); });
}

template <typename From>
void launch_cast_from(DType to, const From* x, void* out, std::int64_t n, cudaStream_t stream) {
  switch (to) {
    case DType::kFloat32:
      cast_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, static_cast<float*>(out), n);
      return;
    case DType::kBFloat16:
      cast_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, static_cast<__nv_bfloat16*>(out), n);
      return;
    case DType::kFloat16:
      cast_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, static_cast<__half*>(out), n);
      return;
    default:
      SG_THROW(ErrorCode::kUnsupported, "cast: target dtype ", dtype_name(to), " is not supported (fp32, bf16, fp16)");
  }
}

void check_count(const char* op, std::int64_t n) { SG_CHECK(n >= 0, op, ": element count must be >= 0, got ", n); }

void check_pointers(const char* op, std::int64_t n, std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers) {
    SG_CHECK(pointer != nullptr, op, ": null pointer for ", n, " elements");
  }
}

// See Note [Column sums in a fixed order]: host::kColumnSumLanes row classes x 16 columns a block.
constexpr int kSumColumns = 16;
constexpr int kColumnSumThreads = host::kColumnSumLanes * kSumColumns;
template <typename T>
__global__ void __launch_bounds__(kColumnSumThreads)
    column_sum_kernel(const T* __restrict__ x, std::int64_t rows, std::int64_t cols, float* __restrict__ out) {
  __shared__ float partial[host::kColumnSumLanes][kSumColumns];
  const int column = static_cast<int>(threadIdx.x) % kSumColumns;
  const int k = static_cast<int>(threadIdx.x) / kSumColumns;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kSumColumns + column;
  float sum = 0.0f;
  if (c < cols) {
    for (std::int64_t r = k; r < rows; r += host::kColumnSumLanes) sum += to_float(x[r * cols + c]);
  }
  partial[k][column] = sum;
  __syncthreads();
  if (k == 0 && c < cols) {
    float total = partial[0][column];
    for (int j = 1; j < host::kColumnSumLanes; ++j) total += partial[j][column];
    out[c] = total;
  }
}

}  // namespace

void launch_fill_f32(float* out, float value, std::int64_t n, cudaStream_t stream) {
  check_count("fill_f32", n);
  if (n == 0) return;
  check_pointers("fill_f32", n, {out});
  fill_f32_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(out, value, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_copy_f32(float* out, const float* x, std::int64_t n, cudaStream_t stream) {
  check_count("copy_f32", n);
  if (n == 0) return;
  check_pointers("copy_f32", n, {out, x});
  copy_f32_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(out, x, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_copy_bytes(void* out, const void* x, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  SG_CUDA_CHECK(cudaMemcpyAsync(out, x, bytes, cudaMemcpyDeviceToDevice, stream));
}

void launch_zero_bytes(void* out, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  SG_CUDA_CHECK(cudaMemsetAsync(out, 0, bytes, stream));
}

void launch_axpy_f32(float* out, const float* y, const float* x, float alpha, std::int64_t n, cudaStream_t stream) {
  check_count("axpy_f32", n);
  if (n == 0) return;
  check_pointers("axpy_f32", n, {out, y, x});
  axpy_f32_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(out, y, x, alpha, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_add_f32(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t stream) {
  check_count("add_f32", n);
  if (n == 0) return;
  check_pointers("add_f32", n, {out, a, b});
  add_f32_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(out, a, b, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_mul_f32(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t stream) {
  check_count("mul_f32", n);
  if (n == 0) return;
  check_pointers("mul_f32", n, {out, a, b});
  mul_f32_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(out, a, b, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_sum_f32(float* out, const float* x, std::int64_t n, cudaStream_t stream) {
  check_count("sum_f32", n);
  check_pointers("sum_f32", n, {out});
  if (n > 0) check_pointers("sum_f32", n, {x});
  sum_f32_kernel<<<1, kSumThreads, 0, stream>>>(out, x, n);
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_column_sum(DType dtype, std::int64_t rows, std::int64_t cols, const void* x, float* out,
                       cudaStream_t stream) {
  SG_CHECK(rows >= 0 && cols >= 0, "column_sum: rows and cols must be >= 0, got ", rows, " and ", cols);
  if (cols == 0) return;
  SG_CHECK(out != nullptr && (rows == 0 || x != nullptr), "column_sum: x and out must be device pointers");
  const auto blocks = static_cast<unsigned>((cols + kSumColumns - 1) / kSumColumns);
  switch (dtype) {
    case DType::kFloat32:
      column_sum_kernel<<<blocks, kColumnSumThreads, 0, stream>>>(static_cast<const float*>(x), rows, cols, out);
      break;
    case DType::kBFloat16:
      column_sum_kernel<<<blocks, kColumnSumThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), rows, cols,
                                                                  out);
      break;
    case DType::kFloat16:
      column_sum_kernel<<<blocks, kColumnSumThreads, 0, stream>>>(static_cast<const __half*>(x), rows, cols, out);
      break;
    default: SG_THROW(ErrorCode::kInvalidArgument, "column_sum: x must be fp32, bf16 or fp16, got ", dtype_name(dtype));
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

void launch_cast(DType from, DType to, const void* x, void* out, std::int64_t n, cudaStream_t stream) {
  check_count("cast", n);
  if (n == 0) return;
  check_pointers("cast", n, {x, out});
  switch (from) {
    case DType::kFloat32: launch_cast_from(to, static_cast<const float*>(x), out, n, stream); break;
    case DType::kBFloat16: launch_cast_from(to, static_cast<const __nv_bfloat16*>(x), out, n, stream); break;
    case DType::kFloat16: launch_cast_from(to, static_cast<const __half*>(x), out, n, stream); break;
    default:
      SG_THROW(ErrorCode::kUnsupported, "cast: source dtype ", dtype_name(from),
               " is not supported (fp32, bf16, fp16)");
  }
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
