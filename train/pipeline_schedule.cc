#include "train/pipeline_schedule.h"

#include <algorithm>
#include <limits>

#include "engine/error.h"

namespace stepgraph {

std::string PipelinePass::to_string() const {
  return (kind == Kind::kForward ? "F" : "B") + std::to_string(microbatch);
}

PipelineSchedule::PipelineSchedule(std::vector<PipelinePass> passes) : passes_(std::move(passes)) {
  SG_CHECK(!passes_.empty(), "a pipeline schedule needs at least one pass");
  SG_CHECK(passes_.size() % 2 == 0, "a pipeline schedule runs each microbatch's forward and backward once: ",
           passes_.size(), " passes cannot be that");
  microbatches_ = static_cast<std::int64_t>(passes_.size() / 2);
  std::vector<bool> forward(static_cast<std::size_t>(microbatches_), false);
  std::vector<bool> backward(static_cast<std::size_t>(microbatches_), false);
  for (std::size_t i = 0; i < passes_.size(); ++i) {
    const PipelinePass& pass = passes_[i];
    SG_CHECK(pass.microbatch >= 0 && pass.microbatch < microbatches_, "pipeline schedule: pass ", i, " (",
             pass.to_string(), ") names microbatch ", pass.microbatch, ", outside [0, ", microbatches_,
             ") for a schedule of ", passes_.size(), " passes");
    const auto m = static_cast<std::size_t>(pass.microbatch);
    if (pass.kind == PipelinePass::Kind::kForward) {
      SG_CHECK(!forward[m], "pipeline schedule: pass ", i, " runs microbatch ", m, "'s forward a second time");
      forward[m] = true;
    } else {
      SG_CHECK(forward[m], "pipeline schedule: pass ", i, " runs microbatch ", m, "'s backward before its forward");
      SG_CHECK(!backward[m], "pipeline schedule: pass ", i, " runs microbatch ", m, "'s backward a second time");
      backward[m] = true;
    }
  }
}

PipelineSchedule PipelineSchedule::one_f_one_b(std::int64_t microbatches, std::int64_t warmup) {
  SG_CHECK(microbatches > 0, "one_f_one_b: microbatches must be positive, got ", microbatches);
  SG_CHECK(warmup >= 0, "one_f_one_b: warmup must be >= 0, got ", warmup);
  warmup = std::min(warmup, microbatches - 1);
  std::vector<PipelinePass> passes;
  std::int64_t next_forward = 0;
  std::int64_t next_backward = 0;
  for (; next_forward <= warmup; ++next_forward) passes.push_back({PipelinePass::Kind::kForward, next_forward});
  while (next_backward < microbatches) {
    passes.push_back({PipelinePass::Kind::kBackward, next_backward++});
    if (next_forward < microbatches) passes.push_back({PipelinePass::Kind::kForward, next_forward++});
  }
  return PipelineSchedule(std::move(passes));
}

PipelineSchedule PipelineSchedule::all_forward_all_backward(std::int64_t microbatches) {
  SG_CHECK(microbatches > 0, "all_forward_all_backward: microbatches must be positive, got ", microbatches);
  std::vector<PipelinePass> passes;
  for (std::int64_t m = 0; m < microbatches; ++m) passes.push_back({PipelinePass::Kind::kForward, m});
  for (std::int64_t m = 0; m < microbatches; ++m) passes.push_back({PipelinePass::Kind::kBackward, m});
  return PipelineSchedule(std::move(passes));
}

PipelineSchedule PipelineSchedule::from_signed(const std::vector<std::int64_t>& order) {
  std::vector<PipelinePass> passes;
  for (std::size_t i = 0; i < order.size(); ++i) {
    SG_CHECK(order[i] != 0 && order[i] != std::numeric_limits<std::int64_t>::min(), "pipeline order: entry ", i,
             " is ", order[i], "; +m runs microbatch m's forward and -m its backward, counting from 1");
    passes.push_back({order[i] > 0 ? PipelinePass::Kind::kForward : PipelinePass::Kind::kBackward,
                      (order[i] > 0 ? order[i] : -order[i]) - 1});
  }
  return PipelineSchedule(std::move(passes));
}

std::string PipelineSchedule::to_string() const {
  std::string out;
  for (const PipelinePass& pass : passes_) out += (out.empty() ? "" : " ") + pass.to_string();
  return out;
}

}  // namespace stepgraph
