// AdamW over many parameter tensors in one launch (multi-tensor apply).
//
// Each tensor has an fp32 master weight, an fp32 gradient, fp32 first and
// second moments, and optionally a bf16 copy of the weight that the forward
// pass reads. The step counter lives on the device (int64): the kernel reads
// t = step + 1 for its bias corrections and a final tiny launch stores t, so
// a replayed graph needs nothing from the host. For each element:
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   w = w - lr (m / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay w)
//   copy = bf16(w) or fp16(w)
// in fp32, with the bias corrections 1 - beta^t = -expm1(t log1p(beta - 1))
// (accurate for small t, exactly 1 in the limit of large t).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace stepgraph::kernels {

struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// One parameter tensor: device (or host, for the reference) pointers.
struct AdamWTensor {
  float* weight = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* copy = nullptr;  // the model-dtype copy of w, optional
  std::int64_t numel = 0;
  bool copy_is_fp16 = false;  // the copy is fp16 (else bf16)
};

// lr, eps, weight_decay >= 0 and betas in [0, 1), all finite; else Error.
void check_adamw_hyper(const AdamWHyper& hyper);

// The launch table: built once per parameter set on the host, uploaded to a
// device buffer the kernel reads (adamw_table_bytes), so a captured step
// replays with fixed pointers. It lists the tensors and their fixed-size
// chunks; each block of the kernel takes one chunk. Tensors may be empty
// (null pointers allowed); the others need weight, grad, m, v and the
// optional copy 16-byte aligned, else Error (no scalar fallback).
std::size_t adamw_table_bytes(const std::vector<AdamWTensor>& tensors);
// Writes the table into host memory `table_host` (adamw_table_bytes of it);
// the caller copies it to `table_device` (16-byte aligned) before the first
// launch.
void build_adamw_table(const std::vector<AdamWTensor>& tensors, void* table_host);

// Rewrites the table's tensor entries (not its chunk list, which depends on
// the sizes alone) on `stream` from `tensors`, which must have the sizes the
// table was built for: for tensors whose addresses change between steps
// (gradients that live only within a step). The entries travel
// as kernel parameters, so a captured write replays the capture's pointers.
void write_adamw_table_entries(const std::vector<AdamWTensor>& tensors, void* table_device, cudaStream_t stream);

// tensor_count and total_numel (the sum of numel) describe the table and size
// the grid. The update kernel runs when total_numel > 0. The step advances
// when advance_step is true: a step split into several updates (parameter
// groups updated as their gradients become final) reads the same counter in
// each and advances it in the last one.
// `lr`: where the rate is read on the device at every launch (a scheduled
// or host-set rate: Note [Learning-rate schedule] in kernels/lr_schedule.h),
// so a captured update takes whatever was written there; null uses hyper.lr.
// `grad_unscale`: where 1/S of a loss-scaled backward is read (Note [Loss
// scaling] in kernels/step_guard.h): every gradient is multiplied by it
// before the update; null reads the gradients as they are.
void launch_adamw(const AdamWHyper& hyper, const void* table_device, std::int64_t tensor_count,
                  std::int64_t total_numel, std::int64_t* step, cudaStream_t stream, bool advance_step = true,
                  const float* lr = nullptr, const float* grad_unscale = nullptr);

// Sets *flag (int32) to 1 when any gradient of the table's tensors is not
// finite; leaves it as it is otherwise, so several tables (a step's
// parameter groups) and other checks can flag one word. Reads the grads only.
void launch_adamw_flag_nonfinite_grads(const void* table_device, std::int64_t tensor_count, std::int64_t total_numel,
                                       std::int32_t* flag, cudaStream_t stream);

namespace host {
void adamw_flag_nonfinite_grads(const std::vector<AdamWTensor>& tensors, std::int32_t* flag);
// The same fp32 formula in the same order; advances *step if advance_step;
// the rate from *lr when lr is non-null; gradients times *grad_unscale when
// that is non-null.
void adamw(const AdamWHyper& hyper, const std::vector<AdamWTensor>& tensors, std::int64_t* step,
           bool advance_step = true, const float* lr = nullptr, const float* grad_unscale = nullptr);
}  // namespace host

}  // namespace stepgraph::kernels
