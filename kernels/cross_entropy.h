// Softmax cross-entropy, forward and backward fused: one pass over the logits
// writes the gradient. logits and dlogits [tokens, vocab] share a dtype (bf16,
// fp16 or fp32); labels [tokens] int32 or int64; tokens whose label equals
// ignore_index contribute nothing. loss is the mean over the tokens that
// count (fp32 scalar; 0 when none counts), and
//   dlogits = (softmax(logits) - onehot(label)) * loss_scale / count
// (rows of ignored tokens are zero). The count is computed on the device
// first, so nothing is read back to the host and the whole op is capturable.
// Labels outside [0, vocab) that are not ignore_index set `error_flag` (see
// launch_cross_entropy), never a silent wrong loss: such rows are written like
// ignored ones and not counted, and the caller raises after the step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

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

// Logits bf16/fp16/fp32, labels int32/int64, tokens and vocab > 0 (each below
// 2^31), vocab a multiple of the 16-byte vector width (8 for 16-bit logits,
// 4 for fp32), a finite loss_scale. Throws Error otherwise.
void check_cross_entropy(const CrossEntropyDesc& desc);

// Scratch the launch needs (the count, per-token losses). It needs no
// initialization: every launch overwrites all of it.
std::size_t cross_entropy_workspace_bytes(const CrossEntropyDesc& desc);

// Three kernels on `stream` (count, rows, fixed-order mean), nothing read back.
// logits, dlogits and workspace must be 16-byte aligned, labels aligned to
// their size. `error_flag` (int32, device) is sticky: the launch sets it to 1
// when a label is out of range and never clears it; the caller zeroes it
// before the steps it wants to check and reads it after.
void launch_cross_entropy(const CrossEntropyDesc& desc, const void* logits, const void* labels, float* loss,
                          void* dlogits, void* workspace, std::int32_t* error_flag, cudaStream_t stream);

namespace host {
// Throws Error for a label out of range.
void cross_entropy(const CrossEntropyDesc& desc, const void* logits, const void* labels, float* loss, void* dlogits);
}  // namespace host

}  // namespace stepgraph::kernels
