// The model FLOP count behind MFU: 6 * tokens * matmul parameters per token,
// checked against the numbers written out by hand.
#include "benchmarks/model_flops.h"

#include <gtest/gtest.h>

#include "benchmarks/step_configs.h"
#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph::bench {
namespace {

TEST(ModelFlopsTest, DenseConfigsCountBlocksAndHead) {
  // small: 8 blocks of 2*512*2048 plus a 512x8192 head.
  EXPECT_EQ(matmul_params_per_token(step_config("small").model), 8 * 2 * 512 * 2048 + 512 * 8192);
  EXPECT_EQ(matmul_params_per_token(step_config("medium").model), 8LL * 2 * 2048 * 8192 + 2048 * 8192);
  EXPECT_EQ(matmul_params_per_token(step_config("large").model), 4LL * 2 * 4096 * 16384 + 4096 * 8192);
  // large: 6 * 8192 tokens * 570425344 parameters = 28.04 TFLOP per step.
  EXPECT_DOUBLE_EQ(step_flops(step_config("large").model, 8192), 6.0 * 8192 * 570425344.0);
}

TEST(ModelFlopsTest, MoEBlocksCountTheRouterAndTopKExperts) {
  // moe: every block routes (2048 x 8 router) to 2 experts of 2*2048*8192.
  EXPECT_EQ(matmul_params_per_token(step_config("moe").model), 4LL * (2048 * 8 + 2 * 2 * 2048 * 8192) + 2048 * 8192);
  // Every second block MoE (blocks 1 and 3 of 4), top-1.
  ResidualStackConfig config = step_config("moe").model;
  config.moe_every = 2;
  config.topk = 1;
  const std::int64_t mlp = 2LL * 2048 * 8192;
  EXPECT_EQ(matmul_params_per_token(config), 2 * mlp + 2 * (2048 * 8 + mlp) + 2048 * 8192);
}

TEST(ModelFlopsTest, TflopsAndMfu) {
  EXPECT_DOUBLE_EQ(tflops_per_s(989e12, 1.0), 989.0);
  EXPECT_DOUBLE_EQ(mfu(494.5), 0.5);
  EXPECT_DOUBLE_EQ(tflops_per_s(2e12, 0.5), 4.0);
}

TEST(ModelFlopsTest, BadInputsAreErrors) {
  ResidualStackConfig config = step_config("moe").model;
  config.topk = 9;
  EXPECT_ERROR_CONTAINS(matmul_params_per_token(config), "matmul_params_per_token", "topk must be in [1, experts]",
                        "got topk 9");
  EXPECT_ERROR_CONTAINS(step_flops(step_config("small").model, 0), "step_flops: tokens must be > 0, got 0");
  EXPECT_ERROR_CONTAINS(tflops_per_s(1.0, 0.0), "tflops_per_s: seconds must be > 0, got 0");
}

}  // namespace
}  // namespace stepgraph::bench
