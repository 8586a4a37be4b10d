#include "engine/dtype.h"

#include <gtest/gtest.h>

#include <string>

#include "engine/error.h"

namespace stepgraph {
namespace {

TEST(DTypeTest, SizesMatchTheFormats) {
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kFloat8E5M2), 1u);
  EXPECT_EQ(dtype_size(DType::kInt32), 4u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
}

TEST(DTypeTest, NamesRoundTrip) {
  for (DType dtype : kAllDTypes) {
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype) << dtype_name(dtype);
  }
  EXPECT_EQ(dtype_name(DType::kBFloat16), "bf16");
  EXPECT_EQ(dtype_name(DType::kFloat8E4M3), "fp8_e4m3");
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(parse_dtype("float32"), DType::kFloat32);
}

TEST(DTypeTest, Classification) {
  EXPECT_TRUE(is_floating_point(DType::kBFloat16));
  EXPECT_FALSE(is_floating_point(DType::kInt64));
  EXPECT_TRUE(is_fp8(DType::kFloat8E5M2));
  EXPECT_FALSE(is_fp8(DType::kFloat16));
}

TEST(DTypeTest, UnknownNameListsTheValidOnes) {
  try {
    parse_dtype("fp4");
    FAIL() << "parse_dtype accepted fp4";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find("unknown dtype 'fp4'"), std::string::npos) << error.message();
    EXPECT_NE(error.message().find("fp8_e5m2"), std::string::npos) << error.message();
  }
}

}  // namespace
}  // namespace stepgraph
