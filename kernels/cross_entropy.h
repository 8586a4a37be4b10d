// Softmax cross-entropy, forward and backward fused: one pass over the logits
// writes the gradient. logits and dlogits [tokens, vocab] share a dtype (bf16,
// fp16 or fp32); labels [tokens] int32 or int64; tokens whose label equals
// ignore_index contribute nothing. loss is the mean over the tokens that
// count (fp32 scalar; 0 when none counts), and
//   dlogits = (softmax(logits) - onehot(label)) * loss_scale / count
// (rows of ignored tokens are zero). The count is computed on the device
// first, so nothing is read back to the host and the whole op is capturable.
// Labels outside [0, vocab) that are not ignore_index raise an Error after
// the step (see cross_entropy_error_flag), never a silent wrong loss.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "engine/dtype.h"

namespace stepgraph::kernels {

struct CrossEntropyDesc {
  DType logits_type = DType::kBFloat16;
  DType label_type = DType::kInt32;
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
  std::int64_t ignore_index = -100;
  float loss_scale = 1.0f;
};

void check_cross_entropy(const CrossEntropyDesc& desc);

// Scratch the launch needs (per-token losses, the count, the error flag).
std::size_t cross_entropy_workspace_bytes(const CrossEntropyDesc& desc);

// `error_flag` (int32, device) is set to 1 when a label is out of range; the
// caller checks it after the step.
void launch_cross_entropy(const CrossEntropyDesc& desc, const void* logits, const void* labels, float* loss,
                          void* dlogits, void* workspace, std::int32_t* error_flag, cudaStream_t stream);

namespace host {
// Throws Error for a label out of range.
void cross_entropy(const CrossEntropyDesc& desc, const void* logits, const void* labels, float* loss, void* dlogits);
}  // namespace host

}  // namespace stepgraph::kernels
