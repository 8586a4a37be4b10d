// The fp32 host reference of kernels/rope.h.
#include <cmath>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/attention.h"
#include "kernels/rope.h"
#include "kernels/rope_theta.h"

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

void check_qkv_rope(const RopeDesc& d, std::int64_t kv_heads) {
  check_rope(d);
  SG_CHECK(kv_heads > 0 && d.heads % kv_heads == 0, "qkv split: kv_heads (", kv_heads,
           ") must be > 0 and divide the query heads (", d.heads, ")");
}

namespace host {
namespace {

// Each token's position in its sequence (cu_seqlens checked).
std::vector<float> positions(const RopeDesc& d, const std::int32_t* cu_seqlens) {
  const AttentionDesc packing{.dtype = d.dtype, .tokens = d.tokens, .sequences = d.sequences, .heads = 1,
                              .kv_heads = 1, .head_dim = 1};
  check_cu_seqlens(packing, cu_seqlens);
  std::vector<float> out(static_cast<std::size_t>(d.tokens));
  for (std::int64_t s = 0; s < d.sequences; ++s) {
    for (std::int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) out[t] = static_cast<float>(t - cu_seqlens[s]);
  }
  return out;
}

// One head's D features from in (element in_at) to out (element out_at),
// the first rotated() rotated by `sign` times the angles of `position`, the
// rest copied. Reads the pair before writing it, so in may equal out.
void rotate_head(const RopeDesc& d, const void* in, std::int64_t in_at, void* out, std::int64_t out_at,
                 float position, float sign) {
  const std::int64_t half = d.rotated() / 2;
  const double log2_base = std::log2(static_cast<double>(d.base));
  for (std::int64_t f = 0; f < half; ++f) {
    const float theta = rope_theta(static_cast<int>(f), static_cast<int>(d.rotated()), log2_base);
    const float angle = position * theta;
    const float c = std::cos(angle), sn = sign * std::sin(angle);
    const float a = load_as_float(d.dtype, in, in_at + f);
    const float b = load_as_float(d.dtype, in, in_at + f + half);
    store_from_float(d.dtype, out, out_at + f, a * c - b * sn);
    store_from_float(d.dtype, out, out_at + f + half, b * c + a * sn);
  }
  for (std::int64_t f = d.rotated(); f < d.head_dim; ++f) {
    store_from_float(d.dtype, out, out_at + f, load_as_float(d.dtype, in, in_at + f));
  }
}

void copy_head(const RopeDesc& d, const void* in, std::int64_t in_at, void* out, std::int64_t out_at) {
  for (std::int64_t f = 0; f < d.head_dim; ++f) {
    store_from_float(d.dtype, out, out_at + f, load_as_float(d.dtype, in, in_at + f));
  }
}

void rotate(const RopeDesc& d, const void* in, const std::int32_t* cu_seqlens, void* out, float sign) {
  check_rope(d);
  const std::vector<float> position = positions(d, cu_seqlens);
  for (std::int64_t t = 0; t < d.tokens; ++t) {
    for (std::int64_t h = 0; h < d.heads; ++h) {
      const std::int64_t row = (t * d.heads + h) * d.head_dim;
      rotate_head(d, in, row, out, row, position[t], sign);
    }
  }
}

// Visits every head of the packed qkv rows: fn(part, t, head in part, element
// of the head in qkv, element of the head in its own tensor); part 0, 1, 2 is
// q, k, v.
template <typename Fn>
void for_each_qkv_head(const RopeDesc& d, std::int64_t kv_heads, Fn&& fn) {
  const std::int64_t width = d.heads + 2 * kv_heads;
  for (std::int64_t t = 0; t < d.tokens; ++t) {
    for (std::int64_t g = 0; g < width; ++g) {
      const int part = g < d.heads ? 0 : (g < d.heads + kv_heads ? 1 : 2);
      const std::int64_t h = part == 0 ? g : (part == 1 ? g - d.heads : g - d.heads - kv_heads);
      const std::int64_t heads_of_part = part == 0 ? d.heads : kv_heads;
      fn(part, t, (t * width + g) * d.head_dim, (t * heads_of_part + h) * d.head_dim);
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

namespace {

void split_at(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv, const std::vector<float>& position, void* q,
              void* k, void* v) {
  for_each_qkv_head(desc, kv_heads, [&](int part, std::int64_t t, std::int64_t packed_at, std::int64_t at) {
    if (part == 2) {
      copy_head(desc, qkv, packed_at, v, at);
    } else {
      rotate_head(desc, qkv, packed_at, part == 0 ? q : k, at, position[t], 1.0f);
    }
  });
}

void merge_at(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk, const void* dv,
              const std::vector<float>& position, void* dqkv) {
  for_each_qkv_head(desc, kv_heads, [&](int part, std::int64_t t, std::int64_t packed_at, std::int64_t at) {
    if (part == 2) {
      copy_head(desc, dv, at, dqkv, packed_at);
    } else {
      rotate_head(desc, part == 0 ? dq : dk, at, dqkv, packed_at, position[t], -1.0f);
    }
  });
}

std::vector<float> given_positions(const RopeDesc& desc, const std::int32_t* positions) {
  std::vector<float> out(static_cast<std::size_t>(desc.tokens));
  for (std::int64_t t = 0; t < desc.tokens; ++t) out[t] = static_cast<float>(positions[t]);
  return out;
}

}  // namespace

void qkv_split_rope(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv, const std::int32_t* cu_seqlens,
                    void* q, void* k, void* v) {
  check_qkv_rope(desc, kv_heads);
  split_at(desc, kv_heads, qkv, positions(desc, cu_seqlens), q, k, v);
}

void qkv_merge_rope_backward(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                             const void* dv, const std::int32_t* cu_seqlens, void* dqkv) {
  check_qkv_rope(desc, kv_heads);
  merge_at(desc, kv_heads, dq, dk, dv, positions(desc, cu_seqlens), dqkv);
}

void qkv_split_rope_at(const RopeDesc& desc, std::int64_t kv_heads, const void* qkv, const std::int32_t* positions,
                       void* q, void* k, void* v) {
  check_qkv_rope(desc, kv_heads);
  split_at(desc, kv_heads, qkv, given_positions(desc, positions), q, k, v);
}

void qkv_merge_rope_backward_at(const RopeDesc& desc, std::int64_t kv_heads, const void* dq, const void* dk,
                                const void* dv, const std::int32_t* positions, void* dqkv) {
  check_qkv_rope(desc, kv_heads);
  merge_at(desc, kv_heads, dq, dk, dv, given_positions(desc, positions), dqkv);
}

}  // namespace host
}  // namespace stepgraph::kernels
