// Capturing several steps that never run at the same time into one pool
// (Note [Steps sharing one pool] in graphs/captured_step.h): one step per
// shape bucket, the pool sized by the largest plan instead of the sum.
//
//   std::vector<CapturedStep::StepFunction> buckets = {step_of(256), step_of(512), step_of(1024)};
//   SharedPoolCapture captured = capture_sharing_one_pool(ctx, buckets);
//   captured.steps[1]->replay();        // the 512-token step, in the shared pool
//   captured.pool->bytes();             // the 1024-token step's plan
//   captured.separate_pool_bytes;       // what one pool per step would take
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/context.h"
#include "engine/memory.h"
#include "graphs/captured_step.h"

namespace stepgraph {

struct SharedPoolCapture {
  std::vector<std::shared_ptr<CapturedStep>> steps;  // in the order given, each planned into `pool`
  std::shared_ptr<PoolMemory> pool;                  // the largest step's plan
  std::int64_t separate_pool_bytes = 0;              // the steps' plans added up: one pool each
};

// Traces and plans every step to find the largest pool, allocates it once,
// then captures each step into it with `options` (whose pool must be null).
SharedPoolCapture capture_sharing_one_pool(Context& ctx, std::span<const CapturedStep::StepFunction> steps,
                                           const CaptureOptions& options = {});

}  // namespace stepgraph
