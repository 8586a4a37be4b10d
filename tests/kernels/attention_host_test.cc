// The attention and RoPE host references (kernels/attention.h,
// kernels/rope.h): attention against a naive double implementation, finite
// differences, per-sequence runs and repeated kv heads; RoPE's relative-
// position property and its backward as the transpose; on random values
// whose seed a failure prints.
//
// Tolerances: the reference adds in fp32, the naive one in double: 1e-5 of
// the largest value covers the rounding of a few dozen fp32 terms. Finite
// differences in double around the fp32 reference's loss: central
// differences with step 1e-2 on O(1) inputs, 2e-3 relative (their own
// truncation and the fp32 loss's rounding); a wrong sign or a missing term
// is off by O(1).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/attention.h"
#include "kernels/rope.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

struct Case {
  std::vector<std::int32_t> lengths;
  std::int64_t heads, kv_heads, dim;
  bool causal;
};

AttentionDesc desc_of(const Case& c) {
  std::int64_t tokens = 0;
  for (std::int32_t l : c.lengths) tokens += l;
  return {.dtype = DType::kFloat32, .tokens = tokens, .sequences = static_cast<std::int64_t>(c.lengths.size()),
          .heads = c.heads, .kv_heads = c.kv_heads, .head_dim = c.dim, .causal = c.causal};
}

std::vector<std::int32_t> cu_of(const std::vector<std::int32_t>& lengths) {
  std::vector<std::int32_t> cu{0};
  for (std::int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

std::vector<float> random_values(std::mt19937& rng, std::int64_t n) {
  std::normal_distribution<float> normal;
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = normal(rng);
  return out;
}

struct Tensors {
  std::vector<float> q, k, v;
};

Tensors random_inputs(const AttentionDesc& d, std::mt19937& rng) {
  return {random_values(rng, d.tokens * d.heads * d.head_dim), random_values(rng, d.tokens * d.kv_heads * d.head_dim),
          random_values(rng, d.tokens * d.kv_heads * d.head_dim)};
}

// out in double, scores materialised.
std::vector<double> naive_forward(const AttentionDesc& d, const Tensors& t, const std::vector<std::int32_t>& cu) {
  std::vector<double> out(static_cast<std::size_t>(d.tokens * d.heads * d.head_dim), 0.0);
  const std::int64_t group = d.heads / d.kv_heads;
  const double scale = d.softmax_scale();
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    for (std::int64_t h = 0; h < d.heads; ++h) {
      const std::int64_t g = h / group;
      for (std::int64_t i = cu[s]; i < cu[s + 1]; ++i) {
        const std::int64_t last = d.causal ? i + 1 : cu[s + 1];
        std::vector<double> w;
        double max = -1e300, sum = 0;
        for (std::int64_t j = cu[s]; j < last; ++j) {
          double x = 0;
          for (std::int64_t e = 0; e < d.head_dim; ++e) {
            x += static_cast<double>(t.q[(i * d.heads + h) * d.head_dim + e]) * t.k[(j * d.kv_heads + g) * d.head_dim + e];
          }
          w.push_back(scale * x);
          max = std::max(max, scale * x);
        }
        for (double& x : w) sum += (x = std::exp(x - max));
        for (std::int64_t j = cu[s]; j < last; ++j) {
          for (std::int64_t e = 0; e < d.head_dim; ++e) {
            out[(i * d.heads + h) * d.head_dim + e] += w[j - cu[s]] / sum * t.v[(j * d.kv_heads + g) * d.head_dim + e];
          }
        }
      }
    }
  }
  return out;
}

struct Forward {
  std::vector<float> out, lse;
};

Forward forward(const AttentionDesc& d, const Tensors& t, const std::vector<std::int32_t>& cu) {
  Forward f{std::vector<float>(t.q.size()), std::vector<float>(static_cast<std::size_t>(d.heads * d.tokens))};
  host::attention_forward(d, t.q.data(), t.k.data(), t.v.data(), cu.data(), f.out.data(), f.lse.data());
  return f;
}

Tensors backward(const AttentionDesc& d, const Tensors& t, const Forward& f, const std::vector<float>& dout,
                 const std::vector<std::int32_t>& cu) {
  Tensors g{std::vector<float>(t.q.size()), std::vector<float>(t.k.size()), std::vector<float>(t.v.size())};
  host::attention_backward(d, t.q.data(), t.k.data(), t.v.data(), f.out.data(), f.lse.data(), dout.data(), cu.data(),
                           g.q.data(), g.k.data(), g.v.data());
  return g;
}

const Case kCases[] = {
    {{5}, 2, 2, 8, true},                 // one sequence, multi-head
    {{3, 1, 6}, 4, 2, 8, true},           // packed, a one-token sequence, grouped-query
    {{4, 7}, 4, 1, 16, false},            // multi-query, not causal
    {{1, 1, 1}, 2, 1, 4, true},           // every sequence one token
};

TEST(AttentionHostTest, Fp32ForwardMatchesNaiveDoubleOnRandomShapes) {
  testing::SeededRng rng;
  for (const Case& c : kCases) {
    const AttentionDesc d = desc_of(c);
    const std::vector<std::int32_t> cu = cu_of(c.lengths);
    const Tensors t = random_inputs(d, rng);
    const Forward f = forward(d, t, cu);
    const std::vector<double> want = naive_forward(d, t, cu);
    double scale = 1, worst = 0;
    for (std::size_t e = 0; e < want.size(); ++e) {
      scale = std::max(scale, std::abs(want[e]));
      worst = std::max(worst, std::abs(want[e] - f.out[e]));
    }
    EXPECT_LE(worst, 1e-5 * scale) << "tokens " << d.tokens << " heads " << d.heads << "/" << d.kv_heads;
    for (float l : f.lse) EXPECT_TRUE(std::isfinite(l));
  }
}

TEST(AttentionHostTest, BackwardMatchesFiniteDifferences) {
  testing::SeededRng rng;
  for (const Case& c : {kCases[1], kCases[2]}) {
    const AttentionDesc d = desc_of(c);
    const std::vector<std::int32_t> cu = cu_of(c.lengths);
    Tensors t = random_inputs(d, rng);
    const std::vector<float> w = random_values(rng, d.tokens * d.heads * d.head_dim);  // loss = sum(out * w)
    const Tensors grads = backward(d, t, forward(d, t, cu), w, cu);
    auto loss = [&] {
      const Forward f = forward(d, t, cu);
      double sum = 0;
      for (std::size_t e = 0; e < w.size(); ++e) sum += static_cast<double>(f.out[e]) * w[e];
      return sum;
    };
    struct Which {
      std::vector<float>* values;
      const std::vector<float>* grad;
      const char* name;
    };
    for (const Which& which : {Which{&t.q, &grads.q, "dq"}, Which{&t.k, &grads.k, "dk"}, Which{&t.v, &grads.v, "dv"}}) {
      double scale = 1, worst = 0;
      for (std::size_t e = 0; e < which.values->size(); ++e) {
        const float keep = (*which.values)[e];
        (*which.values)[e] = keep + 1e-2f;
        const double up = loss();
        (*which.values)[e] = keep - 1e-2f;
        const double down = loss();
        (*which.values)[e] = keep;
        const double numeric = (up - down) / (2e-2);
        scale = std::max(scale, std::abs(numeric));
        worst = std::max(worst, std::abs(numeric - (*which.grad)[e]));
      }
      EXPECT_LE(worst, 2e-3 * scale) << which.name << ": largest difference to finite differences " << worst;
    }
  }
}

TEST(AttentionHostTest, PackedSequencesEqualTheSequencesRunOneByOne) {
  testing::SeededRng rng;
  const Case packed = kCases[1];
  const AttentionDesc d = desc_of(packed);
  const std::vector<std::int32_t> cu = cu_of(packed.lengths);
  const Tensors t = random_inputs(d, rng);
  const std::vector<float> dout = random_values(rng, d.tokens * d.heads * d.head_dim);
  const Forward f = forward(d, t, cu);
  const Tensors g = backward(d, t, f, dout, cu);
  const std::int64_t qrow = d.heads * d.head_dim, kvrow = d.kv_heads * d.head_dim;
  for (std::size_t s = 0; s < packed.lengths.size(); ++s) {
    const std::int64_t b = cu[s], l = packed.lengths[s];
    AttentionDesc one = d;
    one.tokens = l;
    one.sequences = 1;
    auto slice = [](const std::vector<float>& v, std::int64_t row, std::int64_t first, std::int64_t count) {
      return std::vector<float>(v.begin() + first * row, v.begin() + (first + count) * row);
    };
    const Tensors part{slice(t.q, qrow, b, l), slice(t.k, kvrow, b, l), slice(t.v, kvrow, b, l)};
    const std::vector<std::int32_t> cu_one{0, static_cast<std::int32_t>(l)};
    const Forward fo = forward(one, part, cu_one);
    const Tensors go = backward(one, part, fo, slice(dout, qrow, b, l), cu_one);
    EXPECT_EQ(fo.out, slice(f.out, qrow, b, l)) << "sequence " << s;
    EXPECT_EQ(go.q, slice(g.q, qrow, b, l)) << "sequence " << s;
    EXPECT_EQ(go.k, slice(g.k, kvrow, b, l)) << "sequence " << s;
    EXPECT_EQ(go.v, slice(g.v, kvrow, b, l)) << "sequence " << s;
    for (std::int64_t h = 0; h < d.heads; ++h) {
      for (std::int64_t i = 0; i < l; ++i) EXPECT_EQ(fo.lse[h * l + i], f.lse[h * d.tokens + b + i]);
    }
  }
}

// Grouped-query attention is multi-head attention with each kv head repeated
// over its group: the same outputs, and a kv head's gradient is the sum of
// its copies'.
TEST(AttentionHostTest, GroupedQueryEqualsRepeatedKvHeads) {
  testing::SeededRng rng;
  const Case gqa = kCases[1];  // 4 query heads, 2 kv heads
  const AttentionDesc d = desc_of(gqa);
  const std::vector<std::int32_t> cu = cu_of(gqa.lengths);
  const Tensors t = random_inputs(d, rng);
  const std::vector<float> dout = random_values(rng, d.tokens * d.heads * d.head_dim);
  AttentionDesc mha = d;
  mha.kv_heads = d.heads;
  const std::int64_t group = d.heads / d.kv_heads;
  Tensors repeated{t.q, {}, {}};
  for (std::int64_t token = 0; token < d.tokens; ++token) {
    for (std::int64_t h = 0; h < d.heads; ++h) {
      for (std::int64_t e = 0; e < d.head_dim; ++e) {
        repeated.k.push_back(t.k[(token * d.kv_heads + h / group) * d.head_dim + e]);
        repeated.v.push_back(t.v[(token * d.kv_heads + h / group) * d.head_dim + e]);
      }
    }
  }
  const Forward f = forward(d, t, cu);
  const Forward fm = forward(mha, repeated, cu);
  EXPECT_EQ(f.out, fm.out);
  EXPECT_EQ(f.lse, fm.lse);
  const Tensors g = backward(d, t, f, dout, cu);
  const Tensors gm = backward(mha, repeated, fm, dout, cu);
  EXPECT_EQ(g.q, gm.q);
  for (std::int64_t token = 0; token < d.tokens; ++token) {
    for (std::int64_t kv = 0; kv < d.kv_heads; ++kv) {
      for (std::int64_t e = 0; e < d.head_dim; ++e) {
        double dk = 0, dv = 0;
        for (std::int64_t h = kv * group; h < (kv + 1) * group; ++h) {
          dk += gm.k[(token * d.heads + h) * d.head_dim + e];
          dv += gm.v[(token * d.heads + h) * d.head_dim + e];
        }
        const std::int64_t at = (token * d.kv_heads + kv) * d.head_dim + e;
        EXPECT_NEAR(g.k[at], dk, 1e-5 * (1 + std::abs(dk)));
        EXPECT_NEAR(g.v[at], dv, 1e-5 * (1 + std::abs(dv)));
      }
    }
  }
}

TEST(AttentionHostTest, BadDescriptorsAndPackingsAreClearErrors) {
  EXPECT_ERROR_CONTAINS(check_attention({.dtype = DType::kFloat32, .tokens = 4, .sequences = 1, .heads = 3,
                                         .kv_heads = 2, .head_dim = 8}),
                        "kv_heads (2) must divide heads (3)");
  EXPECT_ERROR_CONTAINS(check_attention({.dtype = DType::kInt32, .tokens = 4, .sequences = 1, .heads = 1,
                                         .kv_heads = 1, .head_dim = 8}),
                        "dtype must be bf16, fp16 or fp32");
  const AttentionDesc d{.dtype = DType::kFloat32, .tokens = 4, .sequences = 2, .heads = 1, .kv_heads = 1, .head_dim = 2};
  const std::int32_t decreasing[] = {0, 3, 2};
  EXPECT_ERROR_CONTAINS(host::check_cu_seqlens(d, decreasing), "must not decrease");
  const std::int32_t short_end[] = {0, 1, 3};
  EXPECT_ERROR_CONTAINS(host::check_cu_seqlens(d, short_end), "must be the token count 4");
  const std::int32_t late_start[] = {1, 2, 4};
  EXPECT_ERROR_CONTAINS(host::check_cu_seqlens(d, late_start), "cu_seqlens[0] must be 0");
}

// --- rotary position embedding ------------------------------------------------

std::vector<float> rope(const RopeDesc& d, const std::vector<float>& x, const std::vector<std::int32_t>& cu,
                        bool backward = false) {
  std::vector<float> out(x.size());
  if (backward) {
    host::rope_backward(d, x.data(), cu.data(), out.data());
  } else {
    host::rope_forward(d, x.data(), cu.data(), out.data());
  }
  return out;
}

// The property RoPE exists for: rotated q.k depends on the positions'
// difference only (same sequence lengths, shifted positions). Rotations are
// exact in real numbers; fp32 trigonometry of angles up to ~10 leaves ~1e-5.
TEST(RopeHostTest, RotatedDotProductsDependOnThePositionDifferenceOnly) {
  testing::SeededRng rng;
  const std::int64_t dim = 16;
  const RopeDesc d{.dtype = DType::kFloat32, .tokens = 12, .sequences = 1, .heads = 1, .head_dim = dim};
  const std::vector<std::int32_t> cu{0, 12};
  const std::vector<float> q = random_values(rng, dim), k = random_values(rng, dim);
  std::vector<float> qs, ks;  // q and k at every position
  for (int p = 0; p < 12; ++p) {
    qs.insert(qs.end(), q.begin(), q.end());
    ks.insert(ks.end(), k.begin(), k.end());
  }
  const std::vector<float> rq = rope(d, qs, cu), rk = rope(d, ks, cu);
  auto dot_at = [&](int i, int j) {
    double sum = 0;
    for (std::int64_t f = 0; f < dim; ++f) sum += static_cast<double>(rq[i * dim + f]) * rk[j * dim + f];
    return sum;
  };
  for (int shift = 1; shift + 5 < 12; ++shift) {
    EXPECT_NEAR(dot_at(5 + shift, 2 + shift), dot_at(5, 2), 1e-4) << "shift " << shift;
  }
  EXPECT_EQ(std::vector<float>(rq.begin(), rq.begin() + dim), q) << "position 0 is not rotated";
}

TEST(RopeHostTest, BackwardIsTheTransposeAndPositionsRestartPerSequence) {
  testing::SeededRng rng;
  const RopeDesc d{.dtype = DType::kFloat32, .tokens = 9, .sequences = 3, .heads = 2, .head_dim = 8, .rotary_dim = 6};
  const std::vector<std::int32_t> cu{0, 4, 5, 9};
  const std::vector<float> x = random_values(rng, 9 * 2 * 8), y = random_values(rng, 9 * 2 * 8);
  const std::vector<float> rx = rope(d, x, cu), ry = rope(d, y, cu, /*backward=*/true);
  double a = 0, b = 0;
  for (std::size_t e = 0; e < x.size(); ++e) {
    a += static_cast<double>(rx[e]) * y[e];
    b += static_cast<double>(x[e]) * ry[e];
  }
  EXPECT_NEAR(a, b, 1e-4 * (1 + std::abs(a))) << "<rope(x), y> against <x, rope_backward(y)>";
  EXPECT_EQ(rope(d, rx, cu, /*backward=*/true).size(), x.size());
  // The features past rotary_dim pass through; the third sequence's first
  // token (position 0) is not rotated; it equals the first sequence's.
  for (std::size_t t = 0; t < 9; ++t) {
    for (std::size_t h = 0; h < 2; ++h) {
      for (std::size_t f = 6; f < 8; ++f) EXPECT_EQ(rx[(t * 2 + h) * 8 + f], x[(t * 2 + h) * 8 + f]);
    }
  }
  for (std::size_t f = 0; f < 16; ++f) EXPECT_EQ(rx[5 * 16 + f], x[5 * 16 + f]) << "token 5 is at position 0";
  EXPECT_ERROR_CONTAINS(check_rope({.dtype = DType::kFloat32, .tokens = 1, .sequences = 1, .heads = 1, .head_dim = 8,
                                    .rotary_dim = 5}),
                        "rotary_dim (5) must be even");
}

// The QKV split is rope_forward of q's and k's heads and a copy of v's; the
// merge is the split's transpose (rope_backward of dq and dk).
TEST(RopeHostTest, QkvSplitRotatesQAndKAndMergeIsItsTranspose) {
  testing::SeededRng rng;
  const std::int64_t tokens = 7, heads = 4, kv_heads = 2, dim = 8, width = heads + 2 * kv_heads;
  const RopeDesc d{.dtype = DType::kFloat32, .tokens = tokens, .sequences = 2, .heads = heads, .head_dim = dim,
                   .rotary_dim = 6};
  const std::vector<std::int32_t> cu{0, 3, 7};
  const std::vector<float> qkv = random_values(rng, tokens * width * dim);
  std::vector<float> q(tokens * heads * dim), k(tokens * kv_heads * dim), v(tokens * kv_heads * dim);
  host::qkv_split_rope(d, kv_heads, qkv.data(), cu.data(), q.data(), k.data(), v.data());
  // The same heads gathered by hand, then rotated with rope_forward.
  auto part = [&](std::int64_t first, std::int64_t count) {
    std::vector<float> out;
    for (std::int64_t t = 0; t < tokens; ++t) {
      const auto row = qkv.begin() + (t * width + first) * dim;
      out.insert(out.end(), row, row + count * dim);
    }
    return out;
  };
  RopeDesc kd = d;
  kd.heads = kv_heads;
  EXPECT_EQ(q, rope(d, part(0, heads), cu));
  EXPECT_EQ(k, rope(kd, part(heads, kv_heads), cu));
  EXPECT_EQ(v, part(heads + kv_heads, kv_heads));

  const std::vector<float> dq = random_values(rng, q.size()), dk = random_values(rng, k.size()),
                           dv = random_values(rng, v.size());
  std::vector<float> dqkv(qkv.size());
  host::qkv_merge_rope_backward(d, kv_heads, dq.data(), dk.data(), dv.data(), cu.data(), dqkv.data());
  double a = 0, b = 0;  // <split(qkv), (dq, dk, dv)> against <qkv, merge(dq, dk, dv)>
  for (std::size_t e = 0; e < q.size(); ++e) a += static_cast<double>(q[e]) * dq[e];
  for (std::size_t e = 0; e < k.size(); ++e) a += static_cast<double>(k[e]) * dk[e] + static_cast<double>(v[e]) * dv[e];
  for (std::size_t e = 0; e < qkv.size(); ++e) b += static_cast<double>(qkv[e]) * dqkv[e];
  EXPECT_NEAR(a, b, 1e-4 * (1 + std::abs(a)));
  EXPECT_ERROR_CONTAINS(host::qkv_split_rope(d, 3, qkv.data(), cu.data(), q.data(), k.data(), v.data()),
                        "kv_heads (3) must be > 0 and divide the query heads (4)");
}

}  // namespace
}  // namespace stepgraph::kernels
