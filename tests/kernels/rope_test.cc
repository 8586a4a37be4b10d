// The rotary embedding and MultiheadAttention's fused QKV split on the GPU
// against their host references (kernels/rope.h), in every dtype, with
// sequences of odd lengths and of one token; and a packing on the device that
// breaks every rule, which must give some answer, never a fault (run it under
// compute-sanitizer memcheck).
#include "kernels/rope.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::HostArray;
using testing::int32s;

// Angles reach ~ (tokens - 1) rad; fp32 sin/cos of the device and the host
// differ in the last bits, so results agree to the dtype's rounding.
double tolerance(DType dtype) { return dtype == DType::kFloat32 ? 2e-6 : testing::tolerance_for(dtype); }

class RopeGpuTest : public ::testing::TestWithParam<DType> {};

// Split and merge of `tokens` packed as `cu` against the host.
void expect_split_and_merge_match(DType dtype, std::int64_t tokens, std::int64_t heads, std::int64_t kv_heads,
                                  const std::vector<std::int32_t>& cu) {
  testing::SeededRng rng;
  const std::int64_t dim = 64, width = heads + 2 * kv_heads;
  const RopeDesc d{.dtype = dtype, .tokens = tokens, .sequences = static_cast<std::int64_t>(cu.size()) - 1,
                   .heads = heads, .head_dim = dim, .rotary_dim = 48};
  const HostArray qkv = testing::random_array(dtype, tokens * width * dim, rng);
  const DeviceArray qkv_d(qkv), cu_d(int32s(cu));
  const std::int64_t nq = tokens * heads * dim, nk = tokens * kv_heads * dim;
  DeviceArray q_d(nq * dtype_size(dtype)), k_d(nk * dtype_size(dtype)), v_d(nk * dtype_size(dtype));
  q_d.poison();
  k_d.poison();
  v_d.poison();
  launch_qkv_split_rope(d, kv_heads, qkv_d.get(), cu_d.as<std::int32_t>(), q_d.get(), k_d.get(), v_d.get(), nullptr);
  HostArray q(dtype, nq), k(dtype, nk), v(dtype, nk);
  host::qkv_split_rope(d, kv_heads, qkv.data(), cu.data(), q.data(), k.data(), v.data());
  EXPECT_LE(testing::relative_error(q_d.download(dtype, nq).to_floats(), q.to_floats()), tolerance(dtype));
  EXPECT_LE(testing::relative_error(k_d.download(dtype, nk).to_floats(), k.to_floats()), tolerance(dtype));
  EXPECT_EQ(v_d.download(dtype, nk).bytes, v.bytes) << "v is copied";

  const HostArray dq = testing::random_array(dtype, nq, rng), dk = testing::random_array(dtype, nk, rng),
                  dv = testing::random_array(dtype, nk, rng);
  const DeviceArray dq_d(dq), dk_d(dk), dv_d(dv);
  DeviceArray dqkv_d(qkv.bytes.size());
  dqkv_d.poison();
  launch_qkv_merge_rope_backward(d, kv_heads, dq_d.get(), dk_d.get(), dv_d.get(), cu_d.as<std::int32_t>(),
                                 dqkv_d.get(), nullptr);
  HostArray dqkv(dtype, qkv.numel);
  host::qkv_merge_rope_backward(d, kv_heads, dq.data(), dk.data(), dv.data(), cu.data(), dqkv.data());
  EXPECT_LE(testing::relative_error(dqkv_d.download(dtype, qkv.numel).to_floats(), dqkv.to_floats()),
            tolerance(dtype));
}

TEST_P(RopeGpuTest, QkvSplitAndMergeMatchTheHost) {
  SG_SKIP_WITHOUT_GPU();
  // One head a thread; a one-token and an empty sequence.
  expect_split_and_merge_match(GetParam(), 203, 8, 2, {0, 1, 100, 100, 167, 203});
}

TEST_P(RopeGpuTest, QkvSplitAndMergeOfManyTokensMatchTheHost) {
  SG_SKIP_WITHOUT_GPU();
  // Enough pairs that a thread takes 8 heads of its token (kernels/rope.cu); 18 heads end in a chunk of 2.
  expect_split_and_merge_match(GetParam(), 8192, 12, 3, {0, 3000, 3001, 8192});
}

TEST_P(RopeGpuTest, RopeInPlaceMatchesTheHost) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const DType dtype = GetParam();
  const RopeDesc d{.dtype = dtype, .tokens = 77, .sequences = 3, .heads = 3, .head_dim = 128};
  const std::vector<std::int32_t> cu{0, 33, 34, 77};
  const std::int64_t n = d.tokens * d.heads * d.head_dim;
  const HostArray x = testing::random_array(dtype, n, rng);
  DeviceArray x_d(x);
  const DeviceArray cu_d(int32s(cu));
  HostArray want(dtype, n), back(dtype, n);
  host::rope_forward(d, x.data(), cu.data(), want.data());
  launch_rope_forward(d, x_d.get(), cu_d.as<std::int32_t>(), x_d.get(), nullptr);  // in place
  EXPECT_LE(testing::relative_error(x_d.download(dtype, n).to_floats(), want.to_floats()), tolerance(dtype));
  host::rope_backward(d, want.data(), cu.data(), back.data());
  x_d.upload(want);
  launch_rope_backward(d, x_d.get(), cu_d.as<std::int32_t>(), x_d.get(), nullptr);
  EXPECT_LE(testing::relative_error(x_d.download(dtype, n).to_floats(), back.to_floats()), tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, RopeGpuTest, ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Negative, decreasing and past-the-end entries: the kernels clamp what they
// read, so every access stays inside the tensors (memcheck finds none out).
TEST(RopeGpuTest, AGarbagePackingOnTheDeviceDoesNotFault) {
  SG_SKIP_WITHOUT_GPU();
  const std::int64_t tokens = 40, heads = 2, kv_heads = 1, dim = 64;
  const RopeDesc d{.dtype = DType::kBFloat16, .tokens = tokens, .sequences = 4, .heads = heads, .head_dim = dim};
  const DeviceArray cu_d(int32s({-5, 900, 3, -1, 1 << 30}));
  DeviceArray qkv_d(tokens * (heads + 2 * kv_heads) * dim * 2), q_d(tokens * heads * dim * 2),
      k_d(tokens * kv_heads * dim * 2), v_d(tokens * kv_heads * dim * 2);
  launch_qkv_split_rope(d, kv_heads, qkv_d.get(), cu_d.as<std::int32_t>(), q_d.get(), k_d.get(), v_d.get(), nullptr);
  launch_qkv_merge_rope_backward(d, kv_heads, q_d.get(), k_d.get(), v_d.get(), cu_d.as<std::int32_t>(), qkv_d.get(),
                                 nullptr);
  SG_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(RopeGpuTest, BadShapesAreClearErrors) {
  const RopeDesc d{.dtype = DType::kBFloat16, .tokens = 4, .sequences = 1, .heads = 4, .head_dim = 64};
  testing::expect_invalid_argument(
      [&] { launch_qkv_split_rope(d, 3, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr); },
      "kv_heads (3) must be > 0 and divide the query heads (4)");
  RopeDesc odd = d;
  odd.rotary_dim = 7;
  testing::expect_invalid_argument([&] { launch_rope_forward(odd, nullptr, nullptr, nullptr, nullptr); },
                                   "rotary_dim (7) must be even");
}

}  // namespace
}  // namespace stepgraph::kernels
