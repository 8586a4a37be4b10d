// The fused QKV split with rotary embedding and its backward at given
// positions (kernels/rope.h, the _at entry points: a context-parallel rank's
// tokens): with the positions cu_seqlens implies they give the cu_seqlens
// entry points' bits, on the host and on the GPU; at other positions each
// token rotates as the one at that position of a plain packing does.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/rope.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::HostArray;
using testing::int32s;

// Each token's position within its sequence of the packing cu.
std::vector<std::int32_t> positions_of(const std::vector<std::int32_t>& cu) {
  std::vector<std::int32_t> out;
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    for (std::int32_t t = cu[s]; t < cu[s + 1]; ++t) out.push_back(t - cu[s]);
  }
  return out;
}

struct Case {
  DType dtype;
  std::int64_t heads, kv_heads, head_dim, rotary_dim;
  std::vector<std::int32_t> cu;
  std::int64_t tokens() const { return cu.back(); }
  RopeDesc desc() const {
    return {.dtype = dtype,
            .tokens = tokens(),
            .sequences = static_cast<std::int64_t>(cu.size()) - 1,
            .heads = heads,
            .head_dim = head_dim,
            .rotary_dim = rotary_dim};
  }
  std::int64_t nq() const { return tokens() * heads * head_dim; }
  std::int64_t nk() const { return tokens() * kv_heads * head_dim; }
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {DType::kFloat32, 4, 2, 16, 0, {0, 7, 8, 20}},
      {DType::kBFloat16, 4, 1, 32, 24, {0, 1, 33, 40}},
      {DType::kFloat16, 2, 2, 8, 8, {0, 3, 4, 5, 19}},
  };
  return all;
}

TEST(RopePositionsHostTest, PositionsOfThePackingGiveTheCuSeqlensBits) {
  testing::SeededRng rng;
  for (const Case& c : cases()) {
    SCOPED_TRACE(dtype_name(c.dtype));
    const RopeDesc d = c.desc();
    const std::vector<std::int32_t> pos = positions_of(c.cu);
    const HostArray qkv = testing::random_array(c.dtype, c.nq() + 2 * c.nk(), rng);
    HostArray q(c.dtype, c.nq()), k(c.dtype, c.nk()), v(c.dtype, c.nk());
    HostArray q2(c.dtype, c.nq()), k2(c.dtype, c.nk()), v2(c.dtype, c.nk());
    host::qkv_split_rope(d, c.kv_heads, qkv.data(), c.cu.data(), q.data(), k.data(), v.data());
    host::qkv_split_rope_at(d, c.kv_heads, qkv.data(), pos.data(), q2.data(), k2.data(), v2.data());
    EXPECT_EQ(q.bytes, q2.bytes);
    EXPECT_EQ(k.bytes, k2.bytes);
    EXPECT_EQ(v.bytes, v2.bytes);
    HostArray dqkv(c.dtype, qkv.numel), dqkv2(c.dtype, qkv.numel);
    host::qkv_merge_rope_backward(d, c.kv_heads, q.data(), k.data(), v.data(), c.cu.data(), dqkv.data());
    host::qkv_merge_rope_backward_at(d, c.kv_heads, q.data(), k.data(), v.data(), pos.data(), dqkv2.data());
    EXPECT_EQ(dqkv.bytes, dqkv2.bytes);
  }
}

// Token t at position p rotates as the last token of a one-sequence packing
// of p + 1 tokens (the same row everywhere), whatever p its neighbours have.
TEST(RopePositionsHostTest, EachTokenRotatesAtItsOwnPosition) {
  testing::SeededRng rng;
  const std::int64_t heads = 2, kv_heads = 1, dim = 16, width = (heads + 2 * kv_heads) * dim;
  const std::vector<std::int32_t> pos = {5, 0, 17, 3, 3, 40};
  const std::int64_t tokens = static_cast<std::int64_t>(pos.size());
  const HostArray row = testing::random_array(DType::kFloat32, width, rng);
  HostArray qkv(DType::kFloat32, tokens * width);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::copy(row.bytes.begin(), row.bytes.end(), qkv.bytes.begin() + t * width * 4);
  }
  const RopeDesc d{.dtype = DType::kFloat32, .tokens = tokens, .sequences = 1, .heads = heads, .head_dim = dim};
  HostArray q(DType::kFloat32, tokens * heads * dim), k(DType::kFloat32, tokens * kv_heads * dim),
      v(DType::kFloat32, tokens * kv_heads * dim);
  host::qkv_split_rope_at(d, kv_heads, qkv.data(), pos.data(), q.data(), k.data(), v.data());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t n = pos[t] + 1;
    HostArray one(DType::kFloat32, n * width);
    for (std::int64_t u = 0; u < n; ++u)
      std::copy(row.bytes.begin(), row.bytes.end(), one.bytes.begin() + u * width * 4);
    const RopeDesc od{.dtype = DType::kFloat32, .tokens = n, .sequences = 1, .heads = heads, .head_dim = dim};
    HostArray oq(DType::kFloat32, n * heads * dim), ok(DType::kFloat32, n * kv_heads * dim),
        ov(DType::kFloat32, n * kv_heads * dim);
    const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(n)};
    host::qkv_split_rope(od, kv_heads, one.data(), cu.data(), oq.data(), ok.data(), ov.data());
    for (std::int64_t f = 0; f < heads * dim; ++f)
      EXPECT_EQ(q.get(t * heads * dim + f), oq.get(pos[t] * heads * dim + f));
    for (std::int64_t f = 0; f < kv_heads * dim; ++f) {
      EXPECT_EQ(k.get(t * kv_heads * dim + f), ok.get(pos[t] * kv_heads * dim + f));
    }
  }
}

// On the GPU: the positions entry points equal the cu_seqlens ones bit for
// bit (one kernel; the position is the only thing read differently).
TEST(RopePositionsGpuTest, PositionsOfThePackingGiveTheCuSeqlensBits) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  for (const Case& c : cases()) {
    SCOPED_TRACE(dtype_name(c.dtype));
    const RopeDesc d = c.desc();
    const HostArray qkv = testing::random_array(c.dtype, c.nq() + 2 * c.nk(), rng);
    const DeviceArray qkv_d(qkv), cu_d(int32s(c.cu)), pos_d(int32s(positions_of(c.cu)));
    const std::int64_t size = dtype_size(c.dtype);
    DeviceArray q_d(c.nq() * size), k_d(c.nk() * size), v_d(c.nk() * size);
    DeviceArray q2_d(c.nq() * size), k2_d(c.nk() * size), v2_d(c.nk() * size);
    launch_qkv_split_rope(d, c.kv_heads, qkv_d.get(), cu_d.as<std::int32_t>(), q_d.get(), k_d.get(), v_d.get(),
                          nullptr);
    launch_qkv_split_rope_at(d, c.kv_heads, qkv_d.get(), pos_d.as<std::int32_t>(), q2_d.get(), k2_d.get(), v2_d.get(),
                             nullptr);
    EXPECT_EQ(q_d.download(c.dtype, c.nq()).bytes, q2_d.download(c.dtype, c.nq()).bytes);
    EXPECT_EQ(k_d.download(c.dtype, c.nk()).bytes, k2_d.download(c.dtype, c.nk()).bytes);
    EXPECT_EQ(v_d.download(c.dtype, c.nk()).bytes, v2_d.download(c.dtype, c.nk()).bytes);
    DeviceArray dqkv_d(qkv.bytes.size()), dqkv2_d(qkv.bytes.size());
    launch_qkv_merge_rope_backward(d, c.kv_heads, q_d.get(), k_d.get(), v_d.get(), cu_d.as<std::int32_t>(),
                                   dqkv_d.get(), nullptr);
    launch_qkv_merge_rope_backward_at(d, c.kv_heads, q_d.get(), k_d.get(), v_d.get(), pos_d.as<std::int32_t>(),
                                      dqkv2_d.get(), nullptr);
    EXPECT_EQ(dqkv_d.download(c.dtype, qkv.numel).bytes, dqkv2_d.download(c.dtype, qkv.numel).bytes);
  }
}

}  // namespace
}  // namespace stepgraph::kernels
