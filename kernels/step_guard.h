// The device side of a step that skips its update when anything is not
// finite (Note [Non-finite steps] in layers/step_guard.h): flag a tensor's
// non-finite values, count the flagged steps. Each launch keeps everything
// on the device, so a captured step reads nothing on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace stepgraph::kernels {

// *flag = 1 when any of x's `count` fp32 values is NaN or infinite; left
// as it is otherwise (several checks flag one word).
void launch_flag_nonfinite(const float* x, std::int64_t count, std::int32_t* flag, cudaStream_t stream);
// *skipped += 1 when *flag is not zero, then *flag = 0 for the next step
// (one thread).
void launch_count_and_clear_flag(std::int32_t* flag, std::int64_t* skipped, cudaStream_t stream);

namespace host {
void flag_nonfinite(const float* x, std::int64_t count, std::int32_t* flag);
void count_and_clear_flag(std::int32_t* flag, std::int64_t* skipped);
}  // namespace host

}  // namespace stepgraph::kernels
