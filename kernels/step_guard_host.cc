#include <cmath>

#include "engine/error.h"
#include "kernels/step_guard.h"

namespace stepgraph::kernels::host {

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
