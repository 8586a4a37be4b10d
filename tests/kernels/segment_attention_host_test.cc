// Segment attention's host reference (Note [Segment attention] in
// kernels/attention.h): self-attention written as segments gives the
// self-attention reference's bits; arbitrary tables (keys read by several
// segments, keys read by none, queries that see no key, empty segments,
// GQA, causal and not) against a naive double implementation of the Note;
// errors. Random values whose seed a failure prints.
//
// Tolerance: the reference adds in fp32, the naive one in double; 1e-5 of
// the tensor's largest value covers the rounding of a few dozen fp32 terms
// (as attention_host_test); a wrong mask or a lost segment is off by O(1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

std::vector<float> random_values(std::mt19937& rng, std::int64_t n) {
  std::normal_distribution<float> normal;
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = normal(rng);
  return out;
}

// A segment table and the tensors it reads.
struct Problem {
  SegmentAttentionDesc desc;
  std::vector<std::int32_t> q_offsets, kv_ranges;
  std::vector<float> q, k, v, dout;
};

Problem make_problem(std::mt19937& rng, const std::vector<std::int32_t>& q_lengths,
                     const std::vector<std::pair<std::int32_t, std::int32_t>>& ranges, std::int64_t kv_tokens,
                     std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, bool causal) {
  Problem p;
  p.q_offsets = {0};
  for (std::int32_t l : q_lengths) p.q_offsets.push_back(p.q_offsets.back() + l);
  for (const auto& [b, e] : ranges) {
    p.kv_ranges.push_back(b);
    p.kv_ranges.push_back(e);
  }
  p.desc = {.attention = {.dtype = DType::kFloat32,
                          .tokens = p.q_offsets.back(),
                          .sequences = static_cast<std::int64_t>(q_lengths.size()),
                          .heads = heads,
                          .kv_heads = kv_heads,
                          .head_dim = dim,
                          .causal = causal},
            .kv_tokens = kv_tokens};
  const std::int64_t tq = p.desc.attention.tokens;
  p.q = random_values(rng, tq * heads * dim);
  p.k = random_values(rng, kv_tokens * kv_heads * dim);
  p.v = random_values(rng, kv_tokens * kv_heads * dim);
  p.dout = random_values(rng, tq * heads * dim);
  return p;
}

struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

Results run_segments(const Problem& p) {
  const AttentionDesc& a = p.desc.attention;
  Results r{std::vector<float>(p.q.size()), std::vector<float>(static_cast<std::size_t>(a.heads * a.tokens)),
            std::vector<float>(p.q.size()), std::vector<float>(p.k.size()), std::vector<float>(p.v.size())};
  host::segment_attention_forward(p.desc, p.q.data(), p.k.data(), p.v.data(), p.q_offsets.data(), p.kv_ranges.data(),
                                  r.out.data(), r.lse.data());
  host::segment_attention_backward(p.desc, p.q.data(), p.k.data(), p.v.data(), r.out.data(), r.lse.data(),
                                   p.dout.data(), p.q_offsets.data(), p.kv_ranges.data(), r.dq.data(), r.dk.data(),
                                   r.dv.data());
  return r;
}

// The Note in double: each query's visible keys, P, dP, dS materialised.
struct Naive {
  std::vector<double> out, lse, dq, dk, dv;
};

Naive naive(const Problem& p) {
  const AttentionDesc& a = p.desc.attention;
  const std::int64_t D = a.head_dim, H = a.heads, Hkv = a.kv_heads, group = H / Hkv;
  const double scale = a.softmax_scale();
  Naive n{std::vector<double>(p.q.size(), 0.0), std::vector<double>(static_cast<std::size_t>(H * a.tokens), 0.0),
          std::vector<double>(p.q.size(), 0.0), std::vector<double>(p.k.size(), 0.0),
          std::vector<double>(p.v.size(), 0.0)};
  auto qi = [&](std::int64_t i, std::int64_t h, std::int64_t e) { return (i * H + h) * D + e; };
  auto ki = [&](std::int64_t j, std::int64_t g, std::int64_t e) { return (j * Hkv + g) * D + e; };
  for (std::int64_t s = 0; s < a.sequences; ++s) {
    const std::int64_t qb = p.q_offsets[s], ql = p.q_offsets[s + 1] - qb;
    const std::int64_t kb = p.kv_ranges[2 * s], kl = p.kv_ranges[2 * s + 1] - kb;
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / group;
      for (std::int64_t j = 0; j < ql; ++j) {
        const std::int64_t i = qb + j;
        const std::int64_t seen = a.causal ? std::clamp<std::int64_t>(kl - ql + j + 1, 0, kl) : kl;
        if (seen == 0) {
          n.lse[h * a.tokens + i] = -std::numeric_limits<double>::infinity();
          continue;
        }
        std::vector<double> x(static_cast<std::size_t>(seen));
        double max = -1e300, sum = 0.0;
        for (std::int64_t t = 0; t < seen; ++t) {
          double dot = 0.0;
          for (std::int64_t e = 0; e < D; ++e) dot += static_cast<double>(p.q[qi(i, h, e)]) * p.k[ki(kb + t, g, e)];
          x[t] = scale * dot;
          max = std::max(max, x[t]);
        }
        for (double& w : x) sum += (w = std::exp(w - max));
        for (double& w : x) w /= sum;
        n.lse[h * a.tokens + i] = max + std::log(sum);
        double delta = 0.0;
        for (std::int64_t t = 0; t < seen; ++t) {
          for (std::int64_t e = 0; e < D; ++e) n.out[qi(i, h, e)] += x[t] * p.v[ki(kb + t, g, e)];
        }
        for (std::int64_t e = 0; e < D; ++e) delta += n.out[qi(i, h, e)] * p.dout[qi(i, h, e)];
        for (std::int64_t t = 0; t < seen; ++t) {
          double dp = 0.0;
          for (std::int64_t e = 0; e < D; ++e) dp += static_cast<double>(p.dout[qi(i, h, e)]) * p.v[ki(kb + t, g, e)];
          const double ds = x[t] * (dp - delta);
          for (std::int64_t e = 0; e < D; ++e) {
            n.dv[ki(kb + t, g, e)] += x[t] * p.dout[qi(i, h, e)];
            n.dq[qi(i, h, e)] += scale * ds * p.k[ki(kb + t, g, e)];
            n.dk[ki(kb + t, g, e)] += scale * ds * p.q[qi(i, h, e)];
          }
        }
      }
    }
  }
  return n;
}

// max |got - want| <= 1e-5 max |want| (and the same infinities).
void expect_close(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  double scale = 1.0, worst = 0.0;
  for (std::size_t e = 0; e < want.size(); ++e) {
    if (std::isinf(want[e])) {
      EXPECT_EQ(got[e], static_cast<float>(want[e])) << what << " element " << e;
      continue;
    }
    scale = std::max(scale, std::abs(want[e]));
    worst = std::max(worst, std::abs(want[e] - got[e]));
  }
  EXPECT_LE(worst, 1e-5 * scale) << what;
}

TEST(SegmentAttentionHostTest, SelfAttentionAsSegmentsGivesTheSelfAttentionBits) {
  testing::SeededRng rng;
  for (const bool causal : {true, false}) {
    const std::vector<std::int32_t> lengths{3, 0, 1, 6, 2};
    std::vector<std::pair<std::int32_t, std::int32_t>> ranges;
    std::int32_t start = 0;
    for (std::int32_t l : lengths) {
      ranges.emplace_back(start, start + l);
      start += l;
    }
    const Problem p = make_problem(rng, lengths, ranges, start, 4, 2, 8, causal);
    const Results seg = run_segments(p);
    const AttentionDesc self = p.desc.attention;  // cu_seqlens = q_offsets
    Results want{std::vector<float>(p.q.size()), std::vector<float>(seg.lse.size()), std::vector<float>(p.q.size()),
                 std::vector<float>(p.k.size()), std::vector<float>(p.v.size())};
    host::attention_forward(self, p.q.data(), p.k.data(), p.v.data(), p.q_offsets.data(), want.out.data(),
                            want.lse.data());
    host::attention_backward(self, p.q.data(), p.k.data(), p.v.data(), want.out.data(), want.lse.data(), p.dout.data(),
                             p.q_offsets.data(), want.dq.data(), want.dk.data(), want.dv.data());
    const std::string mode = causal ? "causal" : "full";
    EXPECT_EQ(seg.out, want.out) << mode;
    EXPECT_EQ(seg.lse, want.lse) << mode;
    EXPECT_EQ(seg.dq, want.dq) << mode;
    EXPECT_EQ(seg.dk, want.dk) << mode;
    EXPECT_EQ(seg.dv, want.dv) << mode;
  }
}

TEST(SegmentAttentionHostTest, ArbitraryTablesMatchNaiveDoubleWithSharedUnreadAndShortRanges) {
  testing::SeededRng rng;
  // 12 kv tokens; segment 0 reads [0, 5) with 2 queries (bottom-right: keys
  // up to 3 and 4), segment 1 is empty, segment 2 reads [0, 9) too (keys 0-4
  // shared with segment 0), segment 3 reads [10, 12) with 4 queries (the
  // first two see no key when causal); keys 9 are read by nobody.
  const std::vector<std::int32_t> q_lengths{2, 0, 3, 4};
  const std::vector<std::pair<std::int32_t, std::int32_t>> ranges{{0, 5}, {7, 7}, {0, 9}, {10, 12}};
  for (const bool causal : {true, false}) {
    for (const auto& [heads, kv_heads] : {std::pair{2, 2}, std::pair{4, 1}}) {
      const Problem p = make_problem(rng, q_lengths, ranges, 12, heads, kv_heads, 8, causal);
      const Results got = run_segments(p);
      const Naive want = naive(p);
      const std::string what = std::string(causal ? "causal" : "full") + " H=" + std::to_string(heads) +
                               " Hkv=" + std::to_string(kv_heads) + ": ";
      expect_close(got.out, want.out, what + "out");
      expect_close(got.lse, want.lse, what + "lse");
      expect_close(got.dq, want.dq, what + "dq");
      expect_close(got.dk, want.dk, what + "dk");
      expect_close(got.dv, want.dv, what + "dv");
      const std::int64_t row = kv_heads * 8;
      for (std::int64_t e = 9 * row; e < 10 * row; ++e) {
        EXPECT_EQ(got.dk[e], 0.0f) << what << "key 9 is read by no query";
        EXPECT_EQ(got.dv[e], 0.0f) << what << "key 9 is read by no query";
      }
      if (causal) {
        const std::int64_t tq = p.desc.attention.tokens;
        for (std::int64_t h = 0; h < heads; ++h) {
          EXPECT_EQ(got.lse[h * tq + 5], -std::numeric_limits<float>::infinity()) << what << "no key: lse -inf";
          for (std::int64_t e = 0; e < 8; ++e) EXPECT_EQ(got.out[(5 * heads + h) * 8 + e], 0.0f) << what;
        }
      }
    }
  }
}

TEST(SegmentAttentionHostTest, BadTablesAreClearErrors) {
  testing::SeededRng rng;
  Problem p = make_problem(rng, {2, 2}, {{0, 3}, {0, 4}}, 4, 2, 2, 8, true);
  std::vector<float> out(p.q.size()), lse(8);
  auto forward = [&] {
    host::segment_attention_forward(p.desc, p.q.data(), p.k.data(), p.v.data(), p.q_offsets.data(), p.kv_ranges.data(),
                                    out.data(), lse.data());
  };
  p.kv_ranges[3] = 5;
  EXPECT_ERROR_CONTAINS(forward(), "kv_ranges[1] = [0, 5)", "[0, 4)");
  p.kv_ranges[3] = 4;
  p.kv_ranges[0] = 2;
  p.kv_ranges[1] = 1;
  EXPECT_ERROR_CONTAINS(forward(), "kv_ranges[0]", "begin <= end");
  p.kv_ranges[0] = 0;
  p.kv_ranges[1] = 3;
  p.q_offsets[2] = 3;
  EXPECT_ERROR_CONTAINS(forward(), "q_offsets[2]", "query token count 4");
  p.q_offsets[2] = 4;
  p.desc.kv_tokens = 0;
  EXPECT_ERROR_CONTAINS(forward(), "kv_tokens must be > 0");
}

}  // namespace
}  // namespace stepgraph::kernels
