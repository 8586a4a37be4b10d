// Token embedding gather and its deterministic backward. CPU: the host
// references against direct formulas (the gather is exact; the backward's
// fp32 sums in position order, against double sums), out-of-range tokens, and
// the argument checks. GPU: both kernels against the host reference bit for
// bit per dtype and size class (dims that are not a multiple of a warp, dims
// spanning several column blocks, more positions than one token tile, small
// vocabularies with many repeats), into NaN-poisoned outputs.
#include "kernels/embedding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

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

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;
constexpr DType kFp32 = DType::kFloat32;

std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  for (auto& t : tokens) t = pick(rng);
  return tokens;
}

std::vector<std::uint8_t> bytes_of(const HostArray& array) { return array.bytes; }

// ---------------------------------------------------------------------------
// Host references (no GPU needed).

TEST(EmbeddingTest, Bf16HostForwardConcatenatesTheWindowsRows) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kBf16, .vocab = 11, .dim = 5, .rows = 7, .width = 3};
  const HostArray table = random_array(kBf16, desc.vocab * desc.dim, rng);
  const std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab, rng);
  HostArray out(kBf16, desc.positions() * desc.dim);
  std::int32_t flag = 0;
  host::embedding_forward(desc, table.data(), tokens.data(), out.data(), &flag);
  EXPECT_EQ(flag, 0);
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    for (std::int64_t w = 0; w < desc.width; ++w) {
      const std::int32_t token = tokens[r * desc.width + w];
      for (std::int64_t d = 0; d < desc.dim; ++d) {
        // out is [rows, width * dim]: row r, column w * dim + d.
        ASSERT_EQ(out.get(r * desc.width * desc.dim + w * desc.dim + d), table.get(token * desc.dim + d))
            << "row " << r << " window position " << w << " column " << d;
      }
    }
  }
}

TEST(EmbeddingTest, Fp32HostForwardZeroesAndFlagsOutOfRangeTokens) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kFp32, .vocab = 4, .dim = 3, .rows = 2, .width = 2};
  const HostArray table = random_array(kFp32, desc.vocab * desc.dim, rng, 1.0f, 2.0f);
  const std::vector<std::int32_t> tokens = {1, 4, -1, 3};  // 4 and -1 are outside [0, 4)
  HostArray out(kFp32, desc.positions() * desc.dim);
  std::int32_t flag = 0;
  host::embedding_forward(desc, table.data(), tokens.data(), out.data(), &flag);
  EXPECT_EQ(flag, 1);
  for (std::int64_t d = 0; d < desc.dim; ++d) {
    EXPECT_EQ(out.get(0 * 3 + d), table.get(1 * 3 + d));
    EXPECT_EQ(out.get(1 * 3 + d), 0.0f);
    EXPECT_EQ(out.get(2 * 3 + d), 0.0f);
    EXPECT_EQ(out.get(3 * 3 + d), table.get(3 * 3 + d));
  }
}

TEST(EmbeddingTest, Bf16HostBackwardSumsEachTokensRowsInPositionOrder) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = kBf16, .vocab = 9, .dim = 6, .rows = 40, .width = 4};
  const HostArray dout = random_array(kBf16, desc.positions() * desc.dim, rng);
  std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab - 1, rng);  // row 8 never used
  tokens[5] = 99;                                                                           // skipped
  std::vector<float> dtable(static_cast<std::size_t>(desc.vocab * desc.dim), NAN);
  host::embedding_backward(desc, dout.data(), tokens.data(), dtable.data());
  for (std::int64_t v = 0; v < desc.vocab; ++v) {
    for (std::int64_t d = 0; d < desc.dim; ++d) {
      float sequential = 0.0f;
      double exact = 0.0;
      for (std::int64_t p = 0; p < desc.positions(); ++p) {
        if (tokens[p] != v) continue;
        sequential += dout.get(p * desc.dim + d);
        exact += dout.get(p * desc.dim + d);
      }
      const float got = dtable[v * desc.dim + d];
      EXPECT_EQ(got, sequential) << "row " << v << " column " << d;
      EXPECT_NEAR(got, exact, 1e-5 * (1.0 + std::abs(exact)));
      if (v == desc.vocab - 1) {
        EXPECT_EQ(got, 0.0f) << "a row no token names must be zero";
      }
    }
  }
}

TEST(EmbeddingTest, ChecksRejectBadDescriptions) {
  const EmbeddingDesc good{.dtype = kBf16, .vocab = 8, .dim = 4, .rows = 2, .width = 3};
  EXPECT_NO_THROW(check_embedding(good));
  EmbeddingDesc bad = good;
  bad.dtype = DType::kInt32;
  expect_invalid_argument([&] { check_embedding(bad); }, "dtype");
  bad = good;
  bad.vocab = 0;
  expect_invalid_argument([&] { check_embedding(bad); }, "must be > 0");
  bad = good;
  bad.width = -1;
  expect_invalid_argument([&] { check_embedding(bad); }, "must be > 0");
  bad = good;
  bad.rows = std::int64_t{1} << 30;
  expect_invalid_argument([&] { check_embedding(bad); }, "2^31");
  expect_invalid_argument([&] { launch_embedding_forward(good, nullptr, nullptr, nullptr, nullptr, nullptr); }, "null");
  expect_invalid_argument([&] { launch_embedding_backward(good, nullptr, nullptr, nullptr, nullptr); }, "null");
}

// ---------------------------------------------------------------------------
// GPU: the kernels against the host reference, bit for bit.

struct Case {
  DType dtype;
  std::int64_t vocab, dim, rows, width;
};

void expect_device_matches_host(const Case& c) {
  testing::SeededRng rng;
  const EmbeddingDesc desc{.dtype = c.dtype, .vocab = c.vocab, .dim = c.dim, .rows = c.rows, .width = c.width};
  const HostArray table = random_array(c.dtype, desc.vocab * desc.dim, rng);
  const HostArray dout = random_array(c.dtype, desc.positions() * desc.dim, rng);
  std::vector<std::int32_t> tokens = random_tokens(desc.positions(), desc.vocab, rng);
  HostArray token_array(DType::kInt32, desc.positions());
  std::memcpy(token_array.data(), tokens.data(), tokens.size() * sizeof(std::int32_t));

  HostArray want_out(c.dtype, desc.positions() * desc.dim);
  std::int32_t want_flag = 0;
  host::embedding_forward(desc, table.data(), tokens.data(), want_out.data(), &want_flag);
  std::vector<float> want_dtable(static_cast<std::size_t>(desc.vocab * desc.dim));
  host::embedding_backward(desc, dout.data(), tokens.data(), want_dtable.data());

  DeviceArray d_table(table), d_dout(dout), d_tokens(token_array);
  DeviceArray d_out(want_out.bytes.size()), d_dtable(want_dtable.size() * sizeof(float));
  DeviceArray d_flag(sizeof(std::int32_t));
  d_out.poison();
  d_dtable.poison();
  d_flag.upload(HostArray(DType::kInt32, 1));
  Stream stream;
  launch_embedding_forward(desc, d_table.get(), d_tokens.as<std::int32_t>(), d_out.get(), d_flag.as<std::int32_t>(),
                           stream.get());
  launch_embedding_backward(desc, d_dout.get(), d_tokens.as<std::int32_t>(), d_dtable.as<float>(), stream.get());
  EXPECT_EQ(bytes_of(d_out.download(c.dtype, want_out.numel)), want_out.bytes) << "forward differs from the host";
  EXPECT_EQ(d_flag.download(DType::kInt32, 1).get(0), 0.0f);
  const HostArray got_dtable = d_dtable.download(kFp32, static_cast<std::int64_t>(want_dtable.size()));
  EXPECT_EQ(std::memcmp(got_dtable.data(), want_dtable.data(), want_dtable.size() * sizeof(float)), 0)
      << "backward differs from the host's fp32 sums in position order";

  // Out of range: zeros and the flag on the device too.
  tokens[0] = static_cast<std::int32_t>(desc.vocab);
  std::memcpy(token_array.data(), tokens.data(), tokens.size() * sizeof(std::int32_t));
  d_tokens.upload(token_array);
  launch_embedding_forward(desc, d_table.get(), d_tokens.as<std::int32_t>(), d_out.get(), d_flag.as<std::int32_t>(),
                           stream.get());
  const HostArray flagged = d_out.download(c.dtype, want_out.numel);
  EXPECT_EQ(d_flag.download(DType::kInt32, 1).get(0), 1.0f);
  for (std::int64_t d = 0; d < desc.dim; ++d) EXPECT_EQ(flagged.get(d), 0.0f);
}

TEST(EmbeddingCudaTest, Bf16SmallDimManyRepeatsMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kBf16, 8, 16, 256, 8});
}

TEST(EmbeddingCudaTest, Fp16RaggedDimSeveralColumnBlocksMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kFp16, 37, 300, 33, 3});
}

TEST(EmbeddingCudaTest, Fp32MorePositionsThanOneTileMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kFp32, 1000, 64, 700, 4});
}

TEST(EmbeddingCudaTest, Bf16LargeVocabMatchesHostBitwise) {
  SG_SKIP_WITHOUT_GPU();
  expect_device_matches_host({kBf16, 4096, 128, 512, 8});
}

}  // namespace
}  // namespace stepgraph::kernels
