#include "graphs/bound_schedule.h"

namespace stepgraph {

BoundSchedule::BoundSchedule(const Program& program, const StepPlan& plan, StepPlan::Range range,
                             std::span<void* const> addresses) {
  std::size_t runs = 0;
  for (std::int32_t e = range.begin; e < range.end; ++e) runs += plan.schedule[e].kind == ScheduleEntry::Kind::kRun;
  arrays_.reserve(runs);  // entries point into these arrays: no reallocation after this
  for (std::int32_t e = range.begin; e < range.end; ++e) {
    const ScheduleEntry& planned = plan.schedule[e];
    LaunchEntry entry;
    entry.stream = planned.stream;
    entry.event = planned.event;
    switch (planned.kind) {
      case ScheduleEntry::Kind::kRecord: entry.kind = LaunchEntry::Kind::kRecord; break;
      case ScheduleEntry::Kind::kWait: entry.kind = LaunchEntry::Kind::kWait; break;
      case ScheduleEntry::Kind::kIfZeroBegin: {
        const Instruction& instruction = program.instructions()[planned.instruction];
        entry.kind = LaunchEntry::Kind::kIfZeroBegin;
        entry.condition = addresses[instruction.inputs.at(0)];
        break;
      }
      case ScheduleEntry::Kind::kIfEnd: entry.kind = LaunchEntry::Kind::kIfEnd; break;
      case ScheduleEntry::Kind::kRun: {
        const Instruction& instruction = program.instructions()[planned.instruction];
        Arrays& arrays = arrays_.emplace_back();
        for (ValueId id : instruction.inputs) {
          arrays.inputs.push_back(addresses[id]);
          arrays.input_metas.push_back(program.value(id).meta);
        }
        for (ValueId id : instruction.outputs) {
          arrays.outputs.push_back(addresses[id]);
          arrays.output_metas.push_back(program.value(id).meta);
        }
        entry.kind = LaunchEntry::Kind::kRun;
        entry.op = instruction.op;
        entry.params = &instruction.params;
        entry.args = {arrays.inputs, arrays.input_metas, arrays.outputs, arrays.output_metas};
        break;
      }
    }
    entries_.push_back(entry);
  }
}

}  // namespace stepgraph
