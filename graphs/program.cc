#include "graphs/program.h"

#include <algorithm>

#include "engine/error.h"

namespace stepgraph {

const OpDef& if_zero_begin_op() {
  static const OpDef op{.name = "if_zero_begin"};
  return op;
}

const OpDef& if_end_op() {
  static const OpDef op{.name = "if_end"};
  return op;
}

std::vector<ValueId> Instruction::writes() const {
  std::vector<ValueId> written = outputs;
  for (int index : op->written_inputs(params, inputs.size())) written.push_back(inputs.at(index));
  return written;
}

ValueId Program::add_value(std::string name, TensorMeta meta, ValueKind kind) {
  ValueInfo info;
  info.id = static_cast<ValueId>(values_.size());
  info.name = std::move(name);
  info.meta = std::move(meta);
  info.kind = kind;
  values_.push_back(std::move(info));
  return values_.back().id;
}

std::int32_t Program::add_instruction(Instruction instruction) {
  SG_CHECK_CODE(instruction.op != nullptr, ErrorCode::kInternal, "instruction without an op");
  SG_CHECK(instruction.stream >= 0, "op ", instruction.op->name, ": stream index must be >= 0, got ",
           instruction.stream);
  const auto index = static_cast<std::int32_t>(instructions_.size());
  for (ValueId id : instruction.inputs) {
    SG_CHECK_CODE(id >= 0 && id < static_cast<ValueId>(values_.size()), ErrorCode::kInternal, "op ",
                  instruction.op->name, " reads unknown value %", id);
  }
  for (ValueId id : instruction.writes()) {
    ValueInfo& written = value(id);
    if (written.kind == ValueKind::kPool && written.producer < 0) written.producer = index;
  }
  instructions_.push_back(std::move(instruction));
  return index;
}

void Program::begin_segment(std::string name) {
  const auto begin = static_cast<std::int32_t>(instructions_.size());
  // An empty segment just started is renamed rather than left empty.
  if (!segment_starts_.empty() && segment_starts_.back().begin == begin) {
    segment_starts_.back().name = std::move(name);
    return;
  }
  segment_starts_.push_back({std::move(name), begin, 0});
}

ValueInfo& Program::value(ValueId id) {
  SG_CHECK_CODE(id >= 0 && id < static_cast<ValueId>(values_.size()), ErrorCode::kInternal, "unknown value %", id);
  return values_[id];
}

const ValueInfo& Program::value(ValueId id) const {
  SG_CHECK_CODE(id >= 0 && id < static_cast<ValueId>(values_.size()), ErrorCode::kInternal, "unknown value %", id);
  return values_[id];
}

std::vector<Segment> Program::segments() const {
  std::vector<Segment> out;
  const auto count = static_cast<std::int32_t>(instructions_.size());
  if (segment_starts_.empty() || segment_starts_.front().begin > 0) out.push_back({"step", 0, 0});
  for (const Segment& start : segment_starts_) out.push_back({start.name, start.begin, 0});
  for (std::size_t i = 0; i < out.size(); ++i) out[i].end = i + 1 < out.size() ? out[i + 1].begin : count;
  // A trailing segment started after the last instruction holds nothing.
  if (out.size() > 1 && out.back().begin == out.back().end) out.pop_back();
  return out;
}

int Program::stream_count() const {
  int highest = 0;
  for (const Instruction& instruction : instructions_) highest = std::max(highest, instruction.stream);
  return highest + 1;
}

}  // namespace stepgraph
