#include "graphs/pool_report.h"

#include <algorithm>

#include "engine/error.h"
#include "engine/logging.h"

namespace stepgraph {

std::string_view pool_report_policy_name(PoolReportPolicy policy) {
  switch (policy) {
    case PoolReportPolicy::kWarn: return "warn";
    case PoolReportPolicy::kError: return "error";
    case PoolReportPolicy::kFree: return "free";
  }
  return "unknown";
}

PoolReportPolicy parse_pool_report_policy(std::string_view name) {
  for (PoolReportPolicy policy : {PoolReportPolicy::kWarn, PoolReportPolicy::kError, PoolReportPolicy::kFree}) {
    if (pool_report_policy_name(policy) == name) return policy;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown pool report policy '", name, "'; use warn, error or free");
}

std::int64_t PoolReport::total_bytes() const {
  std::int64_t total = 0;
  for (const PoolReportEntry& entry : entries) total += entry.bytes;
  return total;
}

std::string PoolReport::to_string() const {
  std::string text = std::to_string(entries.size()) + " tensor(s) in the graph pool not returned as outputs";
  if (entries.empty()) return text;
  text += " (" + std::to_string(total_bytes()) + " bytes):";
  for (const PoolReportEntry& entry : entries) {
    text += detail::concat("\n  %", entry.value, " '", entry.name, "' ", entry.meta.shape, " ",
                           dtype_name(entry.meta.dtype), ", ", entry.bytes, " bytes, made by ", entry.producer_op,
                           " (instruction ", entry.producer, ")");
  }
  return text;
}

PoolReport apply_pool_report_policy(TraceResult& traced, PoolReportPolicy policy) {
  PoolReport report = make_pool_report(traced.program, traced.held);
  if (report.empty()) return report;
  switch (policy) {
    case PoolReportPolicy::kError:
      SG_THROW(ErrorCode::kInvalidState, report.to_string(),
               "\nreturn them as outputs of the step, drop the handles before the step returns, or capture "
               "with pool report policy warn (keep them) or free (reuse their memory)");
    case PoolReportPolicy::kWarn:
      logger().warn("{}\n(policy warn: they stay valid until the end of each replay, at the cost of pool memory)",
                    report.to_string());
      for (ValueId id : traced.held) traced.program.value(id).live_out = true;
      return report;
    case PoolReportPolicy::kFree:
      logger().info("{}\n(policy free: their memory is reused; using them is an error)", report.to_string());
      for (ValueId id : traced.held) {
        traced.impls[id]->make_unavailable(
            "was left in the graph pool without being returned as an output, and the pool report policy 'free' "
            "released it; return it as an output to keep it");
        traced.impls[id] = nullptr;
      }
      return report;
  }
  return report;
}

PoolReport make_pool_report(const Program& program, std::span<const ValueId> held) {
  std::vector<ValueId> ids(held.begin(), held.end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  PoolReport report;
  for (ValueId id : ids) {
    const ValueInfo& value = program.value(id);
    SG_CHECK_CODE(value.kind == ValueKind::kPool, ErrorCode::kInternal, "pool report of non-pool value %", id);
    PoolReportEntry entry;
    entry.value = id;
    entry.name = value.name;
    entry.meta = value.meta;
    entry.bytes = value.bytes();
    entry.producer = value.producer;
    entry.producer_op = value.producer >= 0 ? std::string(program.instructions()[value.producer].op->name) : "?";
    report.entries.push_back(std::move(entry));
  }
  return report;
}

}  // namespace stepgraph
