#include "engine/cuda_check.h"
#include "engine/error.h"
#include "kernels/lr_schedule.h"

namespace stepgraph::kernels {
namespace {

__global__ void lr_schedule_kernel(LrSchedule schedule, const std::int64_t* __restrict__ step, float* __restrict__ lr) {
  *lr = lr_at(schedule, *step + 1);
}

}  // namespace

void launch_lr_schedule(const LrSchedule& schedule, const std::int64_t* step, float* lr, cudaStream_t stream) {
  check_lr_schedule(schedule);
  SG_CHECK(step != nullptr && lr != nullptr, "lr_schedule: step and lr must be device pointers, got ", step, " and ",
           lr);
  lr_schedule_kernel<<<1, 1, 0, stream>>>(schedule, step, lr);
  SG_CUDA_CHECK(cudaGetLastError());
}

}  // namespace stepgraph::kernels
