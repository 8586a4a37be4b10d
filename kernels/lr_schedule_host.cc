// The schedule's names and checks (host); lr_at itself is in the header.
#include <array>
#include <cmath>
#include <sstream>
#include <utility>

#include "engine/error.h"
#include "kernels/lr_schedule.h"

namespace stepgraph::kernels {
namespace {

constexpr std::array<std::pair<LrScheduleKind, std::string_view>, 3> kNames{{
    {LrScheduleKind::kConstant, "constant"},
    {LrScheduleKind::kCosine, "cosine"},
    {LrScheduleKind::kLinear, "linear"},
}};

}  // namespace

std::string_view lr_schedule_kind_name(LrScheduleKind kind) {
  for (const auto& [k, name] : kNames) {
    if (k == kind) return name;
  }
  return "unknown";
}

LrScheduleKind parse_lr_schedule_kind(std::string_view name) {
  for (const auto& [kind, n] : kNames) {
    if (n == name) return kind;
  }
  SG_CHECK(false, "unknown learning-rate schedule '", name, "'; use constant, cosine or linear");
  return LrScheduleKind::kConstant;
}

std::string LrSchedule::to_string() const {
  std::ostringstream out;
  out << lr_schedule_kind_name(kind) << " base=" << base;
  if (kind != LrScheduleKind::kConstant) out << " min_lr=" << min_lr << " total=" << total;
  out << " warmup=" << warmup;
  return out.str();
}

void check_lr_schedule(const LrSchedule& s) {
  SG_CHECK(std::isfinite(s.base) && s.base >= 0.0f, "lr schedule: the base rate must be finite and >= 0, got ",
           s.base);
  SG_CHECK(std::isfinite(s.min_lr) && s.min_lr >= 0.0f && s.min_lr <= s.base,
           "lr schedule: min_lr must be finite, >= 0 and <= the base rate ", s.base, ", got ", s.min_lr);
  SG_CHECK(s.warmup >= 0, "lr schedule: warmup steps must be >= 0, got ", s.warmup);
  SG_CHECK(s.kind == LrScheduleKind::kConstant || s.total > s.warmup, "lr schedule: ",
           lr_schedule_kind_name(s.kind), " decays from the end of the warmup (", s.warmup,
           " steps) to the last step; total steps must be larger, got ", s.total);
}

}  // namespace stepgraph::kernels
