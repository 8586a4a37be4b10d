// Named operands (ops/operands.h) on a toy op: an optional operand, a list
// sized by the params and a last list as long as the inputs left.
#include "ops/operands.h"

#include <gtest/gtest.h>

#include <vector>

#include "engine/context.h"
#include "tests/support/expect_error.h"

namespace stepgraph::ops {
namespace {

struct ToyParams {
  bool with_bias = false;
  std::size_t pairs = 0;
};

template <typename F>
struct ToyOperands {
  F out;
  F bias;
  std::vector<F> pairs;
  std::vector<F> rest;
};

template <typename F, typename V>
void visit_operands(const ToyParams& p, ToyOperands<F>& o, V& v) {
  v({.name = "out", .use = Use::kWrite}, o.out);
  v({.name = "bias", .present = p.with_bias}, o.bias);
  v.list("pairs", o.pairs, p.pairs);
  for (std::size_t i = 0; i < o.pairs.size(); ++i) {
    v({.name = "pairs", .index = static_cast<std::int64_t>(i), .use = Use::kWrite}, o.pairs[i]);
  }
  v.list("rest", o.rest, kRestOfInputs);
  for (std::size_t i = 0; i < o.rest.size(); ++i) v({.name = "rest", .index = static_cast<std::int64_t>(i)}, o.rest[i]);
}

TensorMeta f32(std::int64_t n) { return {Shape{n}, DType::kFloat32}; }

TEST(OperandsTest, BindsInVisitOrderWithOptionalAndListOperands) {
  const ToyParams p{.with_bias = true, .pairs = 2};
  const std::vector<TensorMeta> inputs{f32(1), f32(2), f32(3), f32(4), f32(5), f32(6)};
  const ToyOperands<TensorMeta> o = bind_metas<ToyOperands>("toy", p, inputs);
  EXPECT_EQ(o.out, f32(1));
  EXPECT_EQ(o.bias, f32(2));
  EXPECT_EQ(o.pairs, (std::vector<TensorMeta>{f32(3), f32(4)}));
  EXPECT_EQ(o.rest, (std::vector<TensorMeta>{f32(5), f32(6)}));
  EXPECT_EQ(operand_layout<ToyOperands>(p, inputs.size()).written, (std::vector<int>{0, 2, 3}));

  const ToyOperands<int> at = operand_layout<ToyOperands>(ToyParams{.pairs = 1}, 2).at;
  EXPECT_EQ(at.bias, -1);
  EXPECT_EQ(at.pairs, (std::vector<int>{1}));
  EXPECT_TRUE(at.rest.empty());
}

TEST(OperandsTest, ArgsCarryAddressesAndMetas) {
  float a = 0, b = 0, c = 0;
  std::vector<void*> addresses{&a, &b, &c};
  const std::vector<TensorMeta> metas{f32(1), f32(2), f32(3)};
  const KernelArgs args{addresses, metas, {}, {}};
  const ToyOperands<Operand> o = bind_args<ToyOperands>(ToyParams{.pairs = 1}, args);
  EXPECT_EQ(o.out.as<float>(), &a);
  EXPECT_FALSE(o.bias.present());
  EXPECT_EQ(o.bias.data, nullptr);
  EXPECT_EQ(o.pairs.at(0).as<float>(), &b);
  ASSERT_EQ(o.rest.size(), 1u);
  EXPECT_EQ(o.rest[0].numel(), 3);
}

TEST(OperandsTest, CountErrorsNameTheOperands) {
  const std::vector<TensorMeta> one{f32(1)};
  EXPECT_ERROR_CONTAINS(bind_metas<ToyOperands>("toy", ToyParams{.with_bias = true, .pairs = 1}, one),
                        "op toy takes out, bias, pairs[0] and then its rest list; got 1 inputs");
}

TEST(OperandsTest, FlattenChecksPresenceAndListSizes) {
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", f32(1));
  ToyOperands<Tensor> o{.out = x, .pairs = {x}, .rest = {x, x, x}};
  EXPECT_EQ(flatten("toy", ToyParams{.pairs = 1}, o).size(), 5u);
  EXPECT_ERROR_CONTAINS(flatten("toy", ToyParams{.with_bias = true, .pairs = 1}, o),
                        "op toy: operand 'bias' is missing");
  EXPECT_ERROR_CONTAINS(flatten("toy", ToyParams{.pairs = 2}, o),
                        "operand list 'pairs' holds 1 elements, its params say 2");
  o.pairs[0] = Tensor();
  EXPECT_ERROR_CONTAINS(flatten("toy", ToyParams{.pairs = 1}, o), "operand 'pairs[0]' is missing");
}

template <typename F>
struct TailOperands {
  F x;
  F gates;
};

template <typename F, typename V>
void visit_operands(const NoParams&, TailOperands<F>& o, V& v) {
  v({"x"}, o.x);
  v.optional_last({"gates"}, o.gates);
}

TEST(OperandsTest, AnOptionalLastOperandIsThereWhenTheCallGivesIt) {
  EXPECT_EQ(operand_layout<TailOperands>(NoParams{}, 1).at.gates, -1);
  EXPECT_EQ(operand_layout<TailOperands>(NoParams{}, 2).at.gates, 1);
  const std::vector<TensorMeta> three{f32(1), f32(2), f32(3)};
  EXPECT_ERROR_CONTAINS(bind_metas<TailOperands>("tail", NoParams{}, three), "op tail takes 2 inputs",
                        "x, gates (optional)", "got 3");
  Context ctx(Device::kHost);
  const Tensor x = ctx.persistent("x", f32(1));
  EXPECT_EQ(flatten("tail", NoParams{}, TailOperands<Tensor>{.x = x}).size(), 1u);
  EXPECT_EQ(flatten("tail", NoParams{}, TailOperands<Tensor>{.x = x, .gates = x}).size(), 2u);
}

}  // namespace
}  // namespace stepgraph::ops
