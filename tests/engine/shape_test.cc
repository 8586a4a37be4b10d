#include "engine/shape.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <sstream>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

TEST(ShapeTest, ScalarHasRankZeroAndOneElement) {
  const Shape scalar;
  EXPECT_EQ(scalar.rank(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.to_string(), "[]");
}

TEST(ShapeTest, NumelBytesAndDims) {
  const Shape shape{7, 13, 3};
  EXPECT_EQ(shape.rank(), 3);
  EXPECT_EQ(shape.numel(), 273);
  EXPECT_EQ(shape.bytes(2), 546);
  EXPECT_EQ(shape.dim(0), 7);
  EXPECT_EQ(shape.dim(-1), 3);
  EXPECT_EQ(shape.dim(-3), 7);
  EXPECT_EQ(shape.to_string(), "[7, 13, 3]");
  std::ostringstream out;
  out << shape;
  EXPECT_EQ(out.str(), "[7, 13, 3]");
}

TEST(ShapeTest, ZeroSizedDimensionGivesZeroElements) { EXPECT_EQ((Shape{4, 0, 9}).numel(), 0); }

TEST(ShapeTest, Equality) {
  EXPECT_EQ((Shape{2, 3}), (Shape{2, 3}));
  EXPECT_NE((Shape{2, 3}), (Shape{3, 2}));
  EXPECT_NE((Shape{6}), (Shape{2, 3}));
}

TEST(ShapeTest, NegativeDimensionIsAnError) {
  try {
    Shape bad{3, -1};
    FAIL() << "accepted " << bad;
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find("dimension 1 is -1"), std::string::npos) << error.message();
  }
}

TEST(ShapeTest, DimIndexOutOfRangeIsAnError) {
  const Shape shape{2, 3};
  EXPECT_ERROR_CONTAINS(shape.dim(2), "dimension index 2 is out of range for shape");
  EXPECT_ERROR_CONTAINS(shape.dim(-3), "dimension index -3 is out of range", "of rank 2");
}

TEST(ShapeTest, OverflowingElementCountIsAnError) {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max() / 2;
  EXPECT_ERROR_CONTAINS((Shape{big, 3}).numel(), "more elements than int64 can count");
  EXPECT_ERROR_CONTAINS((Shape{big}).bytes(4), "more bytes than int64 can count");
}

}  // namespace
}  // namespace stepgraph
