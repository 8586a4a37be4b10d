// The plain fp32 reference of kernels/attention.h: each sequence (or
// segment), head and query on its own, in order, with the scores of one query
// materialised (the device kernels never materialise them). Self-attention
// and segment attention share the arithmetic (forward_rows, backward_rows)
// and differ only in the keys each query sees.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/error.h"
#include "engine/half_precision.h"
#include "kernels/attention.h"

namespace stepgraph::kernels {

float AttentionDesc::softmax_scale() const {
  return scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

void check_attention(const AttentionDesc& d) {
  SG_CHECK(d.dtype == DType::kBFloat16 || d.dtype == DType::kFloat16 || d.dtype == DType::kFloat32,
           "attention: dtype must be bf16, fp16 or fp32, got ", dtype_name(d.dtype));
  SG_CHECK(d.tokens > 0 && d.sequences > 0 && d.heads > 0 && d.kv_heads > 0 && d.head_dim > 0,
           "attention: tokens, sequences, heads, kv_heads and head_dim must be > 0, got ", d.tokens, ", ", d.sequences,
           ", ", d.heads, ", ", d.kv_heads, ", ", d.head_dim);
  SG_CHECK(d.heads % d.kv_heads == 0, "attention: kv_heads (", d.kv_heads, ") must divide heads (", d.heads,
           "): each kv head serves heads / kv_heads query heads");
  SG_CHECK(std::isfinite(d.scale) && d.scale >= 0.0f, "attention: scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got ",
           d.scale);
}

void check_segment_attention(const SegmentAttentionDesc& desc) {
  check_attention(desc.attention);
  SG_CHECK(desc.kv_tokens > 0, "segment attention: kv_tokens must be > 0, got ", desc.kv_tokens);
}

namespace host {
namespace {

// Element (token, head, dim) of a [T, heads, D] tensor, and its index.
struct Heads {
  DType dtype;
  std::int64_t heads, dim;
  std::int64_t at(std::int64_t token, std::int64_t head, std::int64_t d) const {
    return (token * heads + head) * dim + d;
  }
  float load(const void* base, std::int64_t token, std::int64_t head, std::int64_t d) const {
    return load_as_float(dtype, base, at(token, head, d));
  }
};

float dot(const Heads& a, const void* pa, std::int64_t ta, std::int64_t ha, const Heads& b, const void* pb,
          std::int64_t tb, std::int64_t hb) {
  float sum = 0.0f;
  for (std::int64_t d = 0; d < a.dim; ++d) sum += a.load(pa, ta, ha, d) * b.load(pb, tb, hb, d);
  return sum;
}

// The loop the self-attention passes share (desc checked): check
// cu_seqlens, then visit(i, h, g, first, last) for each query token i of each
// sequence [begin, end) and each query head h (kv head g), in that order,
// with the keys it sees [first, last).
template <typename Visit>
void for_each_query(const AttentionDesc& desc, const std::int32_t* cu_seqlens, Visit&& visit) {
  check_cu_seqlens(desc, cu_seqlens);
  const std::int64_t group = desc.heads / desc.kv_heads;
  for (std::int64_t s = 0; s < desc.sequences; ++s) {
    const std::int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
    for (std::int64_t h = 0; h < desc.heads; ++h) {
      for (std::int64_t i = begin; i < end; ++i) visit(i, h, h / group, begin, desc.causal ? i + 1 : end);
    }
  }
}

// The same over segments (Note [Segment attention]): segment by segment,
// head by head, query by query.
template <typename Visit>
void for_each_segment_query(const SegmentAttentionDesc& desc, const std::int32_t* q_offsets,
                            const std::int32_t* kv_ranges, Visit&& visit) {
  check_segments(desc, q_offsets, kv_ranges);
  const AttentionDesc& a = desc.attention;
  const std::int64_t group = a.heads / a.kv_heads;
  for (std::int64_t s = 0; s < a.sequences; ++s) {
    const std::int64_t q_begin = q_offsets[s], q_len = q_offsets[s + 1] - q_begin;
    const std::int64_t k_begin = kv_ranges[2 * s], k_len = kv_ranges[2 * s + 1] - k_begin;
    for (std::int64_t h = 0; h < a.heads; ++h) {
      for (std::int64_t j = 0; j < q_len; ++j) {
        visit(q_begin + j, h, h / group, k_begin, k_begin + segment_visible_keys(a.causal, q_len, k_len, j));
      }
    }
  }
}

// out and lse of the queries a loop visits: keys [first, last) of k, v.
// A query that sees no key gets out 0 and lse -inf.
template <typename Loop>
void forward_rows(const AttentionDesc& desc, const void* q, const void* k, const void* v, void* out, float* lse,
                  Loop&& loop) {
  const Heads qh{desc.dtype, desc.heads, desc.head_dim};
  const Heads kvh{desc.dtype, desc.kv_heads, desc.head_dim};
  const float scale = desc.softmax_scale();
  std::vector<float> p;
  std::vector<float> acc(static_cast<std::size_t>(desc.head_dim));
  loop([&](std::int64_t i, std::int64_t h, std::int64_t g, std::int64_t first, std::int64_t last) {
    p.assign(static_cast<std::size_t>(last - first), 0.0f);
    float max = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = first; j < last; ++j) {
      p[j - first] = scale * dot(qh, q, i, h, kvh, k, j, g);
      max = std::max(max, p[j - first]);
    }
    float sum = 0.0f;
    for (float& x : p) {
      x = std::exp(x - max);
      sum += x;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t j = first; j < last; ++j) {
      for (std::int64_t d = 0; d < desc.head_dim; ++d) acc[d] += p[j - first] * kvh.load(v, j, g, d);
    }
    for (std::int64_t d = 0; d < desc.head_dim; ++d) {
      store_from_float(desc.dtype, out, qh.at(i, h, d), last > first ? acc[d] / sum : 0.0f);
    }
    lse[h * desc.tokens + i] = last > first ? max + std::log(sum) : -std::numeric_limits<float>::infinity();
  });
}

// dq (desc.tokens rows) and dk, dv (kv_tokens rows) of the queries a loop visits.
template <typename Loop>
void backward_rows(const AttentionDesc& desc, std::int64_t kv_tokens, const void* q, const void* k, const void* v,
                   const void* out, const float* lse, const void* dout, void* dq, void* dk, void* dv, Loop&& loop) {
  const Heads qh{desc.dtype, desc.heads, desc.head_dim};
  const Heads kvh{desc.dtype, desc.kv_heads, desc.head_dim};
  const float scale = desc.softmax_scale();
  const auto q_size = static_cast<std::size_t>(desc.tokens * desc.heads * desc.head_dim);
  const auto kv_size = static_cast<std::size_t>(kv_tokens * desc.kv_heads * desc.head_dim);
  std::vector<float> dq32(q_size, 0.0f), dk32(kv_size, 0.0f), dv32(kv_size, 0.0f);
  loop([&](std::int64_t i, std::int64_t h, std::int64_t g, std::int64_t first, std::int64_t last) {
    const float delta = dot(qh, dout, i, h, qh, out, i, h);
    const float row_lse = lse[h * desc.tokens + i];
    for (std::int64_t j = first; j < last; ++j) {
      const float p = std::exp(scale * dot(qh, q, i, h, kvh, k, j, g) - row_lse);
      const float dp = dot(qh, dout, i, h, kvh, v, j, g);
      const float ds = p * (dp - delta);
      for (std::int64_t d = 0; d < desc.head_dim; ++d) {
        dv32[kvh.at(j, g, d)] += p * qh.load(dout, i, h, d);
        dq32[qh.at(i, h, d)] += scale * ds * kvh.load(k, j, g, d);
        dk32[kvh.at(j, g, d)] += scale * ds * qh.load(q, i, h, d);
      }
    }
  });
  for (std::size_t e = 0; e < q_size; ++e) store_from_float(desc.dtype, dq, static_cast<std::int64_t>(e), dq32[e]);
  for (std::size_t e = 0; e < kv_size; ++e) {
    store_from_float(desc.dtype, dk, static_cast<std::int64_t>(e), dk32[e]);
    store_from_float(desc.dtype, dv, static_cast<std::int64_t>(e), dv32[e]);
  }
}

}  // namespace

void check_cu_seqlens(const AttentionDesc& desc, const std::int32_t* cu_seqlens) {
  SG_CHECK(cu_seqlens != nullptr, "attention: cu_seqlens is null");
  SG_CHECK(cu_seqlens[0] == 0, "attention: cu_seqlens[0] must be 0, got ", cu_seqlens[0]);
  for (std::int64_t s = 0; s < desc.sequences; ++s) {
    SG_CHECK(cu_seqlens[s + 1] >= cu_seqlens[s], "attention: cu_seqlens must not decrease: [", s, "] = ",
             cu_seqlens[s], ", [", s + 1, "] = ", cu_seqlens[s + 1]);
  }
  SG_CHECK(cu_seqlens[desc.sequences] == desc.tokens, "attention: cu_seqlens[", desc.sequences,
           "] must be the token count ", desc.tokens, ", got ", cu_seqlens[desc.sequences]);
}

void check_segments(const SegmentAttentionDesc& desc, const std::int32_t* q_offsets, const std::int32_t* kv_ranges) {
  SG_CHECK(q_offsets != nullptr && kv_ranges != nullptr, "segment attention: q_offsets and kv_ranges must not be null");
  const AttentionDesc& a = desc.attention;
  SG_CHECK(q_offsets[0] == 0, "segment attention: q_offsets[0] must be 0, got ", q_offsets[0]);
  for (std::int64_t s = 0; s < a.sequences; ++s) {
    SG_CHECK(q_offsets[s + 1] >= q_offsets[s], "segment attention: q_offsets must not decrease: [", s, "] = ",
             q_offsets[s], ", [", s + 1, "] = ", q_offsets[s + 1]);
    const std::int64_t begin = kv_ranges[2 * s], end = kv_ranges[2 * s + 1];
    SG_CHECK(0 <= begin && begin <= end && end <= desc.kv_tokens, "segment attention: kv_ranges[", s, "] = [", begin,
             ", ", end, ") must lie in [0, ", desc.kv_tokens, ") with begin <= end");
  }
  SG_CHECK(q_offsets[a.sequences] == a.tokens, "segment attention: q_offsets[", a.sequences,
           "] must be the query token count ", a.tokens, ", got ", q_offsets[a.sequences]);
}

void attention_forward(const AttentionDesc& desc, const void* q, const void* k, const void* v,
                       const std::int32_t* cu_seqlens, void* out, float* lse) {
  check_attention(desc);  // before the sizes are computed from desc
  forward_rows(desc, q, k, v, out, lse, [&](auto&& visit) { for_each_query(desc, cu_seqlens, visit); });
}

void attention_backward(const AttentionDesc& desc, const void* q, const void* k, const void* v, const void* out,
                        const float* lse, const void* dout, const std::int32_t* cu_seqlens, void* dq, void* dk,
                        void* dv) {
  check_attention(desc);
  backward_rows(desc, desc.tokens, q, k, v, out, lse, dout, dq, dk, dv,
                [&](auto&& visit) { for_each_query(desc, cu_seqlens, visit); });
}

void segment_attention_forward(const SegmentAttentionDesc& desc, const void* q, const void* k, const void* v,
                               const std::int32_t* q_offsets, const std::int32_t* kv_ranges, void* out, float* lse) {
  check_segment_attention(desc);
  forward_rows(desc.attention, q, k, v, out, lse,
               [&](auto&& visit) { for_each_segment_query(desc, q_offsets, kv_ranges, visit); });
}

void segment_attention_backward(const SegmentAttentionDesc& desc, const void* q, const void* k, const void* v,
                                const void* out, const float* lse, const void* dout, const std::int32_t* q_offsets,
                                const std::int32_t* kv_ranges, void* dq, void* dk, void* dv) {
  check_segment_attention(desc);
  backward_rows(desc.attention, desc.kv_tokens, q, k, v, out, lse, dout, dq, dk, dv,
                [&](auto&& visit) { for_each_segment_query(desc, q_offsets, kv_ranges, visit); });
}

}  // namespace host
}  // namespace stepgraph::kernels
