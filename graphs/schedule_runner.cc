#include "graphs/schedule_runner.h"

#include <vector>

#include "engine/cuda_check.h"
#include "engine/error.h"

namespace stepgraph {
namespace {

// The KernelArgs of one instruction; owns the address and meta arrays.
struct BoundArgs {
  BoundArgs(const Program& program, const Instruction& instruction, std::span<void* const> addresses) {
    for (ValueId id : instruction.inputs) {
      inputs.push_back(addresses[id]);
      input_metas.push_back(program.value(id).meta);
    }
    for (ValueId id : instruction.outputs) {
      outputs.push_back(addresses[id]);
      output_metas.push_back(program.value(id).meta);
    }
  }
  KernelArgs args() const { return {inputs, input_metas, outputs, output_metas}; }

  std::vector<void*> inputs;
  std::vector<TensorMeta> input_metas;
  std::vector<void*> outputs;
  std::vector<TensorMeta> output_metas;
};

}  // namespace

void run_schedule_host(const Program& program, const StepPlan& plan, StepPlan::Range range,
                       std::span<void* const> addresses) {
  for (std::int32_t e = range.begin; e < range.end; ++e) {
    const ScheduleEntry& entry = plan.schedule[e];
    if (entry.kind != ScheduleEntry::Kind::kRun) continue;
    const Instruction& instruction = program.instructions()[entry.instruction];
    SG_CHECK_CODE(instruction.op->run_host != nullptr, ErrorCode::kUnsupported, "op ", instruction.op->name,
                  " has no host reference");
    const BoundArgs bound(program, instruction, addresses);
    instruction.op->run_host(instruction.params, bound.args());
  }
}

void run_schedule_cuda(const Program& program, const StepPlan& plan, StepPlan::Range range,
                       std::span<void* const> addresses, std::span<const cudaStream_t> streams,
                       std::span<const cudaEvent_t> events) {
  for (std::int32_t e = range.begin; e < range.end; ++e) {
    const ScheduleEntry& entry = plan.schedule[e];
    const cudaStream_t stream = streams[entry.stream];
    switch (entry.kind) {
      case ScheduleEntry::Kind::kRecord: SG_CUDA_CHECK(cudaEventRecord(events[entry.event], stream)); break;
      case ScheduleEntry::Kind::kWait: SG_CUDA_CHECK(cudaStreamWaitEvent(stream, events[entry.event], 0)); break;
      case ScheduleEntry::Kind::kRun: {
        const Instruction& instruction = program.instructions()[entry.instruction];
        SG_CHECK_CODE(instruction.op->launch_cuda != nullptr, ErrorCode::kUnsupported, "op ", instruction.op->name,
                      " has no CUDA launcher");
        const BoundArgs bound(program, instruction, addresses);
        instruction.op->launch_cuda(instruction.params, bound.args(), stream);
        break;
      }
    }
  }
}

}  // namespace stepgraph
