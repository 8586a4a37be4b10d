// The named configs of step_bench: the small, medium, large and moe shapes, and clear
// errors for bad --configs lists.
#include "benchmarks/step_configs.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "engine/error.h"

namespace stepgraph::bench {
namespace {

TEST(StepConfigsTest, BenchmarkConfigsHaveTheIssueShapes) {
  const std::vector<StepConfig>& configs = benchmark_configs();
  ASSERT_EQ(configs.size(), 4u);
  struct Expected {
    const char* name;
    std::int64_t hidden, heads, ffn, layers, seq_len, sequences, tokens, experts;
  };
  const Expected expected[] = {{"small", 512, 8, 2048, 8, 256, 1, 256, 0},
                               {"medium", 2048, 16, 8192, 8, 2048, 2, 4096, 0},
                               {"large", 4096, 32, 16384, 4, 4096, 2, 8192, 0},
                               {"moe", 2048, 16, 8192, 4, 4096, 2, 8192, 8}};
  for (std::size_t i = 0; i < configs.size(); ++i) {
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(configs[i].name, expected[i].name);
    EXPECT_EQ(configs[i].model.hidden, expected[i].hidden);
    EXPECT_EQ(configs[i].model.heads, expected[i].heads);
    EXPECT_EQ(configs[i].model.kv_heads, 0);  // = heads
    EXPECT_EQ(configs[i].model.rope_base, 10000.0f);
    EXPECT_EQ(configs[i].model.ffn, expected[i].ffn);
    EXPECT_EQ(configs[i].model.layers, expected[i].layers);
    EXPECT_EQ(configs[i].seq_len, expected[i].seq_len);
    EXPECT_EQ(configs[i].sequences, expected[i].sequences);
    EXPECT_EQ(configs[i].tokens, expected[i].tokens);
    EXPECT_EQ(configs[i].tokens, configs[i].sequences * configs[i].seq_len);
    EXPECT_EQ(configs[i].model.experts, expected[i].experts);
    EXPECT_EQ(configs[i].model.vocab, kBenchVocab);
    EXPECT_EQ(configs[i].model.dtype, DType::kBFloat16);
    EXPECT_TRUE(configs[i].has_attention());
  }
  // Head dims: 64 for small, 128 for the others.
  EXPECT_EQ(configs[0].model.hidden / configs[0].model.heads, 64);
  for (std::size_t i = 1; i < configs.size(); ++i) EXPECT_EQ(configs[i].model.hidden / configs[i].model.heads, 128);
  EXPECT_EQ(configs[3].model.topk, 2);
  EXPECT_EQ(configs[3].model.moe_every, 1);
}

TEST(StepConfigsTest, TinyHasAttention) {
  const StepConfig tiny = step_config("tiny");
  EXPECT_EQ(tiny.model.hidden, 64);
  EXPECT_EQ(tiny.model.heads, 2);
  EXPECT_EQ(tiny.sequences, 2);
  EXPECT_EQ(tiny.seq_len, 32);
  EXPECT_EQ(tiny.tokens, 64);
}

// step_bench --ep 2's host config: tiny's GPT with every block MoE, its experts splitting over two ranks.
TEST(StepConfigsTest, MoeTinyIsTinyWithExpertsThatSplitOverTwoRanks) {
  const StepConfig c = step_config("moe_tiny");
  const StepConfig tiny = step_config("tiny");
  EXPECT_EQ(c.name, "moe_tiny");
  EXPECT_EQ(c.model.hidden, tiny.model.hidden);
  EXPECT_EQ(c.model.heads, tiny.model.heads);
  EXPECT_EQ(c.model.layers, tiny.model.layers);
  EXPECT_EQ(c.model.vocab, tiny.model.vocab);
  EXPECT_EQ(c.tokens, tiny.tokens);
  EXPECT_EQ(c.model.experts, 4);
  EXPECT_EQ(c.model.experts % 2, 0);
  EXPECT_EQ(c.model.topk, 2);
  EXPECT_EQ(c.model.moe_every, 1);
  EXPECT_EQ(tiny.model.experts, 0);  // tiny stays dense
  EXPECT_EQ(parse_config_list("tiny,moe_tiny").at(1).name, "moe_tiny");
}

// step_bench --cp 2's config: medium's shape, one sequence of 16k, cut into 2 x 2 context-parallel chunks at 32k.
TEST(StepConfigsTest, LongIsMediumsShapeWithOneSequenceOf16k) {
  const StepConfig c = step_config("long");
  const StepConfig medium = step_config("medium");
  EXPECT_EQ(c.model.hidden, medium.model.hidden);
  EXPECT_EQ(c.model.heads, medium.model.heads);
  EXPECT_EQ(c.model.ffn, medium.model.ffn);
  EXPECT_EQ(c.model.layers, medium.model.layers);
  EXPECT_EQ(c.sequences, 1);
  EXPECT_EQ(c.seq_len, 16384);
  EXPECT_EQ(c.tokens, 16384);
  EXPECT_EQ(parse_config_list("long").at(0).name, "long");
}

// step_bench --tp 2 runs the GPT configs whose sequences split over two ranks (Note [Tensor-parallel rows]).
TEST(StepConfigsTest, MediumAndLargeSplitOverTwoTensorParallelRanks) {
  for (const char* name : {"medium", "large", "tiny"}) {
    const StepConfig c = step_config(name);
    EXPECT_TRUE(c.has_attention()) << name;
    EXPECT_EQ(c.sequences % 2, 0) << name;
    EXPECT_EQ(c.model.heads % 2, 0) << name;
  }
}

TEST(StepConfigsTest, ParsesAListInTheOrderGiven) {
  const std::vector<StepConfig> configs = parse_config_list("large,small,tiny");
  ASSERT_EQ(configs.size(), 3u);
  EXPECT_EQ(configs[0].name, "large");
  EXPECT_EQ(configs[1].name, "small");
  EXPECT_EQ(configs[2].name, "tiny");
  EXPECT_EQ(configs[2].model.vocab, 512);
}

TEST(StepConfigsTest, BadListsAreClearErrors) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "--configs: empty name in ''"},
      {"small,", "empty name in 'small,'"},
      {",small", "empty name in ',small'"},
      {"small,,medium", "empty name in 'small,,medium'"},
      {"huge", "unknown step config 'huge'"},
      {"small,small", "--configs: 'small' is listed twice"},
  };
  for (const auto& [bad, words] : cases) {
    SCOPED_TRACE(bad);
    try {
      parse_config_list(bad);
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(error.message().find(words), std::string::npos) << error.message();
    }
  }
  try {
    step_config("huge");
    ADD_FAILURE() << "no error for step config 'huge'";
  } catch (const Error& error) {
    EXPECT_NE(error.message().find("known: small, medium, large, moe, long, tiny, moe_tiny"), std::string::npos) << error.message();
  }
}

}  // namespace
}  // namespace stepgraph::bench
