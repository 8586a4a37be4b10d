// The fp32 host reference of kernels/rope.h.
#include <cmath>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/attention.h"
#include "kernels/rope.h"

namespace stepgraph::kernels {

void check_rope(const RopeDesc& d) {
  SG_CHECK(d.dtype == DType::kBFloat16 || d.dtype == DType::kFloat16 || d.dtype == DType::kFloat32,
           "rope: dtype must be bf16, fp16 or fp32, got ", dtype_name(d.dtype));
  SG_CHECK(d.tokens > 0 && d.sequences > 0 && d.heads > 0 && d.head_dim > 0,
           "rope: tokens, sequences, heads and head_dim must be > 0, got ", d.tokens, ", ", d.sequences, ", ", d.heads,
           ", ", d.head_dim);
  SG_CHECK(d.rotary_dim >= 0 && d.rotated() <= d.head_dim && d.rotated() % 2 == 0, "rope: rotary_dim (",
           d.rotary_dim, ") must be even and at most head_dim (", d.head_dim, "); 0 rotates all of it");
  SG_CHECK(std::isfinite(d.base) && d.base > 1.0f, "rope: base must be a finite number > 1, got ", d.base);
}

namespace host {
namespace {

// Rotates every token's pairs by `sign` times its angle.
void rotate(const RopeDesc& d, const void* in, const std::int32_t* cu_seqlens, void* out, float sign) {
  check_rope(d);
  const AttentionDesc packing{.dtype = d.dtype, .tokens = d.tokens, .sequences = d.sequences, .heads = 1,
                              .kv_heads = 1, .head_dim = 1};
  check_cu_seqlens(packing, cu_seqlens);
  const std::int64_t half = d.rotated() / 2;
  for (std::int64_t s = 0; s < d.sequences; ++s) {
    for (std::int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
      const auto position = static_cast<float>(t - cu_seqlens[s]);
      for (std::int64_t h = 0; h < d.heads; ++h) {
        const std::int64_t row = (t * d.heads + h) * d.head_dim;
        for (std::int64_t f = 0; f < half; ++f) {
          const float theta = std::pow(d.base, -2.0f * static_cast<float>(f) / static_cast<float>(d.rotated()));
          const float angle = position * theta;
          const float c = std::cos(angle), sn = sign * std::sin(angle);
          const float a = load_as_float(d.dtype, in, row + f);
          const float b = load_as_float(d.dtype, in, row + f + half);
          store_from_float(d.dtype, out, row + f, a * c - b * sn);
          store_from_float(d.dtype, out, row + f + half, b * c + a * sn);
        }
        for (std::int64_t f = d.rotated(); f < d.head_dim; ++f) {
          store_from_float(d.dtype, out, row + f, load_as_float(d.dtype, in, row + f));
        }
      }
    }
  }
}

}  // namespace

void rope_forward(const RopeDesc& desc, const void* x, const std::int32_t* cu_seqlens, void* out) {
  rotate(desc, x, cu_seqlens, out, 1.0f);
}

void rope_backward(const RopeDesc& desc, const void* dy, const std::int32_t* cu_seqlens, void* dx) {
  rotate(desc, dy, cu_seqlens, dx, -1.0f);
}

}  // namespace host
}  // namespace stepgraph::kernels
