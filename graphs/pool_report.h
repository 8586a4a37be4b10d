// PoolReport: the pool values a traced step left alive without returning them.
//
// After tracing, every pool value whose handle the caller still holds and that
// is not a declared output is listed with its name, shape, bytes and the op
// that made it. Such a tensor either pins pool memory for good (its value must
// survive the step) or, if the memory is reused, reads garbage after replay.
// The capture's policy decides:
//   warn   keep it valid (it lives to the end of the step) and log the report;
//   error  raise an Error with the report (use this in tests);
//   free   let the planner reuse its memory; using the handle is an Error.
// CUDA-free.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/op.h"
#include "graphs/program.h"
#include "graphs/tracer.h"

namespace stepgraph {

enum class PoolReportPolicy : std::uint8_t { kWarn, kError, kFree };
std::string_view pool_report_policy_name(PoolReportPolicy policy);  // "warn", "error", "free"
PoolReportPolicy parse_pool_report_policy(std::string_view name);

struct PoolReportEntry {
  ValueId value = -1;
  std::string name;
  TensorMeta meta;
  std::int64_t bytes = 0;
  std::string producer_op;
  std::int32_t producer = -1;  // instruction index
};

struct PoolReport {
  std::vector<PoolReportEntry> entries;

  bool empty() const { return entries.empty(); }
  std::int64_t total_bytes() const;
  // "2 tensor(s) in the graph pool not returned as outputs:" and one line each.
  std::string to_string() const;
};

// The report for pool values `held` (ids in `program`), in value order.
PoolReport make_pool_report(const Program& program, std::span<const ValueId> held);

// Makes the report of a finished trace and applies `policy` to it: error
// throws the report with what to do; warn logs it and marks the values
// live_out (the planner keeps their memory); free logs it and makes the held
// tensors unavailable (their memory is reused). Every word a user reads
// about the policy is written here.
PoolReport apply_pool_report_policy(TraceResult& traced, PoolReportPolicy policy);

}  // namespace stepgraph
