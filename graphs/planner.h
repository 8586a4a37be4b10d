// Planner: from a Program to a StepPlan. CUDA-free.
//
//  1. Order: walks the program with StreamOrder and inserts event records and
//     waits where streams meet (RAW/WAR/WAW across streams), a fork at the
//     start of each segment for every side stream the segment uses, and a
//     join of every such side stream into the main stream at its end (a
//     captured graph must end joined). A conditional body (Note [Conditional
//     bodies] in engine/backend.h) gets a join of every side stream before
//     it, so it needs no wait inside, and the records a later wait needs
//     from its instructions go right after it.
//  2. Lifetimes: with the happens-before order that results, two pool values
//     may share memory only if every access of one completes before the
//     other's first write. Sharing across streams therefore waits for a join:
//     a value read on a side stream lives until that stream joins back.
//  3. Packing: 256-byte aligned offsets in one pool, reusing memory after a
//     value's last use (several greedy orders tried; the smallest pool wins).
//  4. The lower bound: the peak, over program positions, of the aligned bytes
//     of pool values that must be live there at once ([first access, last
//     access], to the end for live_out values; plus, where they conflict with
//     all of those, values whose last access ran on a stream not yet joined
//     back). Any valid plan needs at least that much; pool_bytes /
//     lower_bound_bytes is the packing quality.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/memory.h"
#include "graphs/program.h"

namespace stepgraph {

struct ScheduleEntry {
  enum class Kind : std::uint8_t {
    kRun,          // run `instruction` on `stream`
    kRecord,       // record event `event` on `stream`
    kWait,         // make `stream` wait on event `event`
    kIfZeroBegin,  // `instruction` (if_zero_begin_op) opens a conditional body on stream 0
    kIfEnd,        // `instruction` (if_end_op) closes it
  };
  Kind kind = Kind::kRun;
  std::int32_t instruction = -1;  // kRun only
  std::int32_t stream = 0;
  std::int32_t event = -1;  // kRecord / kWait only

  bool operator==(const ScheduleEntry&) const = default;
};

struct StepPlan {
  // Every offset is a multiple of this. See Note [256-byte alignment].
  static constexpr std::int64_t kAlignment = kAllocationAlignment;

  std::vector<std::int64_t> offsets;  // per value id; -1 for persistent values
  std::int64_t pool_bytes = 0;
  std::int64_t lower_bound_bytes = 0;
  // The values the lower bound counts where it peaks (what fills the pool at
  // its fullest: pool_by_producer groups them), and that instruction.
  std::vector<ValueId> peak_values;
  std::int32_t peak_position = -1;
  // Every instruction once, in program order, with records and waits between.
  // Each event id is recorded once before it is waited on.
  std::vector<ScheduleEntry> schedule;
  std::int32_t event_count = 0;
  // Per segment of the program: [begin, end) into `schedule`. Each range
  // starts with its forks, ends with its joins, and holds the segment's
  // instructions; events never cross ranges.
  struct Range {
    std::int32_t begin = 0;
    std::int32_t end = 0;
  };
  std::vector<Range> segment_ranges;

  double ratio_to_lower_bound() const {
    return lower_bound_bytes == 0 ? 1.0 : static_cast<double>(pool_bytes) / static_cast<double>(lower_bound_bytes);
  }
};

// Throws Error(kInvalidArgument) for malformed programs: a pool value read
// before any instruction wrote it, a value id out of range, a negative stream.
StepPlan plan_step(const Program& program);

// The bytes of plan.peak_values by the op that made each (its producer's op
// name, "gemm", "norm_forward", ...), largest first: what the pool holds at
// its fullest.
std::vector<std::pair<std::string, std::int64_t>> pool_by_producer(const Program& program, const StepPlan& plan);

}  // namespace stepgraph
