// LayerNorm and RMSNorm over the last dimension of x[rows, hidden], forward
// and backward. x, y, dy, dx, gamma and beta share one dtype (bf16, fp16 or
// fp32); statistics and parameter gradients are fp32. Any hidden size and
// any element-aligned pointers: the kernels use 16-byte vector accesses when
// hidden is a multiple of 8 (bf16/fp16) or 4 (fp32) and the row pointers are
// 16-byte aligned (the fast path, e.g. cudaMalloc'd buffers), and element
// accesses otherwise. The backward workspace must be 16-byte aligned.
//
//   layernorm: y = (x - mean) * rstd * gamma + beta,   rstd = 1/sqrt(var + eps)
//   rmsnorm:   y = x * rstd * gamma,                  rstd = 1/sqrt(mean(x^2) + eps)
//
// The backward writes dx and the parameter gradients dgamma (and dbeta)
// [hidden] fp32, reduced over rows deterministically in two passes through
// `workspace` (norm_backward_workspace_bytes). Parameter gradients are
// overwritten, not accumulated.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "engine/dtype.h"
#include "engine/fp8.h"

namespace stepgraph::kernels {

enum class NormKind : std::uint8_t { kLayerNorm, kRMSNorm };

struct NormDesc {
  NormKind kind = NormKind::kLayerNorm;
  DType dtype = DType::kBFloat16;
  std::int64_t rows = 0;
  std::int64_t hidden = 0;
  float eps = 1e-5f;
};

// Error for unsupported kinds or dtypes, rows or hidden <= 0, hidden beyond int32, eps <= 0 (or NaN).
void check_norm(const NormDesc& desc);

std::size_t norm_backward_workspace_bytes(const NormDesc& desc);

// mean is unused (may be null) for RMSNorm; beta likewise.
void launch_norm_forward(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y,
                         float* mean, float* rstd, cudaStream_t stream);

// The forward with an FP8 epilogue, the kernel behind kernels/fp8_fused.h's
// launch_norm_fp8 (call that one: it checks the FP8 side and adds the
// column-wise copy). Each row's y, rounded to the dtype exactly as
// launch_norm_forward writes it, also goes to rowwise = fp8(y * *scale)
// [rows, hidden] and max |y| into *amax, taken as bits with atomicMax (the
// caller zeroes it first). y may be null; scale and rowwise null give the
// amax alone. The 16-byte vector path only: hidden a multiple of 8
// (bf16/fp16) and x, gamma, beta, y 16-byte aligned, an Error otherwise.
struct NormFp8Epilogue {
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;
  std::uint8_t* rowwise = nullptr;
  float* amax = nullptr;
};
void launch_norm_forward_fp8(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y,
                             float* mean, float* rstd, const NormFp8Epilogue& fp8, cudaStream_t stream);

// The backward's register budget, swept by benchmarks/memory_bound_bench to
// choose the default; every op uses the default.
struct NormBackwardTuning {
  int vecs = 0;  // 16-byte vectors per thread (2 or 4); 0: the smallest that holds the row
  // Rows a block takes (at most what its 256 threads hold); 0: automatic,
  // fewer where few rows would leave SMs idle (Note [Norm backward rows per block]).
  int rows_per_block = 0;
};

// dx_residual (null, or [rows, hidden] of the desc's dtype): added to dx in
// the same pass, dx = norm's dx + dx_residual rounded once (a residual
// stream's gradient; it may not alias dx).
void launch_norm_backward(const NormDesc& desc, const void* dy, const void* x, const float* mean, const float* rstd,
                          const void* gamma, void* dx, float* dgamma, float* dbeta, void* workspace,
                          cudaStream_t stream, const NormBackwardTuning& tuning = {},
                          const void* dx_residual = nullptr);

namespace host {
void norm_forward(const NormDesc& desc, const void* x, const void* gamma, const void* beta, void* y, float* mean,
                  float* rstd);
void norm_backward(const NormDesc& desc, const void* dy, const void* x, const float* mean, const float* rstd,
                   const void* gamma, void* dx, float* dgamma, float* dbeta, const void* dx_residual = nullptr);
}  // namespace host

}  // namespace stepgraph::kernels
