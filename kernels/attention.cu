// The CUDA side of kernels/attention.h: argument checks and the choice
// between the tensor-core kernels (attention_forward.cu,
// attention_backward.cu) and the plain ones (attention_simple.cu).
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/attention.h"
#include "kernels/attention_paths.h"
#include "kernels/vector_io.cuh"

namespace stepgraph::kernels {

bool attention_uses_tensor_cores(const AttentionDesc& desc) {
  return (desc.dtype == DType::kBFloat16 || desc.dtype == DType::kFloat16) &&
         (desc.head_dim == 64 || desc.head_dim == 128);
}

void check_attention_cuda(const AttentionDesc& desc) {
  check_attention(desc);
  SG_CHECK(desc.head_dim <= 256, "attention: the CUDA kernels take head_dim <= 256, got ", desc.head_dim);
  // Tile indices and token offsets are 32-bit inside the kernels.
  constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();
  SG_CHECK(desc.tokens * desc.heads <= kIntMax && desc.sequences < kIntMax,
           "attention: tokens * heads (", desc.tokens, " * ", desc.heads, ") and sequences (", desc.sequences,
           ") must be < 2^31 on the CUDA kernels");
}

void launch_attention_forward(const AttentionDesc& desc, const void* q, const void* k, const void* v,
                              const std::int32_t* cu_seqlens, void* out, float* lse, CUstream_st* stream) {
  check_attention_cuda(desc);
  SG_CHECK(q != nullptr && k != nullptr && v != nullptr && cu_seqlens != nullptr && out != nullptr && lse != nullptr,
           "attention forward: q, k, v, cu_seqlens, out and lse must be device pointers, got a null one");
  const attention_detail::AttentionPointers p{
      .q = q, .k = k, .v = v, .cu_seqlens = cu_seqlens, .out_mut = out, .lse_mut = lse};
  if (attention_uses_tensor_cores(desc) && is_aligned16(q) && is_aligned16(k) && is_aligned16(v) && is_aligned16(out)) {
    attention_detail::forward_wgmma(desc, desc.tokens, p, stream);
  } else {
    attention_detail::forward_simple(desc, p, stream);
  }
}

std::size_t attention_backward_workspace_bytes(const AttentionDesc& desc) {
  check_attention_cuda(desc);
  return attention_detail::BackwardWorkspace(desc).bytes();
}

void launch_attention_backward(const AttentionDesc& desc, const void* q, const void* k, const void* v,
                               const void* out, const float* lse, const void* dout, const std::int32_t* cu_seqlens,
                               void* dq, void* dk, void* dv, void* workspace, CUstream_st* stream) {
  check_attention_cuda(desc);
  SG_CHECK(q != nullptr && k != nullptr && v != nullptr && out != nullptr && lse != nullptr && dout != nullptr &&
               cu_seqlens != nullptr && dq != nullptr && dk != nullptr && dv != nullptr,
           "attention backward: q, k, v, out, lse, dout, cu_seqlens, dq, dk and dv must be device pointers, got a "
           "null one");
  SG_CHECK(workspace != nullptr && reinterpret_cast<std::uintptr_t>(workspace) % 256 == 0,
           "attention backward: workspace must be a 256-byte aligned device buffer of "
           "attention_backward_workspace_bytes(desc) bytes");
  attention_detail::AttentionPointers p{
      .q = q,
      .k = k,
      .v = v,
      .out = out,
      .lse = lse,
      .dout = dout,
      .cu_seqlens = cu_seqlens,
      .dq = dq,
      .dk = dk,
      .dv = dv,
  };
  attention_detail::BackwardWorkspace(desc).place(workspace, &p);
  attention_detail::backward_delta(desc, p, stream);
  if (attention_uses_tensor_cores(desc) && is_aligned16(q) && is_aligned16(k) && is_aligned16(v) &&
      is_aligned16(dout) && is_aligned16(dq) && is_aligned16(dk) && is_aligned16(dv)) {
    attention_detail::backward_wgmma(desc, desc.tokens, p, stream);
  } else {
    attention_detail::backward_simple(desc, p, stream);
  }
}

}  // namespace stepgraph::kernels
