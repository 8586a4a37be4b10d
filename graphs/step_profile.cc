#include "graphs/step_profile.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "engine/error.h"

namespace stepgraph {
namespace {

using Interval = std::pair<double, double>;

// The intervals merged where they overlap, sorted.
std::vector<Interval> merged(std::vector<Interval> intervals) {
  std::sort(intervals.begin(), intervals.end());
  std::vector<Interval> out;
  for (const Interval& i : intervals) {
    if (!out.empty() && i.first <= out.back().second) {
      out.back().second = std::max(out.back().second, i.second);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

double length(const std::vector<Interval>& disjoint) {
  double total = 0;
  for (const Interval& i : disjoint) total += i.second - i.first;
  return total;
}

// |a ∩ b| for two sorted disjoint lists.
double overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double total = 0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].first, b[j].first);
    const double hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return total;
}

}  // namespace

StepProfile build_step_profile(const Program& program, const StepPlan& plan,
                               const std::vector<std::vector<OpTiming>>& segment_timings) {
  SG_CHECK_CODE(segment_timings.size() == plan.segment_ranges.size(), ErrorCode::kInternal,
                "step profile: ", segment_timings.size(), " segment timings for ", plan.segment_ranges.size(),
                " segments");
  StepProfile profile;
  profile.stream_busy_us.assign(static_cast<std::size_t>(std::max(program.stream_count(), 1)), 0.0);
  double offset = 0;
  for (std::size_t s = 0; s < plan.segment_ranges.size(); ++s) {
    const StepPlan::Range range = plan.segment_ranges[s];
    const std::vector<OpTiming>& timings = segment_timings[s];
    std::size_t next = 0;
    double segment_end = 0;
    for (std::int32_t e = range.begin; e < range.end; ++e) {
      const ScheduleEntry& entry = plan.schedule[static_cast<std::size_t>(e)];
      if (entry.kind != ScheduleEntry::Kind::kRun) continue;
      SG_CHECK_CODE(next < timings.size(), ErrorCode::kInternal, "step profile: segment ", s, " has more ops than ",
                    timings.size(), " timings");
      const Instruction& instruction = program.instructions()[static_cast<std::size_t>(entry.instruction)];
      const OpTiming t = timings[next++];
      profile.ops.push_back({entry.instruction, std::string(instruction.op->name), entry.stream,
                             instruction.op->collective != nullptr, offset + t.start_us, offset + t.end_us});
      segment_end = std::max(segment_end, t.end_us);
    }
    offset += segment_end;
  }
  std::vector<std::vector<Interval>> per_stream(profile.stream_busy_us.size());
  std::vector<Interval> collectives, compute;
  double first = profile.ops.empty() ? 0 : profile.ops.front().start_us;
  double last = 0;
  for (const ProfiledOp& op : profile.ops) {
    per_stream.at(static_cast<std::size_t>(op.stream)).emplace_back(op.start_us, op.end_us);
    (op.collective ? collectives : compute).emplace_back(op.start_us, op.end_us);
    first = std::min(first, op.start_us);
    last = std::max(last, op.end_us);
  }
  for (std::size_t s = 0; s < per_stream.size(); ++s) profile.stream_busy_us[s] = length(merged(per_stream[s]));
  const std::vector<Interval> communication = merged(collectives);
  profile.communication_us = length(communication);
  profile.exposed_communication_us = profile.communication_us - overlap(communication, merged(compute));
  profile.total_us = last - first;
  return profile;
}

std::vector<ProfiledOpTotal> StepProfile::by_op() const {
  std::vector<ProfiledOpTotal> totals;
  for (const ProfiledOp& op : ops) {
    auto row = std::find_if(totals.begin(), totals.end(),
                            [&](const ProfiledOpTotal& t) { return t.op == op.op && t.stream == op.stream; });
    if (row == totals.end()) row = totals.insert(totals.end(), {op.op, op.stream, 0, 0.0});
    row->count += 1;
    row->total_us += op.end_us - op.start_us;
  }
  std::stable_sort(totals.begin(), totals.end(),
                   [](const ProfiledOpTotal& a, const ProfiledOpTotal& b) { return a.total_us > b.total_us; });
  return totals;
}

std::string StepProfile::to_string() const {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof(line), "step profile: %zu op(s) on %zu stream(s), %.1f us\n", ops.size(),
                stream_busy_us.size(), total_us);
  out += line;
  for (std::size_t s = 0; s < stream_busy_us.size(); ++s) {
    std::snprintf(line, sizeof(line), "  stream %zu busy %.1f us (%.0f%%)\n", s, stream_busy_us[s],
                  total_us > 0 ? 100.0 * stream_busy_us[s] / total_us : 0.0);
    out += line;
  }
  std::snprintf(line, sizeof(line), "  communication %.1f us, exposed %.1f us (%.0f%% of the step)\n", communication_us,
                exposed_communication_us, total_us > 0 ? 100.0 * exposed_communication_us / total_us : 0.0);
  out += line;
  out += "  by op (calls, summed time, share of the step):\n";
  for (const ProfiledOpTotal& t : by_op()) {
    std::snprintf(line, sizeof(line), "    s%d %-28s %5d x %10.1f us %5.1f%%\n", t.stream, t.op.c_str(), t.count,
                  t.total_us, total_us > 0 ? 100.0 * t.total_us / total_us : 0.0);
    out += line;
  }
  out += "  in schedule order:\n";
  for (const ProfiledOp& op : ops) {
    std::snprintf(line, sizeof(line), "  [%d] s%d %10.1f +%9.1f us  %s%s\n", op.instruction, op.stream, op.start_us,
                  op.end_us - op.start_us, op.op.c_str(), op.collective ? "  (collective)" : "");
    out += line;
  }
  return out;
}

}  // namespace stepgraph
