#include "graphs/program_dump.h"

#include <cstdio>

#include "engine/error.h"

namespace stepgraph {
namespace {

std::string describe_value(const Program& program, ValueId id, const StepPlan* plan) {
  const ValueInfo& value = program.value(id);
  std::string text = detail::concat("%", id, " ", value.name, ":", value.meta.shape, " ", dtype_name(value.meta.dtype));
  if (value.kind == ValueKind::kPersistent) return text + " @persistent";
  if (plan != nullptr) text += detail::concat(" @pool+", plan->offsets.at(id));
  if (value.live_out) text += " (live out)";
  return text;
}

std::string describe_instruction(const Program& program, std::int32_t index, const StepPlan* plan) {
  const Instruction& instruction = program.instructions()[index];
  std::string text = detail::concat("[", index, "] s", instruction.stream, "  ");
  for (std::size_t i = 0; i < instruction.outputs.size(); ++i) {
    text += (i ? ", " : "") + describe_value(program, instruction.outputs[i], plan);
  }
  if (!instruction.outputs.empty()) text += " = ";
  text += std::string(instruction.op->name);
  const std::string params = instruction.params.to_string();
  if (!params.empty()) text += "{" + params + "}";
  text += "(";
  for (std::size_t i = 0; i < instruction.inputs.size(); ++i) {
    text += (i ? ", " : "") + describe_value(program, instruction.inputs[i], plan);
  }
  return text + ")";
}

}  // namespace

std::string dump_program(const Program& program, const StepPlan* plan) {
  const std::vector<Segment> segments = program.segments();
  std::string text =
      detail::concat("program: ", program.values().size(), " values, ", program.instructions().size(),
                     " instructions, ", program.stream_count(), " stream(s), ", segments.size(), " segment(s)\n");
  if (plan == nullptr) {
    for (const Segment& segment : segments) {
      text += "segment '" + segment.name + "'\n";
      for (std::int32_t i = segment.begin; i < segment.end; ++i)
        text += "  " + describe_instruction(program, i, nullptr) + "\n";
    }
    return text;
  }
  char ratio[32];
  std::snprintf(ratio, sizeof(ratio), "%.2f", plan->ratio_to_lower_bound());
  text += detail::concat("pool: ", plan->pool_bytes, " bytes, lower bound ", plan->lower_bound_bytes, " (", ratio,
                         "x), ", plan->event_count, " event(s)\n");
  for (std::size_t s = 0; s < segments.size() && s < plan->segment_ranges.size(); ++s) {
    text += "segment '" + segments[s].name + "'\n";
    const StepPlan::Range range = plan->segment_ranges[s];
    for (std::int32_t e = range.begin; e < range.end; ++e) {
      const ScheduleEntry& entry = plan->schedule[e];
      switch (entry.kind) {
        case ScheduleEntry::Kind::kRun:
          text += "  " + describe_instruction(program, entry.instruction, plan) + "\n";
          break;
        case ScheduleEntry::Kind::kRecord:
          text += detail::concat("      s", entry.stream, " record e", entry.event, "\n");
          break;
        case ScheduleEntry::Kind::kWait:
          text += detail::concat("      s", entry.stream, " wait e", entry.event, "\n");
          break;
        case ScheduleEntry::Kind::kIfZeroBegin:
          text += "  " + describe_instruction(program, entry.instruction, plan) + " {\n";
          break;
        case ScheduleEntry::Kind::kIfEnd:
          text += "  }\n";
          break;
      }
    }
  }
  return text;
}

}  // namespace stepgraph
