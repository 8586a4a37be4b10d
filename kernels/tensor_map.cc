// TMA descriptors through the driver's cuTensorMapEncodeTiled, found once
// through the runtime (no link against libcuda), and the SM count.
#include "kernels/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "engine/cuda_check.h"
#include "engine/error.h"

namespace stepgraph::kernels {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    SG_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    SG_CHECK_CODE(found == cudaDriverEntryPointSuccess && function != nullptr, ErrorCode::kCuda,
                  "the driver has no cuTensorMapEncodeTiled (the TMA kernels need CUDA 12+ drivers)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

CUtensorMapDataType tensor_map_type(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::kFloat16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::kFloat32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: return CU_TENSOR_MAP_DATA_TYPE_UINT8;  // raw bytes: TMA only moves them
    default: break;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "swizzled_tensor_map: takes bf16, fp16, fp32 or FP8 tensors, got ", dtype_name(dtype));
}

}  // namespace

template <int kRank>
CUtensorMap swizzled_tensor_map(DType dtype, const void* base, const std::array<std::int64_t, kRank>& dims,
                                const std::array<int, kRank>& box) {
  CUtensorMap map;
  cuuint64_t global_dims[kRank];
  cuuint64_t strides[kRank - 1];
  cuuint32_t box_dims[kRank];
  cuuint32_t element_strides[kRank];
  std::uint64_t stride = dtype_size(dtype);
  for (int i = 0; i < kRank; ++i) {
    global_dims[i] = static_cast<cuuint64_t>(dims[i]);
    box_dims[i] = static_cast<cuuint32_t>(box[i]);
    element_strides[i] = 1;
    if (i + 1 < kRank) strides[i] = stride *= static_cast<std::uint64_t>(dims[i]);
  }
  const CUresult result = tensor_map_encoder()(
      &map, tensor_map_type(dtype), kRank, const_cast<void*>(base), global_dims, strides, box_dims, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SG_CHECK_CODE(result == CUDA_SUCCESS, ErrorCode::kCuda, "cuTensorMapEncodeTiled failed (CUresult ",
                static_cast<int>(result), ") for a rank-", kRank, " ", dtype_name(dtype), " tensor at ", base,
                " (innermost ", dims[0], ")");
  return map;
}

int sm_count() {
  int device = 0;
  int count = 0;
  SG_CUDA_CHECK(cudaGetDevice(&device));
  SG_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

template CUtensorMap swizzled_tensor_map<2>(DType, const void*, const std::array<std::int64_t, 2>&,
                                            const std::array<int, 2>&);
template CUtensorMap swizzled_tensor_map<3>(DType, const void*, const std::array<std::int64_t, 3>&,
                                            const std::array<int, 3>&);

}  // namespace stepgraph::kernels
