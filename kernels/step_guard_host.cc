#include <cmath>
#include <string>
#include <utility>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/loss_scale_rule.h"
#include "kernels/step_guard.h"

namespace stepgraph::kernels {
namespace {

bool power_of_two(float x) {
  int exponent = 0;
  return std::isfinite(x) && x > 0.0f && std::frexp(x, &exponent) == 0.5f;
}

}  // namespace

void check_loss_scaling(const LossScaling& s) {
  for (const auto& [name, value] : {std::pair<const char*, float>{"initial_scale", s.initial_scale},
                                    {"growth_factor", s.growth_factor},
                                    {"backoff_factor", s.backoff_factor},
                                    {"min_scale", s.min_scale},
                                    {"max_scale", s.max_scale}}) {
    SG_CHECK(power_of_two(value), "loss scaling: ", name, " must be a power of two (so scaling is exact), got ",
             value);
  }
  SG_CHECK(s.growth_factor > 1.0f && s.backoff_factor < 1.0f, "loss scaling: growth_factor must be > 1 and ",
           "backoff_factor < 1, got ", s.growth_factor, " and ", s.backoff_factor);
  SG_CHECK(s.min_scale <= s.initial_scale && s.initial_scale <= s.max_scale, "loss scaling: need min_scale <= ",
           "initial_scale <= max_scale, got ", s.min_scale, ", ", s.initial_scale, ", ", s.max_scale);
  SG_CHECK(s.growth_interval >= 1 && s.growth_interval <= (1 << 24), "loss scaling: growth_interval must be in [1, ",
           "2^24], got ", s.growth_interval);
}

void initial_loss_scale_state(const LossScaling& scaling, float* state_host) {
  check_loss_scaling(scaling);
  state_host[0] = scaling.initial_scale;
  state_host[1] = 1.0f / scaling.initial_scale;
  state_host[2] = 0.0f;
}

}  // namespace stepgraph::kernels

namespace stepgraph::kernels::host {

void loss_scale_update(const LossScaling& scaling, float* state, const std::int32_t* flag) {
  check_loss_scaling(scaling);
  SG_CHECK(state != nullptr && flag != nullptr, "loss_scale_update (host): null pointer");
  loss_scale_step(scaling, state, *flag != 0);
}

void scale_by_loss_scale(DType dtype, void* x, std::int64_t count, const float* state) {
  SG_CHECK(count >= 0 && state != nullptr && (x != nullptr || count == 0), "scale_by_loss_scale (host): bad arguments");
  for (std::int64_t i = 0; i < count; ++i) store_from_float(dtype, x, i, load_as_float(dtype, x, i) * state[0]);
}

void flag_nonfinite(const float* x, std::int64_t count, std::int32_t* flag) {
  SG_CHECK(count >= 0 && flag != nullptr && (x != nullptr || count == 0), "flag_nonfinite (host): bad arguments");
  for (std::int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(x[i])) {
      *flag = 1;
      return;
    }
  }
}

void count_and_clear_flag(std::int32_t* flag, std::int64_t* skipped) {
  SG_CHECK(flag != nullptr && skipped != nullptr, "count_and_clear_flag (host): null pointer");
  if (*flag != 0) *skipped += 1;
  *flag = 0;
}

}  // namespace stepgraph::kernels::host
