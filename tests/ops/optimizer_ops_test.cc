// AdamW's named operands (layout, flattening, count errors), its params'
// equality with a device rate, and a host update through the op against the
// kernel's host reference called directly.
#include "ops/optimizer_ops.h"

#include <gtest/gtest.h>

#include <vector>

#include "engine/context.h"
#include "kernels/adamw.h"
#include "kernels/step_guard.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

using ops::AdamWOperands;
using ops::AdamWParams;

TensorMeta f32(std::int64_t n) { return {Shape{n}, DType::kFloat32}; }

// Two parameters, the first with a bf16 copy, a device rate and unscaling.
AdamWParams two_parameters() {
  AdamWParams p;
  p.has_copy = {true, false};
  p.total_numel = 6;
  p.device_lr = true;
  p.unscale_grads = true;
  return p;
}

TEST(AdamWOperandsTest, LayoutKeepsTheProgramOrder) {
  const AdamWParams p = two_parameters();
  const AdamWOperands<int> at = ops::operand_layout<AdamWOperands>(p, 13).at;
  EXPECT_EQ(at.table, 0);
  EXPECT_EQ(at.step, 1);
  ASSERT_EQ(at.params.size(), 2u);
  EXPECT_EQ(at.params[0].master, 2);
  EXPECT_EQ(at.params[0].grad, 3);
  EXPECT_EQ(at.params[0].copy, 6);
  EXPECT_EQ(at.params[1].master, 7);
  EXPECT_EQ(at.params[1].v, 10);
  EXPECT_EQ(at.params[1].copy, -1);
  EXPECT_EQ(at.lr, 11);
  EXPECT_EQ(at.loss_scale, 12);
}

TEST(AdamWOperandsTest, WrittenInputsFollowTheParams) {
  AdamWParams p = two_parameters();
  EXPECT_EQ(ops::adamw_op().written_inputs(p, 13), (std::vector<int>{1, 2, 4, 5, 6, 7, 9, 10}));
  p.advance_step = false;
  p.table_from_operands = true;
  EXPECT_EQ(ops::adamw_op().written_inputs(p, 13), (std::vector<int>{0, 2, 4, 5, 6, 7, 9, 10}));
}

TEST(AdamWOperandsTest, CheckNamesTheOperandsWhenTheCountIsOff) {
  const AdamWParams p = two_parameters();
  std::vector<TensorMeta> inputs(12, f32(3));
  EXPECT_ERROR_CONTAINS(ops::adamw_op().check(p, inputs), "op adamw takes 13 inputs", "table, step, master[0]",
                        "loss_scale", "got 12");
}

TEST(AdamWOperandsTest, FlattenRefusesOperandsTheParamsDoNotAskFor) {
  Context ctx(Device::kHost);
  AdamWParams p;
  p.has_copy = {false};
  p.total_numel = 3;
  const Tensor x = ctx.persistent("x", f32(3));
  AdamWOperands<Tensor> o{.table = x, .step = x, .params = {{x, x, x, x, {}}}};
  EXPECT_EQ(ops::flatten("adamw", p, o).size(), 6u);
  o.lr = x;
  EXPECT_ERROR_CONTAINS(ops::adamw_step(ctx, p, o), "operand 'lr' is given", "params leave it out");
  p.device_lr = true;
  o.lr = {};
  EXPECT_ERROR_CONTAINS(ops::adamw_step(ctx, p, o), "operand 'lr' is missing");
  p.device_lr = false;
  o.params.push_back(o.params[0]);
  EXPECT_ERROR_CONTAINS(ops::adamw_step(ctx, p, o), "operand list 'params' holds 2 elements, its params say 1");
}

TEST(AdamWParamsTest, ADeviceRateLeavesHyperLrOutOfEquality) {
  AdamWParams a = two_parameters();
  AdamWParams b = a;
  b.hyper.lr = a.hyper.lr * 2;
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.to_string(), b.to_string());
  EXPECT_NE(a.to_string().find("lr read on the device"), std::string::npos) << a.to_string();
  a.device_lr = b.device_lr = false;
  EXPECT_NE(a, b);
  EXPECT_NE(a.to_string(), b.to_string());
}

Tensor from(Context& ctx, const char* name, const std::vector<float>& values) {
  Tensor t = ctx.persistent(name, f32(static_cast<std::int64_t>(values.size())));
  ctx.copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

TEST(AdamWOpTest, HostUpdateReadsTheRateAndTheLossScaleByName) {
  Context ctx(Device::kHost);
  const std::vector<float> w0 = {1, -2, 3}, g0 = {8, 4, -2}, zeros = {0, 0, 0};
  const std::vector<float> rate = {0.25f}, state = {4.0f, 0.25f, 0.0f};
  AdamWParams p;
  p.hyper.lr = 100.0f;  // unused: the rate is read on the device
  p.hyper.weight_decay = 0.1f;
  p.has_copy = {false};
  p.total_numel = 3;
  p.device_lr = true;
  p.unscale_grads = true;
  const Tensor table = ctx.persistent("table", {Shape{1}, DType::kInt64});
  const Tensor step = ctx.persistent("step", {Shape{1}, DType::kInt64});
  const std::int64_t zero = 0;
  ctx.copy_from_host(step, &zero, sizeof(zero));
  const Tensor w = from(ctx, "w", w0), g = from(ctx, "g", g0), m = from(ctx, "m", zeros), v = from(ctx, "v", zeros);
  ops::adamw_step(ctx, p,
                  {.table = table,
                   .step = step,
                   .params = {{.master = w, .grad = g, .m = m, .v = v}},
                   .lr = from(ctx, "lr", rate),
                   .loss_scale = from(ctx, "state", state)});

  std::vector<float> w1 = w0, m1 = zeros, v1 = zeros;
  std::int64_t step1 = 0;
  const std::vector<kernels::AdamWTensor> expected{{w1.data(), g0.data(), m1.data(), v1.data(), nullptr, 3, false}};
  kernels::host::adamw(p.hyper, expected, &step1, true, rate.data(), &state[1]);
  EXPECT_EQ(ctx.to_vector<float>(w), w1);
  EXPECT_EQ(ctx.to_vector<float>(m), m1);
  EXPECT_EQ(ctx.to_vector<std::int64_t>(step), (std::vector<std::int64_t>{1}));
}

}  // namespace
}  // namespace stepgraph
