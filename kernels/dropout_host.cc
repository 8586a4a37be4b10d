#include <cmath>
#include <cstring>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/dropout.h"
#include "kernels/philox.h"

namespace stepgraph::kernels {

void check_dropout(const DropoutDesc& d) {
  SG_CHECK(d.count >= 0, "dropout: count must be >= 0, got ", d.count);
  SG_CHECK(std::isfinite(d.p) && d.p >= 0.0f && d.p < 1.0f, "dropout: p must be in [0, 1), got ", d.p);
  SG_CHECK(d.offset >= 0, "dropout: offset must be >= 0, got ", d.offset);
  SG_CHECK(d.dtype == DType::kFloat32 || d.dtype == DType::kBFloat16 || d.dtype == DType::kFloat16,
           "dropout: dtype must be fp32, bf16 or fp16, got ", dtype_name(d.dtype));
}

std::uint32_t dropout_threshold(float p) {
  return static_cast<std::uint32_t>(std::min(std::llround(static_cast<double>(p) * 4294967296.0), 4294967295LL));
}

namespace host {

void dropout(const DropoutDesc& d, const void* x, void* y, const std::int64_t* state) {
  check_dropout(d);
  SG_CHECK(state != nullptr && (d.count == 0 || (x != nullptr && y != nullptr)), "dropout (host): null pointer");
  const std::uint32_t threshold = dropout_threshold(d.p);
  const float scale = 1.0f / (1.0f - d.p);
  const auto seed = static_cast<std::uint64_t>(state[0]);
  const auto first = static_cast<std::uint64_t>(state[1] + d.offset);
  for (std::int64_t draw = 0; draw < dropout_draws(d.count); ++draw) {
    const Philox4 r = philox4x32_10(first + static_cast<std::uint64_t>(draw), 0, seed);
    for (int k = 0; k < 4 && 4 * draw + k < d.count; ++k) {
      const std::int64_t i = 4 * draw + k;
      const bool keep = r.v[k] >= threshold;
      switch (d.dtype) {
        case DType::kFloat32:
          static_cast<float*>(y)[i] = keep ? static_cast<const float*>(x)[i] * scale : 0.0f;
          break;
        case DType::kBFloat16:
          static_cast<std::uint16_t*>(y)[i] =
              float_to_bf16(keep ? bf16_to_float(static_cast<const std::uint16_t*>(x)[i]) * scale : 0.0f);
          break;
        default:
          static_cast<std::uint16_t*>(y)[i] =
              float_to_fp16(keep ? fp16_to_float(static_cast<const std::uint16_t*>(x)[i]) * scale : 0.0f);
          break;
      }
    }
  }
}

void rng_advance(std::int64_t* state, std::int64_t draws) {
  SG_CHECK(state != nullptr && draws >= 0, "rng_advance (host): bad arguments");
  state[1] += draws;
}

}  // namespace host
}  // namespace stepgraph::kernels
