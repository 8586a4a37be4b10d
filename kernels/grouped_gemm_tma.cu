// Host helpers of the Hopper grouped GEMM launchers (grouped_gemm_ws.cu): TMA
// descriptors of bf16 tensors and the current device's SM count (contract in
// grouped_gemm_common.cuh).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <array>
#include <cstdint>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/grouped_gemm_common.cuh"

namespace stepgraph::kernels::grouped {

namespace {
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    SG_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    SG_CHECK_CODE(found == cudaDriverEntryPointSuccess && function != nullptr, ErrorCode::kCuda,
                  "grouped_gemm: the driver has no cuTensorMapEncodeTiled (needs CUDA 12+ drivers)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

}  // namespace

template <int kRank>
CUtensorMap bf16_tensor_map(const void* base, const std::array<std::int64_t, kRank>& dims,
                            const std::array<int, kRank>& box) {
  CUtensorMap map;
  cuuint64_t global_dims[kRank];
  cuuint64_t strides[kRank - 1];
  cuuint32_t box_dims[kRank];
  cuuint32_t element_strides[kRank];
  std::uint64_t stride = 2;
  for (int i = 0; i < kRank; ++i) {
    global_dims[i] = static_cast<cuuint64_t>(dims[i]);
    box_dims[i] = static_cast<cuuint32_t>(box[i]);
    element_strides[i] = 1;
    if (i + 1 < kRank) strides[i] = stride *= static_cast<std::uint64_t>(dims[i]);
  }
  const CUresult result =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRank, const_cast<void*>(base), global_dims, strides,
                           box_dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SG_CHECK_CODE(result == CUDA_SUCCESS, ErrorCode::kCuda, "grouped_gemm: cuTensorMapEncodeTiled failed (CUresult ",
                static_cast<int>(result), ") for a rank-", kRank, " bf16 tensor at ", base, " (innermost ", dims[0],
                ")");
  return map;
}

int sm_count() {
  int device = 0;
  int count = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template CUtensorMap bf16_tensor_map<2>(const void*, const std::array<std::int64_t, 2>&, const std::array<int, 2>&);
template CUtensorMap bf16_tensor_map<3>(const void*, const std::array<std::int64_t, 3>&, const std::array<int, 3>&);

}  // namespace stepgraph::kernels::grouped
