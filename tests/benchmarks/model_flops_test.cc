// The model FLOP count behind MFU: 6 * tokens * matmul parameters per token
// plus the attention core, checked against the numbers written out by hand.
#include "benchmarks/model_flops.h"

#include <gtest/gtest.h>

#include "benchmarks/step_configs.h"
#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph::bench {
namespace {

TEST(ModelFlopsTest, DenseConfigsCountBlocksAndHead) {
  // small: 8 blocks of QKV 512x1536 + projection 512x512 + MLP 2*512*2048, plus a 512x8192 head.
  EXPECT_EQ(matmul_params_per_token(step_config("small").model),
            8 * (512 * 1536 + 512 * 512 + 2 * 512 * 2048) + 512 * 8192);
  EXPECT_EQ(matmul_params_per_token(step_config("medium").model),
            8LL * (4 * 2048 * 2048 + 2 * 2048 * 8192) + 2048 * 8192);
  EXPECT_EQ(matmul_params_per_token(step_config("large").model),
            4LL * (4 * 4096 * 4096 + 2 * 4096 * 16384) + 4096 * 8192);
  // Without attention (heads 0): the MLPs and the head alone, no attention core.
  ResidualStackConfig mlp_blocks = step_config("large").model;
  mlp_blocks.heads = 0;
  EXPECT_EQ(matmul_params_per_token(mlp_blocks), 4LL * 2 * 4096 * 16384 + 4096 * 8192);
  EXPECT_DOUBLE_EQ(step_flops(mlp_blocks, 8192, 2), 6.0 * 8192 * 570425344.0);
}

TEST(ModelFlopsTest, AttentionCoreIsCausalFlashAttentionConvention) {
  // large: 2 sequences of 4096, 32 heads of 128, 4 layers. Forward per layer and sequence:
  // QK^T and PV, 2 * L * L * H * D each, causal half: 2 * 4096^2 * 4096; backward 2.5x.
  const ResidualStackConfig large = step_config("large").model;
  const double forward = 2.0 * 2.0 * (4096.0 * 4096.0 / 2.0) * 32 * 128;
  EXPECT_DOUBLE_EQ(attention_core_flops(large, 8192, 2), 4 * 2 * 3.5 * forward);
  // One sequence of 8192 instead: 2x the pairs.
  EXPECT_DOUBLE_EQ(attention_core_flops(large, 8192, 1), 2 * attention_core_flops(large, 8192, 2));
  const double params = 4.0 * (4 * 4096 * 4096 + 2 * 4096 * 16384) + 4096 * 8192;
  EXPECT_DOUBLE_EQ(step_flops(large, 8192, 2), 6.0 * 8192 * params + 4 * 2 * 3.5 * forward);
  // small: 1 sequence of 256, 8 heads of 64, 8 layers.
  EXPECT_DOUBLE_EQ(attention_core_flops(step_config("small").model, 256, 1), 8 * 7.0 * 256 * 256 * 8 * 64);
  ResidualStackConfig no_attention = step_config("small").model;
  no_attention.heads = 0;
  EXPECT_DOUBLE_EQ(attention_core_flops(no_attention, 256, 1), 0.0);
  // Grouped-query attention: fewer K/V heads shrink the QKV projection, not the core.
  ResidualStackConfig gqa = large;
  gqa.kv_heads = 8;
  EXPECT_EQ(matmul_params_per_token(gqa),
            4LL * (4096 * (32 + 16) * 128 + 4096 * 4096 + 2 * 4096 * 16384) + 4096 * 8192);
  EXPECT_DOUBLE_EQ(attention_core_flops(gqa, 8192, 2), attention_core_flops(large, 8192, 2));
}

TEST(ModelFlopsTest, MoEBlocksCountTheRouterAndTopKExperts) {
  // moe: every block has attention (16 heads of 128: 4 * 2048^2) and routes (2048 x 8 router) to 2 experts of
  // 2*2048*8192.
  const std::int64_t attention = 4LL * 2048 * 2048;
  EXPECT_EQ(matmul_params_per_token(step_config("moe").model),
            4LL * (attention + 2048 * 8 + 2 * 2 * 2048 * 8192) + 2048 * 8192);
  // Every second block MoE (blocks 1 and 3 of 4), top-1.
  ResidualStackConfig config = step_config("moe").model;
  config.moe_every = 2;
  config.topk = 1;
  const std::int64_t mlp = 2LL * 2048 * 8192;
  EXPECT_EQ(matmul_params_per_token(config), 4 * attention + 2 * mlp + 2 * (2048 * 8 + mlp) + 2048 * 8192);
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
  EXPECT_ERROR_CONTAINS(attention_core_flops(step_config("small").model, 256, 3), "256 tokens do not split into 3");
  ResidualStackConfig odd = step_config("small").model;
  odd.heads = 7;
  EXPECT_ERROR_CONTAINS(matmul_params_per_token(odd), "heads 7 must divide hidden 512");
}

}  // namespace
}  // namespace stepgraph::bench
