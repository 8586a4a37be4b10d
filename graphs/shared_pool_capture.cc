#include "graphs/shared_pool_capture.h"

#include <algorithm>

#include "engine/error.h"

namespace stepgraph {

SharedPoolCapture capture_sharing_one_pool(Context& ctx, std::span<const CapturedStep::StepFunction> steps,
                                           const CaptureOptions& options) {
  SG_CHECK(!steps.empty(), "capture_sharing_one_pool: no steps to capture");
  SG_CHECK(options.pool == nullptr, "capture_sharing_one_pool: options.pool is set; this function makes the pool");
  SharedPoolCapture out;
  std::int64_t largest = 0;
  for (const CapturedStep::StepFunction& step : steps) {
    const std::int64_t bytes = CapturedStep::planned_pool_bytes(ctx, step, options);
    largest = std::max(largest, bytes);
    out.separate_pool_bytes += bytes;
  }
  out.pool = ctx.backend().allocate_pool(largest);
  CaptureOptions shared = options;
  shared.pool = out.pool;
  for (const CapturedStep::StepFunction& step : steps) out.steps.push_back(CapturedStep::capture(ctx, step, shared));
  return out;
}

}  // namespace stepgraph
