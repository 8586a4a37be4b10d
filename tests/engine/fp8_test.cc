// FP8 formats on the host (engine/fp8.h) against an independent brute force
// (the nearest of all 256 codes, ties to the even code), and the FP8 recipes
// as values (engine/fp8_recipe.h) and graph keys.
#include "engine/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "engine/error.h"
#include "engine/fp8_recipe.h"
#include "graphs/graph_key.h"
#include "tests/support/expect_error.h"
#include "tests/support/seed.h"

namespace stepgraph {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

// The nearest finite code to |value| <= max, ties to the even code, with the sign.
std::uint8_t brute_force_encode(Fp8Format format, float value) {
  if (std::isnan(value)) return 0x7f;
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0;
  const double magnitude = std::fabs(static_cast<double>(value));
  if (magnitude > fp8_max(format)) return sign | (format == Fp8Format::kE4M3 ? 0x7e : 0x7b);
  int best = 0;
  double best_distance = INFINITY;
  for (int code = 0; code < 0x80; ++code) {
    const double candidate = fp8_to_float(format, static_cast<std::uint8_t>(code));
    if (!std::isfinite(candidate)) continue;
    const double distance = std::fabs(candidate - magnitude);
    if (distance < best_distance || (distance == best_distance && (code & 1) == 0)) {
      best = code;
      best_distance = distance;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

TEST(Fp8Test, DecodesTheFormatsLandmarks) {
  EXPECT_EQ(fp8_max(Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(fp8_max(Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(fp8_to_float(Fp8Format::kE4M3, 0x38), 1.0f);
  EXPECT_EQ(fp8_to_float(Fp8Format::kE5M2, 0x3c), 1.0f);
  EXPECT_EQ(fp8_to_float(Fp8Format::kE4M3, 0x01), std::ldexp(1.0f, -9));   // smallest subnormal
  EXPECT_EQ(fp8_to_float(Fp8Format::kE5M2, 0x01), std::ldexp(1.0f, -16));  // smallest subnormal
  EXPECT_EQ(fp8_to_float(Fp8Format::kE4M3, 0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_to_float(Fp8Format::kE4M3, 0x7f)));
  EXPECT_TRUE(std::isnan(fp8_to_float(Fp8Format::kE4M3, 0xff)));
  EXPECT_EQ(fp8_to_float(Fp8Format::kE5M2, 0x7c), INFINITY);
  EXPECT_TRUE(std::isnan(fp8_to_float(Fp8Format::kE5M2, 0x7d)));
  EXPECT_EQ(fp8_dtype(Fp8Format::kE4M3), DType::kFloat8E4M3);
  EXPECT_EQ(fp8_format_name(Fp8Format::kE5M2), "e5m2");
}

TEST(Fp8Test, EveryFiniteCodeRoundTrips) {
  for (const Fp8Format format : kFormats) {
    for (int code = 0; code < 256; ++code) {
      const float value = fp8_to_float(format, static_cast<std::uint8_t>(code));
      if (!std::isfinite(value)) continue;
      // -0 encodes as 0x80, +0 as 0x00: the round trip keeps the sign.
      EXPECT_EQ(float_to_fp8(format, value), code) << fp8_format_name(format) << " code " << code;
    }
  }
}

TEST(Fp8Test, RoundsToNearestEvenAndSaturates) {
  // E4M3 between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even code.
  EXPECT_EQ(float_to_fp8(Fp8Format::kE4M3, 1.0625f), 0x38);
  EXPECT_EQ(float_to_fp8(Fp8Format::kE4M3, 1.0625001f), 0x39);
  EXPECT_EQ(float_to_fp8(Fp8Format::kE4M3, 1.1875f), 0x3a);  // midpoint of 0x39 and 0x3a: even
  EXPECT_EQ(float_to_fp8(Fp8Format::kE4M3, 300.5f), 0x79);   // 288, the grid is 32 apart there
  for (const Fp8Format format : kFormats) {
    const std::uint8_t max_code = format == Fp8Format::kE4M3 ? 0x7e : 0x7b;
    EXPECT_EQ(float_to_fp8(format, 1e30f), max_code);
    EXPECT_EQ(float_to_fp8(format, INFINITY), max_code);
    EXPECT_EQ(float_to_fp8(format, -INFINITY), 0x80 | max_code);
    EXPECT_EQ(float_to_fp8(format, NAN), 0x7f);
    EXPECT_EQ(float_to_fp8(format, 1e-30f), 0x00);   // underflows to zero
    EXPECT_EQ(float_to_fp8(format, -1e-30f), 0x80);  // keeps its sign
  }
}

TEST(Fp8Test, EncodesAsTheNearestCodeOnRandomValues) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  for (const Fp8Format format : kFormats) {
    // Every midpoint between neighbouring codes, and random values over the whole range.
    for (int code = 0; code < 0x7e; ++code) {
      const float low = fp8_to_float(format, static_cast<std::uint8_t>(code));
      const float high = fp8_to_float(format, static_cast<std::uint8_t>(code + 1));
      if (!std::isfinite(high)) continue;
      const float middle = 0.5f * (low + high);
      ASSERT_EQ(float_to_fp8(format, middle), brute_force_encode(format, middle)) << middle;
      ASSERT_EQ(float_to_fp8(format, -middle), brute_force_encode(format, -middle)) << -middle;
    }
    std::uniform_real_distribution<float> exponent(-24.0f, 17.0f);
    for (int i = 0; i < 20000; ++i) {
      const float value = (rng() % 2 ? 1.0f : -1.0f) * std::exp2(exponent(rng));
      ASSERT_EQ(float_to_fp8(format, value), brute_force_encode(format, value))
          << fp8_format_name(format) << " " << value;
    }
  }
}

TEST(Fp8RecipeTest, EqualRecipesHashAndKeyEqualAndAnyChangedFieldDoesNot) {
  const Fp8Recipe a = Fp8Recipe::delayed(16, AmaxReduction::kMax, 1);
  Fp8Recipe b;  // built another way
  b.scaling = Fp8Scaling::kDelayed;
  b.amax_history_len = 16;
  b.margin = 1;
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.hash(), b.hash());
  GraphKey ka, kb;
  ka.add("fp8", a);
  kb.add("fp8", b);
  EXPECT_EQ(ka, kb);
  EXPECT_EQ(ka.hash(), kb.hash());

  Fp8Recipe changed = a;
  for (int field = 0; field < 7; ++field) {
    changed = a;
    switch (field) {
      case 0: changed.formats = Fp8Formats::kE4M3; break;
      case 1: changed.amax_history_len = 17; break;
      case 2: changed.amax_reduction = AmaxReduction::kMostRecent; break;
      case 3: changed.margin = 2; break;
      case 4: changed.fast_accumulation_forward = false; break;
      case 5: changed.fast_accumulation_backward = true; break;
      case 6: changed.on_non_finite = NonFiniteAmax::kStop; break;
    }
    GraphKey kc;
    kc.add("fp8", changed);
    EXPECT_NE(changed, a) << "field " << field;
    EXPECT_NE(kc, ka) << "field " << field << ": " << changed.to_string();
  }
}

TEST(Fp8RecipeTest, FieldsAScalingIgnoresDoNotCount) {
  Fp8Recipe current = Fp8Recipe::current();
  Fp8Recipe other = current;
  other.amax_history_len = 7;  // delayed only
  other.margin = 3;            // delayed only
  other.power_of_two_scales = false;  // block only
  EXPECT_EQ(current, other);
  EXPECT_EQ(current.to_string(), other.to_string());
  EXPECT_EQ(current.to_string(),
            "{scaling=current, formats=hybrid, fast_accumulation_forward=true, fast_accumulation_backward=false, "
            "on_non_finite=skip_step}");
  Fp8Recipe block = Fp8Recipe::block();
  Fp8Recipe block_exact = block;
  block_exact.power_of_two_scales = false;
  EXPECT_NE(block, block_exact);
  EXPECT_NE(Fp8Recipe::current(), Fp8Recipe::block());
}

TEST(Fp8RecipeTest, FieldsOutOfRangeAreErrorsNamingThem) {
  EXPECT_NO_THROW(Fp8Recipe::delayed().check());
  EXPECT_ERROR_CONTAINS(Fp8Recipe::delayed(0).check(), "amax_history_len", "[1, 65536]", "0");
  EXPECT_ERROR_CONTAINS(Fp8Recipe::delayed(8, AmaxReduction::kMax, -1).check(), "margin", "-1");
  EXPECT_ERROR_CONTAINS(parse_fp8_scaling("tensor"), "'tensor'", "current, delayed, block");
  EXPECT_EQ(parse_fp8_scaling("block"), Fp8Scaling::kBlock);
  // A current recipe's unused history length is not checked.
  Fp8Recipe current = Fp8Recipe::current();
  current.amax_history_len = 0;
  EXPECT_NO_THROW(current.check());
}

TEST(Fp8RecipeTest, FormatsFollowTheRecipe) {
  Fp8Recipe recipe = Fp8Recipe::current();
  EXPECT_EQ(recipe.forward_format(), Fp8Format::kE4M3);
  EXPECT_EQ(recipe.gradient_format(), Fp8Format::kE5M2);
  recipe.formats = Fp8Formats::kE4M3;
  EXPECT_EQ(recipe.gradient_format(), Fp8Format::kE4M3);
}

}  // namespace
}  // namespace stepgraph
