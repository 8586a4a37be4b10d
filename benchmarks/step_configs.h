// The named training-step configurations of step_bench (and, by the same
// numbers, of pytorch_peer.py): a model shape and a token count per step.
//
//   small   launch-bound:  hidden 512,  ffn 2048,  8 blocks,  256 tokens
//   medium                 hidden 2048, ffn 8192,  8 blocks, 4096 tokens
//   large   compute-bound: hidden 4096, ffn 16384, 4 blocks, 8192 tokens
//   moe                    hidden 2048, 8 experts of ffn 8192, top-2,
//                          4 blocks, every block MoE, 8192 tokens
//   tiny    host smoke test only: hidden 64, ffn 256, 2 blocks, 64 tokens,
//           vocab 512
//
// Every benchmark config uses vocab kBenchVocab (8192) and bf16.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "layers/residual_stack.h"

namespace stepgraph::bench {

inline constexpr std::int64_t kBenchVocab = 8192;

struct StepConfig {
  std::string name;
  ResidualStackConfig model;
  std::int64_t tokens = 0;  // per step
};

// The four benchmark configs, in report order (tiny is not among them).
const std::vector<StepConfig>& benchmark_configs();

// A config by name (the four, or "tiny"); Error(kInvalidArgument) naming the
// known ones otherwise.
StepConfig step_config(std::string_view name);

// "small,medium" -> those configs in the order given; an empty item, an
// unknown name or a repeat is an Error.
std::vector<StepConfig> parse_config_list(std::string_view list);

}  // namespace stepgraph::bench
