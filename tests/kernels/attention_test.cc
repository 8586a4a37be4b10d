// The attention CUDA kernels (kernels/attention.h) against the fp32 host
// reference: the tensor-core path (bf16/fp16, head_dim 64 and 128) and the
// plain path (fp32, and odd head dims in every dtype), MHA, GQA and MQA,
// causal and not, random packings with odd lengths, one-token and empty
// sequences, a long sequence; two launches give the same bits; a garbage
// cu_seqlens on the device gives the result of the packing the kernels read
// (Note [Safe cu_seqlens]) and no fault; argument checks (without a GPU too).
//
// Tolerances, on max |got - want| / max |want| per tensor: both sides read
// the same rounded inputs, so the differences are the kernels' roundings.
// The output is stored in the dtype (half an ulp: 2^-9 relative in bf16,
// 2^-11 in fp16), and the tensor-core kernels round P (forward, dV) and dS
// (dQ, dK) to 16 bits before their products: each term is off by up to
// 2^-9 (bf16) relative, so a gradient that cancels (dS has both signs) can be
// off by a few times that against its max. We allow 2e-2 in bf16 and 4e-3 in
// fp16 (4-8x the worst single rounding; a wrong mask, a lost rescale or a
// wrong kv head is off by 0.1 and more). fp32 runs the plain kernels in fp32
// with other summation orders than the reference (online softmax, warp
// sums): ~1e-6; we allow 1e-4.
#include "kernels/attention.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::expect_invalid_argument;
using testing::HostArray;
using testing::random_array;
using testing::SeededRng;

struct Case {
  DType dtype = DType::kBFloat16;
  std::int64_t heads = 4;
  std::int64_t kv_heads = 4;
  std::int64_t head_dim = 64;
  bool causal = true;
  std::vector<std::int32_t> lengths;
};

std::string describe(const Case& c) {
  std::string lengths;
  for (std::size_t i = 0; i < c.lengths.size(); ++i) lengths += (i ? "," : "") + std::to_string(c.lengths[i]);
  return std::string(dtype_name(c.dtype)) + " H=" + std::to_string(c.heads) + " Hkv=" + std::to_string(c.kv_heads) +
         " D=" + std::to_string(c.head_dim) + (c.causal ? " causal" : " full") + " lengths=[" + lengths + "]";
}

std::vector<std::int32_t> offsets_of(const std::vector<std::int32_t>& lengths) {
  std::vector<std::int32_t> cu{0};
  for (std::int32_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

AttentionDesc desc_of(const Case& c) {
  AttentionDesc d;
  d.dtype = c.dtype;
  d.tokens = offsets_of(c.lengths).back();
  d.sequences = static_cast<std::int64_t>(c.lengths.size());
  d.heads = c.heads;
  d.kv_heads = c.kv_heads;
  d.head_dim = c.head_dim;
  d.causal = c.causal;
  return d;
}

// A random packing of about `tokens` tokens: odd lengths, one-token and empty
// sequences, and (when long) sequences that span several 128-row tiles.
std::vector<std::int32_t> random_lengths(std::mt19937& rng, int tokens) {
  std::vector<std::int32_t> lengths{0, 1};
  std::uniform_int_distribution<int> small(1, 70);
  std::uniform_int_distribution<int> large(129, 200);
  int total = 1;
  while (total < tokens) {
    const int n = (rng() % 3 == 0) ? large(rng) : small(rng) | 1;
    lengths.push_back(n);
    total += n;
  }
  lengths.push_back(1);
  std::shuffle(lengths.begin(), lengths.end(), rng);
  return lengths;
}

using Inputs = testing::AttentionInputs;

Inputs random_inputs(const AttentionDesc& d, std::mt19937& rng) {
  const std::int64_t nq = d.tokens * d.heads * d.head_dim;
  const std::int64_t nkv = d.tokens * d.kv_heads * d.head_dim;
  // Scores of order 1-3 after the 1/sqrt(D) scale: peaked softmaxes too.
  return {random_array(d.dtype, nq, rng, -2.0f, 2.0f), random_array(d.dtype, nkv, rng, -2.0f, 2.0f),
          random_array(d.dtype, nkv, rng), random_array(d.dtype, nq, rng)};
}

using Results = testing::AttentionResults;

// Forward then backward on the device (the backward from the device's out and lse).
Results run_device(const AttentionDesc& d, const Inputs& in, const std::vector<std::int32_t>& cu) {
  const std::int64_t nq = d.tokens * d.heads * d.head_dim;
  const std::int64_t nkv = d.tokens * d.kv_heads * d.head_dim;
  const std::size_t es = dtype_size(d.dtype);
  DeviceArray q(in.q), k(in.k), v(in.v), dout(in.dout);
  HostArray cu_host(DType::kInt32, static_cast<std::int64_t>(cu.size()));
  std::memcpy(cu_host.data(), cu.data(), cu.size() * sizeof(std::int32_t));
  DeviceArray cu_dev(cu_host);
  DeviceArray out(nq * es), lse(d.heads * d.tokens * 4), dq(nq * es), dk(nkv * es), dv(nkv * es);
  DeviceArray workspace(attention_backward_workspace_bytes(d));
  for (DeviceArray* a : {&out, &lse, &dq, &dk, &dv, &workspace}) a->poison();
  Stream stream;
  launch_attention_forward(d, q.get(), k.get(), v.get(), cu_dev.as<std::int32_t>(), out.get(), lse.as<float>(),
                           stream.get());
  launch_attention_backward(d, q.get(), k.get(), v.get(), out.get(), lse.as<float>(), dout.get(),
                            cu_dev.as<std::int32_t>(), dq.get(), dk.get(), dv.get(), workspace.get(), stream.get());
  stream.synchronize();
  return {out.download(d.dtype, nq), lse.download(DType::kFloat32, d.heads * d.tokens), dq.download(d.dtype, nq),
          dk.download(d.dtype, nkv), dv.download(d.dtype, nkv)};
}

Results run_host(const AttentionDesc& d, const Inputs& in, const std::vector<std::int32_t>& cu) {
  const std::int64_t nq = d.tokens * d.heads * d.head_dim;
  const std::int64_t nkv = d.tokens * d.kv_heads * d.head_dim;
  Results r{HostArray(d.dtype, nq), HostArray(DType::kFloat32, d.heads * d.tokens), HostArray(d.dtype, nq),
            HostArray(d.dtype, nkv), HostArray(d.dtype, nkv)};
  host::attention_forward(d, in.q.data(), in.k.data(), in.v.data(), cu.data(), r.out.data(),
                          static_cast<float*>(r.lse.data()));
  host::attention_backward(d, in.q.data(), in.k.data(), in.v.data(), r.out.data(),
                           static_cast<const float*>(r.lse.data()), in.dout.data(), cu.data(), r.dq.data(),
                           r.dk.data(), r.dv.data());
  return r;
}

void check_case(const Case& c, std::mt19937& rng) {
  SCOPED_TRACE(describe(c));
  const AttentionDesc d = desc_of(c);
  const std::vector<std::int32_t> cu = offsets_of(c.lengths);
  const Inputs in = random_inputs(d, rng);
  testing::expect_attention_close(run_device(d, in, cu), run_host(d, in, cu), c.dtype);
}

struct HeadLayout {
  std::int64_t heads, kv_heads;
};
constexpr HeadLayout kLayouts[] = {{4, 4}, {8, 2}, {4, 1}};  // MHA, GQA, MQA

TEST(AttentionTest, tensor_core_bf16_fp16_d64_d128_mha_gqa_mqa_causal_and_full_ragged) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (std::int64_t dim : {64, 128}) {
      for (const HeadLayout& layout : kLayouts) {
        for (bool causal : {true, false}) {
          Case c{dtype, layout.heads, layout.kv_heads, dim, causal, random_lengths(rng, 250)};
          ASSERT_TRUE(attention_uses_tensor_cores(desc_of(c)));
          check_case(c, rng);
        }
      }
    }
  }
}

TEST(AttentionTest, plain_fp32_and_odd_head_dims_mha_gqa_causal_and_full_ragged) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  const struct {
    DType dtype;
    std::int64_t dim;
  } rows[] = {{DType::kFloat32, 64}, {DType::kFloat32, 128}, {DType::kFloat32, 40}, {DType::kBFloat16, 40},
              {DType::kBFloat16, 96}, {DType::kFloat16, 96},  {DType::kFloat32, 256}};
  for (const auto& row : rows) {
    for (const HeadLayout& layout : kLayouts) {
      for (bool causal : {true, false}) {
        Case c{row.dtype, layout.heads, layout.kv_heads, row.dim, causal, random_lengths(rng, 120)};
        ASSERT_FALSE(attention_uses_tensor_cores(desc_of(c)));
        check_case(c, rng);
      }
    }
  }
}

TEST(AttentionTest, long_sequence_bf16_d128_gqa_causal_and_d64_full) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  check_case({DType::kBFloat16, 4, 2, 128, true, {1100, 37, 1}}, rng);
  check_case({DType::kBFloat16, 2, 1, 64, false, {3, 1037}}, rng);
  check_case({DType::kFloat32, 2, 1, 128, true, {1029}}, rng);
}

TEST(AttentionTest, single_tokens_and_empty_sequences_only) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    check_case({dtype, 4, 2, 128, true, {1, 0, 1, 1, 0, 0, 1}}, rng);
    check_case({dtype, 4, 2, 64, false, {0, 1, 0}}, rng);
  }
}

// Small enough for compute-sanitizer (memcheck, racecheck): two tiles of
// queries and keys, a partial one, both head dims, causal and not.
TEST(AttentionTest, small_tiles_for_sanitizers_bf16_d64_d128) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (std::int64_t dim : {64, 128}) {
    for (bool causal : {true, false}) check_case({DType::kBFloat16, 2, 1, dim, causal, {130, 1, 0, 70}}, rng);
  }
  check_case({DType::kFloat32, 2, 1, 40, true, {33, 1}}, rng);
}

// Two launches on the same inputs give the same bits (what an eager step and
// a graph replay of it must agree on).
TEST(AttentionTest, deterministic_bits_tensor_core_and_plain) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (const Case& c : {Case{DType::kBFloat16, 8, 2, 128, true, {700, 5, 300}},
                        Case{DType::kFloat16, 4, 1, 64, false, {129, 1, 250}},
                        Case{DType::kFloat32, 8, 2, 40, true, {100, 33}}}) {
    SCOPED_TRACE(describe(c));
    const AttentionDesc d = desc_of(c);
    const std::vector<std::int32_t> cu = offsets_of(c.lengths);
    const Inputs in = random_inputs(d, rng);
    const Results a = run_device(d, in, cu);
    const Results b = run_device(d, in, cu);
    EXPECT_EQ(a.out.bytes, b.out.bytes);
    EXPECT_EQ(a.lse.bytes, b.lse.bytes);
    EXPECT_EQ(a.dq.bytes, b.dq.bytes);
    EXPECT_EQ(a.dk.bytes, b.dk.bytes);
    EXPECT_EQ(a.dv.bytes, b.dv.bytes);
  }
}

// The packing the kernels read from any cu_seqlens (Note [Safe cu_seqlens]).
std::vector<std::int32_t> sanitized(const std::vector<std::int32_t>& raw, std::int32_t tokens) {
  std::vector<std::int32_t> out(raw.size());
  const std::size_t last = raw.size() - 1;
  out[0] = 0;
  for (std::size_t s = 1; s < last; ++s) out[s] = std::max(out[s - 1], std::clamp(raw[s], 0, tokens));
  out[last] = tokens;
  return out;
}

TEST(AttentionTest, garbage_cu_seqlens_read_as_a_valid_packing_never_fault) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (const std::vector<std::int32_t>& raw :
         {std::vector<std::int32_t>{-7, 90, 30, 1000000, -1, 5},
          std::vector<std::int32_t>{500, -3, 260, 2000000000, 12, -2000000000}}) {
      const std::int32_t tokens = 300;
      const std::vector<std::int32_t> cu = sanitized(raw, tokens);
      std::vector<std::int32_t> lengths;
      for (std::size_t s = 0; s + 1 < cu.size(); ++s) lengths.push_back(cu[s + 1] - cu[s]);
      const Case c{dtype, 8, 2, 128, true, lengths};
      SCOPED_TRACE(describe(c));
      const AttentionDesc d = desc_of(c);
      const Inputs in = random_inputs(d, rng);
      const Results got = run_device(d, in, raw);  // the garbage goes to the device
      SG_CUDA_CHECK(cudaDeviceSynchronize());
      testing::expect_attention_close(got, run_host(d, in, cu), dtype);
    }
  }
}

TEST(AttentionTest, checks_shapes_and_pointers_without_a_launch) {
  AttentionDesc d{.tokens = 16, .sequences = 2, .heads = 4, .kv_heads = 2, .head_dim = 64};
  EXPECT_TRUE(attention_uses_tensor_cores(d));
  d.head_dim = 96;
  EXPECT_FALSE(attention_uses_tensor_cores(d));
  d.head_dim = 128;
  d.dtype = DType::kFloat32;
  EXPECT_FALSE(attention_uses_tensor_cores(d));
  d.dtype = DType::kBFloat16;
  check_attention_cuda(d);
  AttentionDesc wide = d;
  wide.head_dim = 320;
  expect_invalid_argument([&] { check_attention_cuda(wide); }, "head_dim <= 256");
  AttentionDesc odd = d;
  odd.kv_heads = 3;
  expect_invalid_argument([&] { check_attention_cuda(odd); }, "must divide heads");
  expect_invalid_argument(
      [&] { launch_attention_forward(d, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr); },
      "got a null one");
  int dummy[64];
  expect_invalid_argument(
      [&] {
        launch_attention_backward(d, dummy, dummy, dummy, dummy, reinterpret_cast<float*>(dummy), dummy,
                                  reinterpret_cast<std::int32_t*>(dummy), dummy, dummy, dummy, nullptr, nullptr);
      },
      "workspace");
  EXPECT_EQ(attention_backward_workspace_bytes(d) % 256, 0u);
  EXPECT_GE(attention_backward_workspace_bytes(d), static_cast<std::size_t>(4 * 16 * 4));
}

}  // namespace
}  // namespace stepgraph::kernels
