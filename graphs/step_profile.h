// StepProfile: when each op of a captured step ran, on which stream, how
// busy each stream was and how much communication was exposed, so a user can
// see whether overlap worked.
//
// CapturedStep::profile() runs the step's schedule once more with a timing
// mark around every op (Backend::profile: on cuda the schedule issued on the
// streams with timing events, not captured, since CUDA cannot time events
// recorded in a graph: the streams overlap as in a replay, but between small
// ops the host's launch rate may show as gaps; on host the references in
// order, which shows the schedule and host times). CUDA-free.
//
//   StepProfile p = step->profile();
//   std::cout << p.to_string();
//   // 3 stream(s), 1,234.5 us; stream 0 busy 1,100.2 us, stream 2 (collectives) 300.1 us;
//   // communication 300.1 us, exposed 40.3 us (13%)
#pragma once

#include <string>
#include <vector>

#include "engine/backend.h"
#include "graphs/planner.h"
#include "graphs/program.h"

namespace stepgraph {

struct ProfiledOp {
  std::int32_t instruction = -1;
  std::string op;
  int stream = 0;
  bool collective = false;
  double start_us = 0;
  double end_us = 0;
};

// One op name on one stream, summed over the step (StepProfile::by_op).
struct ProfiledOpTotal {
  std::string op;
  int stream = 0;
  int count = 0;
  double total_us = 0;  // the sum of its calls' durations
};

struct StepProfile {
  std::vector<ProfiledOp> ops;          // in schedule order
  double total_us = 0;                  // the first start to the last end
  std::vector<double> stream_busy_us;   // per stream: the union of its ops' intervals
  double communication_us = 0;          // the union of the collectives' intervals
  double exposed_communication_us = 0;  // of that, the time no other op ran

  // Every (op name, stream) pair's calls and summed time, the largest first:
  // the table an optimisation starts from. Ties keep the schedule's order.
  std::vector<ProfiledOpTotal> by_op() const;

  // The summary, the by_op table (each row's share of total_us), then one
  // line per op (stream, start, duration, name).
  std::string to_string() const;
};

// The profile of `program` from the per-segment timings of its plan's
// schedule (segments ran back to back; each segment's times start at 0).
StepProfile build_step_profile(const Program& program, const StepPlan& plan,
                               const std::vector<std::vector<OpTiming>>& segment_timings);

}  // namespace stepgraph
