// Runs a range of a planned schedule: every kRun calls the op with the
// planned addresses (persistent addresses, or pool base + offset).
//   on CUDA: launches on the context's streams, recording and waiting on the
//            plan's events, so under stream capture the records and waits
//            become the graph's edges;
//   on host: calls the host references in program order (a valid order of
//            the schedule), ignoring records and waits.
#pragma once

#include <cuda_runtime_api.h>

#include <span>

#include "graphs/planner.h"
#include "graphs/program.h"

namespace stepgraph {

void run_schedule_host(const Program& program, const StepPlan& plan, StepPlan::Range range,
                       std::span<void* const> addresses);

void run_schedule_cuda(const Program& program, const StepPlan& plan, StepPlan::Range range,
                       std::span<void* const> addresses, std::span<const cudaStream_t> streams,
                       std::span<const cudaEvent_t> events);

}  // namespace stepgraph
