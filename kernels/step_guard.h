// The device side of a step that skips its update when anything is not
// finite (the optimizer decides whether to skip): flag a tensor's
// non-finite values, count the flagged steps; and fp16's dynamic loss
// scaling, which rides on that skip (Note [Loss scaling]). Each launch keeps everything
// on the device, so a captured step reads nothing on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "engine/dtype.h"

namespace stepgraph::kernels {

// *flag = 1 when any of x's `count` fp32 values is NaN or infinite; left
// as it is otherwise (several checks flag one word).
void launch_flag_nonfinite(const float* x, std::int64_t count, std::int32_t* flag, cudaStream_t stream);
// *skipped += 1 when *flag is not zero, then *flag = 0 for the next step
// (one thread).
void launch_count_and_clear_flag(std::int32_t* flag, std::int64_t* skipped, cudaStream_t stream);

// Note [Loss scaling]
// fp16 keeps 5 exponent bits: gradients below 2^-24 flush to zero. Dynamic
// loss scaling multiplies the loss gradient by a scale S (a power of two),
// so every gradient of the backward is S times the true one, and AdamW
// divides by S again (a multiply by 1/S: exact for a power of two) before
// its update. A step whose scaled gradients overflow is skipped by the
// non-finite check (launch_flag_nonfinite above) and halves
// S; `growth_interval` good steps in a row double it. The state lives on
// the device, fp32 [3] = {S, 1/S, good steps in a row}, so a captured step
// reads and updates it without the host.
struct LossScaling {
  float initial_scale = 65536.0f;  // 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;  // 2^24

  bool operator==(const LossScaling&) const = default;
};
constexpr std::int64_t kLossScaleStateSize = 3;  // {scale, 1/scale, good steps}

// Powers of two for the factors and bounds (so scaling is exact), an
// interval >= 1; else Error.
void check_loss_scaling(const LossScaling& scaling);
// The state a run starts from: {initial, 1/initial, 0}.
void initial_loss_scale_state(const LossScaling& scaling, float* state_host);

// After a step's updates: where *flag is set, S *= backoff (not below
// min_scale) and the good steps restart; else one more good step, and at
// growth_interval of them S *= growth (not above max_scale) and they
// restart. Writes 1/S beside S. Reads the flag, does not clear it.
void launch_loss_scale_update(const LossScaling& scaling, float* state, const std::int32_t* flag,
                              cudaStream_t stream);
// x (bf16, fp16 or fp32, `count` values) *= state[0], in place.
void launch_scale_by_loss_scale(DType dtype, void* x, std::int64_t count, const float* state, cudaStream_t stream);

namespace host {
void flag_nonfinite(const float* x, std::int64_t count, std::int32_t* flag);
void count_and_clear_flag(std::int32_t* flag, std::int64_t* skipped);
void loss_scale_update(const LossScaling& scaling, float* state, const std::int32_t* flag);
void scale_by_loss_scale(DType dtype, void* x, std::int64_t count, const float* state);
}  // namespace host

}  // namespace stepgraph::kernels
