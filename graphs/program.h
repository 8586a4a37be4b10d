// Program: the recorded instructions of a step (or of the parts of one step
// that become separate graphs: segments). CUDA-free. A readable dump is in
// program_dump.h.
//
// Values are identified by dense ids. A persistent value (parameter, gradient,
// optimizer state, step input) has a fixed address outside the pool; a pool
// value lives in the one static pool at the offset the Planner gives it.
// Instructions list the values they read and write; an op that writes a
// value in place both reads and writes it. A pool value's first writer is its
// producer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "engine/op.h"
#include "engine/shape.h"

namespace stepgraph {

using ValueId = std::int32_t;

enum class ValueKind : std::uint8_t { kPersistent, kPool };

struct ValueInfo {
  ValueId id = -1;
  std::string name;
  TensorMeta meta;
  ValueKind kind = ValueKind::kPool;
  std::int32_t producer = -1;  // first instruction writing it; -1 for persistent values
  // Must survive the end of the program: declared outputs, and values the
  // caller kept that the warn policy keeps valid. Never reused.
  bool live_out = false;

  std::int64_t bytes() const { return meta.bytes(); }
};

struct Instruction {
  const OpDef* op = nullptr;
  OpParams params;
  std::vector<ValueId> inputs;   // in call order (what KernelArgs::inputs gets)
  std::vector<ValueId> outputs;  // fresh outputs (what KernelArgs::outputs gets)
  int stream = 0;                // 0 is the main stream; 1.. are side streams

  // Accesses, for ordering and lifetimes: every input is read; fresh outputs
  // and inputs the op mutates are written.
  std::vector<ValueId> reads() const { return inputs; }
  std::vector<ValueId> writes() const;
};

// The markers of a conditional body (Context::run_if_zero; Note
// [Conditional bodies] in engine/backend.h): pseudo-instructions on stream
// 0, the begin reading the int32 flag. They launch nothing themselves: the
// planner turns them into the schedule's kIfZeroBegin / kIfEnd.
const OpDef& if_zero_begin_op();
const OpDef& if_end_op();
inline bool is_if_zero_begin(const Instruction& instruction) { return instruction.op == &if_zero_begin_op(); }
inline bool is_if_end(const Instruction& instruction) { return instruction.op == &if_end_op(); }

// A contiguous range of instructions that becomes its own graph; all the
// segments of a program share one pool plan.
struct Segment {
  std::string name;
  std::int32_t begin = 0;  // first instruction
  std::int32_t end = 0;    // one past the last
};

class Program {
 public:
  ValueId add_value(std::string name, TensorMeta meta, ValueKind kind);
  // Appends an instruction; sets the producer of pool outputs written first here.
  std::int32_t add_instruction(Instruction instruction);
  // Starts a new segment at the next instruction. A program always has at
  // least one segment ("step" unless named).
  void begin_segment(std::string name);

  ValueInfo& value(ValueId id);
  const ValueInfo& value(ValueId id) const;
  const std::vector<ValueInfo>& values() const { return values_; }
  const std::vector<Instruction>& instructions() const { return instructions_; }
  std::vector<Segment> segments() const;
  int stream_count() const;  // 1 + the highest stream index used

 private:
  std::vector<ValueInfo> values_;
  std::vector<Instruction> instructions_;
  std::vector<Segment> segment_starts_;  // name and begin; ends derived
};

}  // namespace stepgraph
