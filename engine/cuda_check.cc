#include "engine/cuda_check.h"

namespace stepgraph::detail {

void raise_cuda(cudaError_t status, const char* expression, SourcePlace place) {
  // Reset the runtime's (non-sticky) last error so that a later
  // cudaGetLastError() does not report this failure a second time.
  (void)cudaGetLastError();
  const ErrorCode code = status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory
                         : (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) ? ErrorCode::kNoDevice
                                                                                                  : ErrorCode::kCuda;
  raise(code, concat(expression, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")"), place);
}

void raise_cublas(cublasStatus_t status, const char* expression, SourcePlace place) {
  const ErrorCode code = status == CUBLAS_STATUS_ALLOC_FAILED ? ErrorCode::kOutOfMemory : ErrorCode::kCublas;
  raise(code,
        concat(expression, " failed: ", cublasLtGetStatusName(status), " (", cublasLtGetStatusString(status), ")"),
        place);
}

}  // namespace stepgraph::detail
