#include "graphs/planner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "engine/error.h"
#include "engine/stream_order.h"

namespace stepgraph {
namespace {

std::int64_t aligned(std::int64_t bytes) { return align_allocation(bytes); }

std::vector<std::int64_t> widen(const std::vector<ValueId>& ids) { return {ids.begin(), ids.end()}; }

void validate(const Program& program) {
  const std::vector<ValueInfo>& values = program.values();
  const auto value_count = static_cast<ValueId>(values.size());
  std::vector<bool> written(values.size(), false);
  const std::vector<Instruction>& instructions = program.instructions();
  for (std::size_t index = 0; index < instructions.size(); ++index) {
    const Instruction& instruction = instructions[index];
    const std::string_view op = instruction.op->name;
    SG_CHECK(instruction.stream >= 0, "instruction ", index, " (", op, "): stream index must be >= 0, got ",
             instruction.stream);
    for (ValueId id : instruction.inputs) {
      SG_CHECK(id >= 0 && id < value_count, "instruction ", index, " (", op, ") reads unknown value %", id);
      SG_CHECK(values[id].kind != ValueKind::kPool || written[id], "instruction ", index, " (", op,
               ") reads pool value %", id, " (", values[id].name, ") before any instruction wrote it");
    }
    for (ValueId id : instruction.outputs) {
      SG_CHECK(id >= 0 && id < value_count, "instruction ", index, " (", op, ") writes unknown value %", id);
    }
    for (ValueId id : instruction.writes()) written[id] = true;
  }
}

ScheduleEntry record(std::int32_t event, int stream) {
  return {.kind = ScheduleEntry::Kind::kRecord, .stream = stream, .event = event};
}

ScheduleEntry wait_on(std::int32_t event, int stream) {
  return {.kind = ScheduleEntry::Kind::kWait, .stream = stream, .event = event};
}

// The schedule with its events, and the happens-before order it gives.
struct Ordering {
  std::vector<ScheduleEntry> schedule;
  std::vector<StepPlan::Range> segment_ranges;
  std::int32_t event_count = 0;
  // Per instruction: its clock when it runs (its stream's clock after its
  // waits, its own token included).
  std::vector<std::vector<std::int64_t>> clocks;
};

Ordering order(const Program& program) {
  const std::vector<Instruction>& instructions = program.instructions();
  const int stream_count = program.stream_count();
  StreamOrder stream_order(stream_count);
  Ordering out;
  out.clocks.resize(instructions.size());
  std::vector<std::vector<std::int32_t>> issued(stream_count);  // per stream, per token - 1: the instruction
  for (const Segment& segment : program.segments()) {
    std::vector<bool> used(stream_count, false);
    for (std::int32_t index = segment.begin; index < segment.end; ++index) used[instructions[index].stream] = true;
    std::vector<ScheduleEntry> entries;
    // Per instruction of the segment: the event recorded right after it, -1 for none.
    std::vector<std::int32_t> record_after(segment.end - segment.begin, -1);

    // A capture needs every side stream to join it through an event recorded on
    // stream 0, so the fork is emitted even when order_after has nothing to add.
    for (int side = 1; side < stream_count; ++side) {
      if (!used[side]) continue;
      const std::int32_t event = out.event_count++;
      entries.push_back(record(event, 0));
      entries.push_back(wait_on(event, side));
      stream_order.order_after(side, 0);
      // Every other stream joined stream 0 at the end of its last segment, so
      // the fork orders `side` after it too; telling StreamOrder keeps later
      // waits inside this segment and lifetimes tight.
      for (int other = 1; other < stream_count; ++other) {
        if (other != side) stream_order.order_after(side, other);
      }
    }

    // Stream 0 waits for every side stream's work so far, except where it
    // already did through a data dependency: before a conditional body, and
    // at the segment's end (a captured graph must end joined).
    auto join_side_streams = [&] {
      for (int side = 1; side < stream_count; ++side) {
        if (!used[side] || stream_order.order_after(0, side).empty()) continue;
        const std::int32_t event = out.event_count++;
        entries.push_back(record(event, side));
        entries.push_back(wait_on(event, 0));
      }
    };

    bool in_body = false;
    for (std::int32_t index = segment.begin; index < segment.end; ++index) {
      const Instruction& instruction = instructions[index];
      const std::vector<std::int64_t> reads = widen(instruction.reads());
      const std::vector<std::int64_t> writes = widen(instruction.writes());
      ScheduleEntry::Kind kind = ScheduleEntry::Kind::kRun;
      if (is_if_zero_begin(instruction)) {
        SG_CHECK_CODE(!in_body && instruction.stream == 0, ErrorCode::kInternal, "malformed conditional body at ",
                      index);
        join_side_streams();  // the body holds no waits
        kind = ScheduleEntry::Kind::kIfZeroBegin;
        in_body = true;
      } else if (is_if_end(instruction)) {
        SG_CHECK_CODE(in_body, ErrorCode::kInternal, "if_end without if_zero_begin at ", index);
        kind = ScheduleEntry::Kind::kIfEnd;
        in_body = false;
      }
      for (const StreamWait& wait : stream_order.prepare(instruction.stream, reads, writes)) {
        const std::int32_t signal = issued[wait.signal][wait.signal_token - 1];
        SG_CHECK_CODE(signal >= segment.begin, ErrorCode::kInternal, "instruction ", index, " waits on instruction ",
                      signal, " of an earlier segment");
        SG_CHECK_CODE(!in_body || kind != ScheduleEntry::Kind::kRun, ErrorCode::kInternal, "instruction ", index,
                      " inside a conditional body waits on instruction ", signal);
        std::int32_t& event = record_after[signal - segment.begin];
        if (event < 0) event = out.event_count++;
        entries.push_back(wait_on(event, instruction.stream));
      }
      entries.push_back({.kind = kind, .instruction = index, .stream = instruction.stream});
      stream_order.issue(instruction.stream, reads, writes);
      issued[instruction.stream].push_back(index);
      out.clocks[index] = stream_order.clock(instruction.stream);
    }

    // Joins, except where stream 0 already waited for all of a side stream's
    // work through a data dependency.
    join_side_streams();

    SG_CHECK_CODE(!in_body, ErrorCode::kInternal, "a conditional body runs past the end of segment ", segment.name);

    // Each event right after its instruction; those of a conditional body's
    // instructions after the body (events never cross into a body's graph).
    StepPlan::Range range;
    range.begin = static_cast<std::int32_t>(out.schedule.size());
    std::vector<ScheduleEntry> after_body;
    for (const ScheduleEntry& entry : entries) {
      out.schedule.push_back(entry);
      if (entry.kind == ScheduleEntry::Kind::kIfZeroBegin) in_body = true;
      if (entry.kind == ScheduleEntry::Kind::kIfEnd) {
        in_body = false;
        out.schedule.insert(out.schedule.end(), after_body.begin(), after_body.end());
        after_body.clear();
      }
      if (entry.instruction < 0) continue;
      const std::int32_t event = record_after[entry.instruction - segment.begin];
      if (event < 0) continue;
      (in_body ? after_body : out.schedule).push_back(record(event, entry.stream));
    }
    range.end = static_cast<std::int32_t>(out.schedule.size());
    out.segment_ranges.push_back(range);
  }
  return out;
}

// A pool value with bytes that some instruction accesses.
struct Footprint {
  ValueId id = -1;
  std::int64_t size = 0;    // aligned
  std::int32_t first = -1;  // first access, its producer (validated)
  std::int32_t last = -1;   // last access in program order
  bool live_out = false;
  std::vector<std::int64_t> last_token;  // per stream: highest token of an access, 0 for none
};

std::vector<Footprint> footprints(const Program& program, const Ordering& ordering) {
  const std::vector<ValueInfo>& values = program.values();
  const int stream_count = program.stream_count();
  std::vector<std::int32_t> slot(values.size(), -1);
  std::vector<Footprint> out;
  const std::vector<Instruction>& instructions = program.instructions();
  for (std::int32_t index = 0; index < static_cast<std::int32_t>(instructions.size()); ++index) {
    const Instruction& instruction = instructions[index];
    const std::int64_t token = ordering.clocks[index][instruction.stream];
    const auto access = [&](ValueId id) {
      const ValueInfo& info = values[id];
      if (info.kind != ValueKind::kPool || info.bytes() == 0) return;
      if (slot[id] < 0) {
        slot[id] = static_cast<std::int32_t>(out.size());
        out.push_back({.id = id,
                       .size = aligned(info.bytes()),
                       .first = index,
                       .live_out = info.live_out,
                       .last_token = std::vector<std::int64_t>(stream_count, 0)});
      }
      Footprint& footprint = out[slot[id]];
      footprint.last = index;
      footprint.last_token[instruction.stream] = token;
    };
    for (ValueId id : instruction.reads()) access(id);
    for (ValueId id : instruction.writes()) access(id);
  }
  return out;
}

struct Packing {
  std::vector<std::int64_t> offsets;  // per footprint
  std::int64_t bytes = 0;
};

// Greedy: places values in `order`, each in a gap among the already placed
// values it conflicts with, else after them all: the best-fitting gap (the
// smallest that holds it), or with `first_fit` the lowest.
Packing pack(const std::vector<Footprint>& values, const std::vector<std::vector<std::int32_t>>& conflicts,
             const std::vector<std::int32_t>& order, bool first_fit) {
  Packing out;
  out.offsets.assign(values.size(), -1);
  std::vector<std::pair<std::int64_t, std::int64_t>> taken;  // [begin, end) of placed conflicting values
  for (std::int32_t value : order) {
    taken.clear();
    for (std::int32_t other : conflicts[value]) {
      if (out.offsets[other] >= 0) taken.emplace_back(out.offsets[other], out.offsets[other] + values[other].size);
    }
    std::sort(taken.begin(), taken.end());
    const std::int64_t size = values[value].size;
    std::int64_t cursor = 0;
    std::int64_t best = -1;
    std::int64_t best_gap = std::numeric_limits<std::int64_t>::max();
    for (const auto& [begin, end] : taken) {
      const std::int64_t gap = begin - cursor;
      if (gap >= size && gap < best_gap && (best < 0 || !first_fit)) {
        best = cursor;
        best_gap = gap;
      }
      cursor = std::max(cursor, end);
    }
    out.offsets[value] = best >= 0 ? best : cursor;
    out.bytes = std::max(out.bytes, out.offsets[value] + size);
  }
  return out;
}

// Whether every access of `value` happens before instruction `position`.
bool done_before(const Footprint& value, std::int32_t position, const Program& program, const Ordering& ordering) {
  if (value.live_out) return false;
  const std::vector<std::int64_t>& clock = ordering.clocks[position];
  const int stream = program.instructions()[position].stream;
  for (std::size_t s = 0; s < clock.size(); ++s) {
    const std::int64_t covered = static_cast<int>(s) == stream ? clock[s] - 1 : clock[s];
    if (value.last_token[s] > covered) return false;
  }
  return true;
}

// Whether every access of `before` happens before the first access of `after`
// (and is not that instruction itself), so `after` may take its memory.
bool precedes(const Footprint& before, const Footprint& after, const Program& program, const Ordering& ordering) {
  return done_before(before, after.first, program, ordering);
}

// A lower bound on any pool for these conflicts: the heaviest of one clique
// (values that pairwise cannot share memory) per program position. Values
// live there in program order always conflict pairwise; to them we add,
// largest first, values whose accesses are over in program order but not yet
// known complete there (read on a side stream that has not joined back) when
// they conflict with every value chosen. Without side streams this is the
// peak of live bytes.
struct Peak {
  std::int64_t bytes = 0;
  std::vector<ValueId> values;  // the clique counted there
  std::int32_t position = -1;
};
Peak lower_bound(const std::vector<Footprint>& values, const std::vector<std::vector<std::int32_t>>& conflicts,
                 const Program& program, const Ordering& ordering) {
  const auto positions = static_cast<std::int32_t>(program.instructions().size());
  const auto count = static_cast<std::int32_t>(values.size());
  const auto conflict = [&](std::int32_t a, std::int32_t b) {
    return std::binary_search(conflicts[a].begin(), conflicts[a].end(), b);
  };
  Peak peak;
  std::vector<std::int32_t> chosen;
  std::vector<std::int32_t> lingering;
  for (std::int32_t p = 0; p < positions; ++p) {
    chosen.clear();
    lingering.clear();
    std::int64_t weight = 0;
    for (std::int32_t v = 0; v < count; ++v) {
      if (values[v].first > p) continue;
      if (values[v].live_out || values[v].last >= p) {
        chosen.push_back(v);
        weight += values[v].size;
      } else if (!done_before(values[v], p, program, ordering)) {
        // Not monotone in p: a later instruction on the value's own stream is
        // ordered after it while one on another stream may not be.
        lingering.push_back(v);
      }
    }
    std::stable_sort(lingering.begin(), lingering.end(),
                     [&](std::int32_t a, std::int32_t b) { return values[a].size > values[b].size; });
    for (std::int32_t v : lingering) {
      if (std::all_of(chosen.begin(), chosen.end(), [&](std::int32_t c) { return conflict(v, c); })) {
        chosen.push_back(v);
        weight += values[v].size;
      }
    }
    if (weight > peak.bytes || peak.position < 0) {
      peak.bytes = weight;
      peak.position = p;
      peak.values.clear();
      for (std::int32_t v : chosen) peak.values.push_back(values[v].id);
    }
  }
  return peak;
}

}  // namespace

StepPlan plan_step(const Program& program) {
  validate(program);
  Ordering ordering = order(program);
  const std::vector<Footprint> values = footprints(program, ordering);

  const auto count = static_cast<std::int32_t>(values.size());
  std::vector<std::vector<std::int32_t>> conflicts(count);
  for (std::int32_t a = 0; a < count; ++a) {
    for (std::int32_t b = a + 1; b < count; ++b) {
      if (!precedes(values[a], values[b], program, ordering) && !precedes(values[b], values[a], program, ordering)) {
        conflicts[a].push_back(b);
        conflicts[b].push_back(a);
      }
    }
  }

  // Greedy orders; the smallest pool wins. Footprints are numbered by first
  // access, so index order is producer order.
  std::vector<std::int32_t> by_producer(count);
  for (std::int32_t index = 0; index < count; ++index) by_producer[index] = index;
  std::vector<std::int32_t> by_size = by_producer;
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](std::int32_t a, std::int32_t b) { return values[a].size > values[b].size; });
  // Bytes times program-order span: the values hardest to fit in later.
  const auto instruction_count = static_cast<std::int64_t>(program.instructions().size());
  const auto area = [&](const Footprint& value) {
    const std::int64_t last = value.live_out ? instruction_count - 1 : value.last;
    return value.size * (last - value.first + 1);
  };
  std::vector<std::int32_t> by_area = by_producer;
  std::stable_sort(by_area.begin(), by_area.end(),
                   [&](std::int32_t a, std::int32_t b) { return area(values[a]) > area(values[b]); });
  // The longest-lived first (ties: the larger): values saved across the
  // forward and backward then sit low, out of the way of the short-lived.
  const auto span = [&](const Footprint& value) {
    return (value.live_out ? instruction_count - 1 : value.last) - value.first + 1;
  };
  std::vector<std::int32_t> by_span = by_size;
  std::stable_sort(by_span.begin(), by_span.end(),
                   [&](std::int32_t a, std::int32_t b) { return span(values[a]) > span(values[b]); });
  Packing best = pack(values, conflicts, by_size, false);
  for (const bool first_fit : {false, true}) {
    for (const std::vector<std::int32_t>* order : {&by_size, &by_producer, &by_area, &by_span}) {
      Packing packed = pack(values, conflicts, *order, first_fit);
      if (packed.bytes < best.bytes) best = std::move(packed);
    }
  }

  StepPlan plan;
  plan.offsets.assign(program.values().size(), 0);
  for (const ValueInfo& info : program.values()) {
    if (info.kind == ValueKind::kPersistent) plan.offsets[info.id] = -1;
  }
  for (std::int32_t index = 0; index < count; ++index) plan.offsets[values[index].id] = best.offsets[index];
  plan.pool_bytes = best.bytes;
  for (std::vector<std::int32_t>& list : conflicts) std::sort(list.begin(), list.end());
  Peak peak = lower_bound(values, conflicts, program, ordering);
  plan.lower_bound_bytes = peak.bytes;
  plan.peak_values = std::move(peak.values);
  plan.peak_position = peak.position;
  plan.schedule = std::move(ordering.schedule);
  plan.event_count = ordering.event_count;
  plan.segment_ranges = std::move(ordering.segment_ranges);
  return plan;
}

std::vector<std::pair<std::string, std::int64_t>> pool_by_producer(const Program& program, const StepPlan& plan) {
  std::map<std::string, std::int64_t> bytes;
  for (const ValueId id : plan.peak_values) {
    const ValueInfo& value = program.values().at(static_cast<std::size_t>(id));
    const std::string op = value.producer >= 0
                               ? std::string(program.instructions().at(static_cast<std::size_t>(value.producer)).op->name)
                               : std::string("(no producer)");
    bytes[op] += value.bytes();
  }
  std::vector<std::pair<std::string, std::int64_t>> out(bytes.begin(), bytes.end());
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

}  // namespace stepgraph
