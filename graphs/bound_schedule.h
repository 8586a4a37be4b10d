// BoundSchedule: one segment of a StepPlan's schedule with every
// instruction's addresses filled in (persistent addresses, or pool base +
// offset), as the LaunchEntries a Backend records. It owns the address and
// meta arrays the entries point into: keep it alive as long as anything
// recorded from it can launch. CUDA-free.
#pragma once

#include <span>
#include <vector>

#include "engine/backend.h"
#include "graphs/planner.h"
#include "graphs/program.h"

namespace stepgraph {

class BoundSchedule {
 public:
  // `program` must outlive this (entries point at its op params).
  BoundSchedule(const Program& program, const StepPlan& plan, StepPlan::Range range,
                std::span<void* const> addresses);
  BoundSchedule(BoundSchedule&&) noexcept = default;
  BoundSchedule& operator=(BoundSchedule&&) noexcept = default;

  std::span<const LaunchEntry> entries() const { return entries_; }

 private:
  struct Arrays {
    std::vector<void*> inputs;
    std::vector<TensorMeta> input_metas;
    std::vector<void*> outputs;
    std::vector<TensorMeta> output_metas;
  };
  std::vector<Arrays> arrays_;  // one per kRun entry; never grows after construction
  std::vector<LaunchEntry> entries_;
};

}  // namespace stepgraph
