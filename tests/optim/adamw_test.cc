// AdamW refuses bad hyperparameters when it is built (the C API's
// sg_adamw_create and the Python binding reach this constructor), not at the
// first step; the valid neighbours of each bad value are accepted.
#include "kernels/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "optim/adamw.h"
#include "layers/parameter.h"
#include "tests/support/expect_error.h"

namespace stepgraph {
namespace {

class AdamWConstruction : public ::testing::Test {
 protected:
  Context ctx{Device::kHost};
  Parameter weight = make_parameter(ctx, "w", Shape{4}, DType::kFloat32, constant_init(4, 1.0f));
  std::vector<Parameter*> parameters{&weight};

  template <typename Edit>
  kernels::AdamWHyper with(Edit&& edit) {
    kernels::AdamWHyper hyper;
    edit(hyper);
    return hyper;
  }
};

TEST_F(AdamWConstruction, BadHyperparameters_AreRefusedByTheConstructor) {
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.lr = -1e-3f; })), "lr must be finite and >= 0");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.lr = NAN; })), "lr must be finite");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.beta1 = 1.0f; })), "beta1 must be in [0, 1)");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.beta1 = -0.1f; })), "beta1 must be in [0, 1)");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.beta2 = 1.5f; })), "beta2 must be in [0, 1)");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.eps = NAN; })), "eps must be finite and >= 0");
  EXPECT_ERROR_CONTAINS(AdamW(ctx, parameters, with([](auto& h) { h.weight_decay = -0.01f; })),
                        "weight_decay must be finite and >= 0");
}

TEST_F(AdamWConstruction, EdgeValues_AreAccepted_AndStep) {
  const AdamW optimizer(ctx, parameters, with([](auto& h) {
                          h.lr = 0.0f;
                          h.beta1 = 0.0f;
                          h.beta2 = 0.0f;
                          h.eps = 0.0f;
                          h.weight_decay = 0.0f;
                        }));
  EXPECT_NO_THROW(optimizer.step(ctx));
}

}  // namespace
}  // namespace stepgraph
