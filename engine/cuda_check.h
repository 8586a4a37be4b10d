// Checks for CUDA runtime and cuBLAS/cuBLASLt calls. Each failure becomes a
// stepgraph::Error naming the call, the library's error name and text, and
// the place it happened.
//
//   SG_CUDA_CHECK(cudaStreamSynchronize(stream));
//   SG_CUBLAS_CHECK(cublasLtMatmul(...));
//
// After a kernel launch, SG_CUDA_CHECK(cudaGetLastError()) catches launch
// configuration errors at their source.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "engine/error.h"

namespace stepgraph::detail {

[[noreturn]] void raise_cuda(cudaError_t status, const char* expression, SourcePlace place);
[[noreturn]] void raise_cublas(cublasStatus_t status, const char* expression, SourcePlace place);

}  // namespace stepgraph::detail

#define SG_CUDA_CHECK(expr)                                             \
  do {                                                                  \
    const cudaError_t sg_cuda_status_ = (expr);                         \
    if (sg_cuda_status_ != cudaSuccess) [[unlikely]] {                  \
      ::stepgraph::detail::raise_cuda(sg_cuda_status_, #expr, SG_HERE); \
    }                                                                   \
  } while (false)

#define SG_CUBLAS_CHECK(expr)                                               \
  do {                                                                      \
    const cublasStatus_t sg_cublas_status_ = (expr);                        \
    if (sg_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {          \
      ::stepgraph::detail::raise_cublas(sg_cublas_status_, #expr, SG_HERE); \
    }                                                                       \
  } while (false)
