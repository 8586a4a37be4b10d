// FP8 quantization's host references (kernels/fp8_quantize.h): scales,
// tensor-wise quantize with amax and transpose, 1 x 128 and 128 x 128 block
// scaling, and the delayed-scaling update, against hand-computed values and
// element-by-element recomputation.
#include "kernels/fp8_quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "engine/half_precision.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

std::vector<std::uint16_t> random_bf16(std::int64_t count, std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<std::uint16_t> values(static_cast<std::size_t>(count));
  for (auto& v : values) v = float_to_bf16(normal(rng));
  return values;
}

TEST(Fp8ScaleTest, FollowsTheRule) {
  EXPECT_EQ(fp8_scale(448.0f, Fp8Format::kE4M3, 0, false), 1.0f);
  EXPECT_EQ(fp8_scale(2.0f, Fp8Format::kE4M3, 0, false), 224.0f);
  EXPECT_EQ(fp8_scale(2.0f, Fp8Format::kE4M3, 2, false), 56.0f);        // / 2^margin
  EXPECT_EQ(fp8_scale(2.0f, Fp8Format::kE4M3, 0, true), 128.0f);        // 224 down to a power of two
  EXPECT_EQ(fp8_scale(57344.0f, Fp8Format::kE5M2, 0, false), 1.0f);
  EXPECT_EQ(fp8_scale(0.0f, Fp8Format::kE4M3, 0, true), 1.0f);          // an all-zero tensor
  EXPECT_EQ(fp8_scale(1e-40f, Fp8Format::kE4M3, 0, false), 3.402823466e38f);  // overflow clamps
  EXPECT_FALSE(amax_is_usable(NAN));
  EXPECT_FALSE(amax_is_usable(INFINITY));
  EXPECT_TRUE(amax_is_usable(0.0f));
}

TEST(Fp8QuantizeHostTest, RowwiseColumnwiseAndAmaxOnRandomBf16) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  const QuantizeDesc desc{DType::kBFloat16, Fp8Format::kE4M3, 37, 70, true, true};
  const auto x = random_bf16(desc.rows * desc.cols, rng, 3.0f);
  float expected_amax = 0.0f;
  for (const auto v : x) expected_amax = std::max(expected_amax, std::fabs(bf16_to_float(v)));
  const float scale = fp8_scale(expected_amax, desc.format, 0, false);
  std::vector<std::uint8_t> rows(x.size()), cols(x.size());
  float amax = -1.0f;
  quantize_host(desc, x.data(), scale, rows.data(), cols.data(), &amax);
  EXPECT_EQ(amax, expected_amax);
  for (std::int64_t r = 0; r < desc.rows; ++r)
    for (std::int64_t c = 0; c < desc.cols; ++c) {
      const std::uint8_t want = float_to_fp8(desc.format, bf16_to_float(x[r * desc.cols + c]) * scale);
      ASSERT_EQ(rows[r * desc.cols + c], want) << r << "," << c;
      ASSERT_EQ(cols[c * desc.rows + r], want) << r << "," << c;
    }
  // The largest magnitude lands on the format's largest finite value.
  bool hit_max = false;
  for (const auto q : rows) hit_max |= (q & 0x7f) == 0x7e;
  EXPECT_TRUE(hit_max);
}

TEST(Fp8QuantizeHostTest, NanInTheTensorMakesAmaxNan) {
  const QuantizeDesc desc{DType::kFloat32, Fp8Format::kE5M2, 1, 3, true, false};
  const float x[3] = {1.0f, NAN, 2.0f};
  std::uint8_t q[3];
  float amax = 0.0f;
  quantize_host(desc, x, 1.0f, q, nullptr, &amax);
  EXPECT_TRUE(std::isnan(amax));
  EXPECT_FALSE(amax_is_usable(amax));
}

TEST(Fp8QuantizeHostTest, BadDescriptionsAreErrors) {
  EXPECT_ERROR_CONTAINS(check_quantize({DType::kInt32, Fp8Format::kE4M3, 2, 2, true, false}), "int32");
  EXPECT_ERROR_CONTAINS(check_quantize({DType::kBFloat16, Fp8Format::kE4M3, 2, 2, false, false}), "row-wise",
                        "column-wise");
  EXPECT_ERROR_CONTAINS(check_block_quantize({DType::kBFloat16, Fp8Format::kE4M3, 4, 100, true, false},
                                             BlockShape::k1x128),
                        "[4, 100]", "divisible by 128");
  EXPECT_ERROR_CONTAINS(check_block_quantize({DType::kBFloat16, Fp8Format::kE4M3, 100, 128, true, false},
                                             BlockShape::k128x128),
                        "[100, 128]", "rows", "divisible by 128");
  EXPECT_ERROR_CONTAINS(check_block_quantize({DType::kBFloat16, Fp8Format::kE4M3, 100, 128, false, true},
                                             BlockShape::k1x128),
                        "column-wise", "rows");
  EXPECT_NO_THROW(check_block_quantize({DType::kBFloat16, Fp8Format::kE4M3, 3, 256, true, false},
                                       BlockShape::k1x128));
}

// Every block recomputed: its amax, its power-of-two scale, its bytes.
TEST(Fp8QuantizeHostTest, BlockScalingMatchesPerBlockRecomputation) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  const QuantizeDesc desc{DType::kBFloat16, Fp8Format::kE4M3, 256, 384, true, true};
  auto x = random_bf16(desc.rows * desc.cols, rng, 1.0f);
  // Blocks of very different magnitudes, and an all-zero block.
  for (std::int64_t c = 0; c < 128; ++c) x[5 * desc.cols + c] = float_to_bf16(bf16_to_float(x[5 * desc.cols + c]) * 1000.0f);
  for (std::int64_t c = 128; c < 256; ++c) x[7 * desc.cols + c] = 0;
  auto value = [&](std::int64_t r, std::int64_t c) { return bf16_to_float(x[r * desc.cols + c]); };
  for (const BlockShape shape : {BlockShape::k1x128, BlockShape::k128x128}) {
    const bool one_row = shape == BlockShape::k1x128;
    const std::int64_t row_blocks = desc.rows / 128, col_blocks = desc.cols / 128;
    // The GEMM's layouts (fp8_block_scales.h), written out: 1 x 128 outer-major,
    // 128 x 128 k-major with rows padded to 4 (384 columns: 3 blocks, padded to 4).
    const BlockScaleLayout row_layout{shape, desc.rows, desc.cols}, col_layout{shape, desc.cols, desc.rows};
    EXPECT_EQ(row_layout.count(), one_row ? col_blocks * desc.rows : row_blocks * 4);
    EXPECT_EQ(col_layout.count(), one_row ? row_blocks * desc.cols : col_blocks * 4);
    std::vector<std::uint8_t> rows(x.size()), cols(x.size());
    std::vector<float> row_scales(row_layout.count(), -1.0f), col_scales(col_layout.count(), -1.0f);
    ASSERT_TRUE(quantize_blocks_host(desc, shape, true, x.data(),
                                     {rows.data(), row_scales.data(), cols.data(), col_scales.data()}));
    auto check_block = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1, float scale_inv,
                           bool transposed) {
      float amax = 0.0f;
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(value(r, c)));
      const float scale = fp8_scale(amax, desc.format, 0, true);
      ASSERT_EQ(scale_inv, 1.0f / scale);
      int exponent = 0;
      ASSERT_EQ(std::frexp(scale, &exponent), 0.5f) << "a power of two";
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) {
          const std::uint8_t want = float_to_fp8(desc.format, value(r, c) * scale);
          ASSERT_EQ(transposed ? cols[c * desc.rows + r] : rows[r * desc.cols + c], want);
        }
    };
    if (one_row) {
      for (std::int64_t r = 0; r < desc.rows; ++r)
        for (std::int64_t b = 0; b < col_blocks; ++b)
          check_block(r, r + 1, 128 * b, 128 * (b + 1), row_scales[b * desc.rows + r], false);
      for (std::int64_t c = 0; c < desc.cols; ++c)
        for (std::int64_t b = 0; b < row_blocks; ++b)
          check_block(128 * b, 128 * (b + 1), c, c + 1, col_scales[b * desc.cols + c], true);
      EXPECT_EQ(row_scales[1 * desc.rows + 7], 1.0f);  // the all-zero block
    } else {
      for (std::int64_t i = 0; i < row_blocks; ++i)
        for (std::int64_t j = 0; j < col_blocks; ++j) {
          check_block(128 * i, 128 * (i + 1), 128 * j, 128 * (j + 1), row_scales[i * 4 + j], false);
          check_block(128 * i, 128 * (i + 1), 128 * j, 128 * (j + 1), col_scales[j * 4 + i], true);
        }
      for (std::int64_t i = 0; i < row_blocks; ++i) EXPECT_EQ(row_scales[i * 4 + 3], 0.0f) << "padding";
      for (std::int64_t j = 0; j < col_blocks; ++j) {
        for (std::int64_t pad = row_blocks; pad < 4; ++pad) EXPECT_EQ(col_scales[j * 4 + pad], 0.0f) << "padding";
      }
    }
  }
}

TEST(Fp8QuantizeHostTest, BlockWithANonFiniteValueIsReported) {
  const QuantizeDesc desc{DType::kFloat32, Fp8Format::kE4M3, 1, 128, true, false};
  std::vector<float> x(128, 1.0f);
  x[3] = INFINITY;
  std::vector<std::uint8_t> q(128);
  float scale_inv = 0.0f;
  EXPECT_FALSE(quantize_blocks_host(desc, BlockShape::k1x128, true, x.data(), {q.data(), &scale_inv}));
}

TEST(Fp8DelayedScalingTest, HistoryRollsAndTheScaleFollowsTheReduction) {
  Fp8Recipe recipe = Fp8Recipe::delayed(3, AmaxReduction::kMax, 0);
  std::vector<float> history(3, 0.0f);
  float scale = 1.0f, scale_inv = 1.0f;
  const DelayedScale state{history.data(), &scale, &scale_inv};
  ASSERT_TRUE(delayed_scaling_update_host(recipe, Fp8Format::kE4M3, 4.0f, state));
  EXPECT_EQ(history, (std::vector<float>{4.0f, 0.0f, 0.0f}));
  EXPECT_EQ(scale, 112.0f);  // 448 / 4
  ASSERT_TRUE(delayed_scaling_update_host(recipe, Fp8Format::kE4M3, 1.0f, state));
  ASSERT_TRUE(delayed_scaling_update_host(recipe, Fp8Format::kE4M3, 2.0f, state));
  EXPECT_EQ(history, (std::vector<float>{2.0f, 1.0f, 4.0f}));
  EXPECT_EQ(scale, 112.0f);  // the max is still 4
  ASSERT_TRUE(delayed_scaling_update_host(recipe, Fp8Format::kE4M3, 1.0f, state));
  EXPECT_EQ(history, (std::vector<float>{1.0f, 2.0f, 1.0f}));  // 4 dropped out
  EXPECT_EQ(scale, 224.0f);
  EXPECT_EQ(scale_inv, 1.0f / 224.0f);
  // A non-finite amax changes nothing.
  EXPECT_FALSE(delayed_scaling_update_host(recipe, Fp8Format::kE4M3, NAN, state));
  EXPECT_EQ(history, (std::vector<float>{1.0f, 2.0f, 1.0f}));
  EXPECT_EQ(scale, 224.0f);
  // Most recent, with a margin; an amax of 0 keeps the scale.
  recipe.amax_reduction = AmaxReduction::kMostRecent;
  recipe.margin = 1;
  ASSERT_TRUE(delayed_scaling_update_host(recipe, Fp8Format::kE5M2, 8.0f, state));
  EXPECT_EQ(scale, 3584.0f);  // 57344 / 8 / 2
  ASSERT_TRUE(delayed_scaling_update_host(recipe, Fp8Format::kE5M2, 0.0f, state));
  EXPECT_EQ(scale, 3584.0f);
  EXPECT_ERROR_CONTAINS(delayed_scaling_update_host(Fp8Recipe::current(), Fp8Format::kE4M3, 1.0f, state), "current",
                        "not delayed");
}

}  // namespace
}  // namespace stepgraph::kernels
