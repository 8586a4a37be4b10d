// GraphKey: value equality, a hash that follows it, the readable form, and
// the NaN and duplicate-name checks.
#include "graphs/graph_key.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_set>
#include <variant>

#include "engine/error.h"

namespace stepgraph {
namespace {

// A layer config as a caller would have it; key() turns it into a value key.
struct MlpConfig {
  std::string layer = "mlp";
  std::int64_t hidden = 512;
  double lr = 1e-3;
  Shape input{8, 512};
  DType dtype = DType::kBFloat16;
  bool fused = true;

  GraphKey key() const {
    GraphKey key;
    key.add("layer", layer).add("hidden", hidden).add("lr", lr).add("x", input).add("dtype", dtype).add("fused", fused);
    return key;
  }
};

void expect_different(const GraphKey& a, const GraphKey& b) {
  EXPECT_NE(a, b) << a.to_string() << " vs " << b.to_string();
  EXPECT_NE(a.hash(), b.hash()) << a.to_string() << " vs " << b.to_string();
}

void expect_error(const std::function<void()>& body, const std::string& needle) {
  try {
    body();
    FAIL() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(error.message().find(needle), std::string::npos) << error.message();
  }
}

TEST(GraphKeyTest, SeparatelyBuiltConfigsGiveEqualKeysAndHashes) {
  const MlpConfig first;
  const MlpConfig second;  // a distinct object with the same values
  const GraphKey a = first.key();
  const GraphKey b = second.key();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.hash(), b.hash());
  EXPECT_EQ(GraphKeyHash{}(a), GraphKeyHash{}(b));
  EXPECT_EQ(std::hash<GraphKey>{}(a), a.hash());

  std::unordered_set<GraphKey> set{a};
  EXPECT_TRUE(set.contains(b));
}

TEST(GraphKeyTest, EveryChangedFieldGivesAnotherKey) {
  const GraphKey base = MlpConfig{}.key();
  MlpConfig config;

  config = MlpConfig{};
  config.layer = "attention";
  expect_different(base, config.key());

  config = MlpConfig{};
  config.hidden = 1024;
  expect_different(base, config.key());

  config = MlpConfig{};
  config.lr = 2e-3;
  expect_different(base, config.key());

  config = MlpConfig{};
  config.input = Shape{16, 512};  // a shape change
  expect_different(base, config.key());

  config = MlpConfig{};
  config.input = Shape{8, 512, 1};  // same elements, another rank
  expect_different(base, config.key());

  config = MlpConfig{};
  config.dtype = DType::kFloat16;  // a dtype change
  expect_different(base, config.key());

  config = MlpConfig{};
  config.fused = false;
  expect_different(base, config.key());

  GraphKey extra = MlpConfig{}.key();
  extra.add("extra", 0);
  expect_different(base, extra);
}

TEST(GraphKeyTest, FieldOrderMatters) {
  GraphKey a;
  a.add("m", 4).add("n", 8);
  GraphKey b;
  b.add("n", 8).add("m", 4);
  expect_different(a, b);
}

TEST(GraphKeyTest, FieldNameMatters) {
  GraphKey a;
  a.add("m", 4);
  GraphKey b;
  b.add("n", 4);
  expect_different(a, b);
}

TEST(GraphKeyTest, TypeIsPartOfTheValue) {
  GraphKey text;
  text.add("v", "1");
  GraphKey integer;
  integer.add("v", 1);
  GraphKey real;
  real.add("v", 1.0);
  GraphKey flag;
  flag.add("v", true);
  expect_different(text, integer);
  expect_different(integer, real);
  expect_different(integer, flag);
  expect_different(real, flag);
  EXPECT_TRUE(std::holds_alternative<std::string>(text.fields()[0].value));
  EXPECT_TRUE(std::holds_alternative<std::int64_t>(integer.fields()[0].value));
  EXPECT_TRUE(std::holds_alternative<bool>(flag.fields()[0].value));
}

TEST(GraphKeyTest, StringBoundariesAreEncoded) {
  GraphKey a;
  a.add("a", "bc").add("d", "e");
  GraphKey b;
  b.add("a", "b").add("cd", "e");
  expect_different(a, b);
}

TEST(GraphKeyTest, IntegerTypesAreAllInt64) {
  GraphKey a;
  a.add("n", 512);
  GraphKey b;
  b.add("n", std::int64_t{512});
  GraphKey c;
  c.add("n", std::uint16_t{512});
  GraphKey d;
  d.add("n", std::size_t{512});
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  EXPECT_EQ(a, d);
  EXPECT_EQ(a.hash(), d.hash());
  expect_error([] { GraphKey().add("n", std::numeric_limits<std::uint64_t>::max()); }, "does not fit in int64");
}

TEST(GraphKeyTest, StringTypesAgree) {
  const std::string owned = "mlp";
  GraphKey a;
  a.add("layer", "mlp");
  GraphKey b;
  b.add("layer", owned);
  GraphKey c;
  c.add("layer", std::string_view(owned));
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  EXPECT_EQ(a.hash(), c.hash());
}

TEST(GraphKeyTest, NegativeZeroEqualsZero) {
  GraphKey a;
  a.add("x", 0.0);
  GraphKey b;
  b.add("x", -0.0);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.hash(), b.hash());
}

TEST(GraphKeyTest, ToStringFormat) {
  EXPECT_EQ(MlpConfig{}.key().to_string(), "{layer=mlp, hidden=512, lr=0.001, x=[8, 512], dtype=bf16, fused=true}");
  EXPECT_EQ(GraphKey{}.to_string(), "{}");
  GraphKey key;
  key.add("eps", 1e-7).add("scale", 0.5).add("scalar", Shape{}).add("on", false).add("acc", DType::kFloat32);
  EXPECT_EQ(key.to_string(), "{eps=1e-07, scale=0.5, scalar=[], on=false, acc=fp32}");
}

TEST(GraphKeyTest, NaNIsAnError) {
  expect_error([] { GraphKey().add("lr", std::numeric_limits<double>::quiet_NaN()); }, "NaN");
  GraphKey key;
  key.add("inf", std::numeric_limits<double>::infinity());  // infinity equals itself: fine
  GraphKey same;
  same.add("inf", std::numeric_limits<double>::infinity());
  EXPECT_EQ(key, same);
}

TEST(GraphKeyTest, DuplicateOrEmptyNameIsAnError) {
  expect_error([] { GraphKey().add("n", 1).add("n", 2); }, "added twice");
  expect_error([] { GraphKey().add("", 1); }, "need a name");
}

TEST(GraphKeyTest, NestedKeys) {
  GraphKey model_a;
  model_a.add("model", "gpt").add("mlp", MlpConfig{}.key()).add("layers", 12);
  GraphKey model_b;
  model_b.add("model", "gpt").add("mlp", MlpConfig{}.key()).add("layers", 12);
  EXPECT_EQ(model_a, model_b);
  EXPECT_EQ(model_a.hash(), model_b.hash());
  EXPECT_EQ(model_a.to_string(),
            "{model=gpt, mlp={layer=mlp, hidden=512, lr=0.001, x=[8, 512], dtype=bf16, fused=true}, layers=12}");

  MlpConfig wider;
  wider.hidden = 2048;
  GraphKey model_c;
  model_c.add("model", "gpt").add("mlp", wider.key()).add("layers", 12);
  expect_different(model_a, model_c);

  // A nested key is a copy: changing the original afterwards changes nothing.
  GraphKey layer;
  layer.add("n", 1);
  GraphKey outer;
  outer.add("layer", layer);
  layer.add("m", 2);
  EXPECT_EQ(outer.to_string(), "{layer={n=1}}");

  // Nesting is not flattening.
  GraphKey nested;
  nested.add("a", GraphKey().add("b", 1));
  GraphKey flat;
  flat.add("a", 0).add("b", 1);
  expect_different(nested, flat);
  GraphKey empty_nested;
  empty_nested.add("a", GraphKey{});
  GraphKey empty_nested_then;
  empty_nested_then.add("a", GraphKey{}).add("b", GraphKey{});
  expect_different(empty_nested, empty_nested_then);
}

}  // namespace
}  // namespace stepgraph
