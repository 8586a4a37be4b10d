// A readable dump of a Program, one line per instruction, and, with a plan,
// the pool offsets, the event records and waits, and the pool summary:
//
//   program: 6 values, 4 instructions, 2 streams, 1 segment
//   pool: 1024 bytes, lower bound 1024 (1.00x), 2 events
//   segment 'step'
//     s0 record e0
//     s1 wait e0
//     [0] s0  %2 h:[4, 8] fp32 @pool+0 = add(%0 x:[4, 8] fp32 @persistent, %1 w ...)
#pragma once

#include <string>

#include "graphs/planner.h"
#include "graphs/program.h"

namespace stepgraph {

std::string dump_program(const Program& program, const StepPlan* plan = nullptr);

}  // namespace stepgraph
