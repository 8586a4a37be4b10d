// Learning-rate schedules computed on the device from the optimizer's step
// counter, so a captured step replays with a new rate each time
// and nothing is captured again.
//
// Note [Learning-rate schedule]
// The update about to run is step t = steps_taken + 1 (AdamW's bias
// corrections use the same t). With base rate `base`, floor `min_lr`,
// `warmup` steps and decay over `total` steps in all:
//   t <= warmup                 base * t / warmup      (linear warmup)
//   constant                    base
//   cosine                      min_lr + (base - min_lr) (1 + cos(pi p)) / 2
//   linear                      min_lr + (base - min_lr) (1 - p)
// with p = (t - warmup) / (total - warmup), clamped to [0, 1] (past `total`
// the rate stays at min_lr). lr_at is the one formula, in double and rounded
// once to float, compiled for the host (the reference, and the trainer's
// log) and the device (the kernel); the two agree to within one float ulp
// (the cosine's last bit may differ between libm and CUDA).
//
//   LrSchedule s{.kind = LrScheduleKind::kCosine, .base = 3e-4f, .min_lr = 3e-5f, .warmup = 100, .total = 8000};
//   launch_lr_schedule(s, step_device, lr_device, stream);  // *lr_device = lr_at(s, *step_device + 1)
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#ifdef __CUDACC__
#define SG_LR_HD __host__ __device__
#else
#define SG_LR_HD
#endif

namespace stepgraph::kernels {

enum class LrScheduleKind : std::uint8_t { kConstant, kCosine, kLinear };
std::string_view lr_schedule_kind_name(LrScheduleKind kind);  // "constant", "cosine", "linear"
// The kind of a name; an Error listing the names otherwise.
LrScheduleKind parse_lr_schedule_kind(std::string_view name);

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  float base = 1e-3f;
  float min_lr = 0.0f;       // the floor of the decays
  std::int64_t warmup = 0;   // steps of linear warmup
  std::int64_t total = 0;    // steps in all (cosine, linear: the decay ends there)

  bool operator==(const LrSchedule&) const = default;
  std::string to_string() const;
};

// Error naming the field: base and min_lr finite and >= 0, min_lr <= base,
// warmup >= 0, and for cosine and linear total > warmup.
void check_lr_schedule(const LrSchedule& schedule);

// The rate of update t (t >= 1; Note [Learning-rate schedule]).
SG_LR_HD inline float lr_at(const LrSchedule& s, std::int64_t t) {
  const double base = s.base;
  if (s.warmup > 0 && t <= s.warmup) return static_cast<float>(base * static_cast<double>(t) / static_cast<double>(s.warmup));
  if (s.kind == LrScheduleKind::kConstant) return s.base;
  double p = static_cast<double>(t - s.warmup) / static_cast<double>(s.total - s.warmup);
  p = p < 0.0 ? 0.0 : (p > 1.0 ? 1.0 : p);
  const double span = base - static_cast<double>(s.min_lr);
  const double fraction = s.kind == LrScheduleKind::kCosine ? 0.5 * (1.0 + cos(3.14159265358979323846 * p)) : 1.0 - p;
  return static_cast<float>(static_cast<double>(s.min_lr) + span * fraction);
}

// *lr = lr_at(schedule, *step + 1): one thread, device pointers (`step` the
// optimizer's int64 counter of steps taken). Checks the schedule first.
void launch_lr_schedule(const LrSchedule& schedule, const std::int64_t* step, float* lr, cudaStream_t stream);

}  // namespace stepgraph::kernels
