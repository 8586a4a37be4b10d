// The named training-step configurations of step_bench (and, by the same
// numbers, of pytorch_peer.py): GPT-style models (every block a
// TransformerLayer: h += attention(h); h += MLP(h); layers/residual_stack.h)
// and the sequences each step trains on (tokens = sequences x seq_len).
//
//   small   launch-bound:  hidden 512,  8 heads of 64,   ffn 2048,  8 layers,
//                          1 sequence of 256 (256 tokens)
//   medium                 hidden 2048, 16 heads of 128, ffn 8192,  8 layers,
//                          2 sequences of 2048 (4096 tokens)
//   large   compute-bound: hidden 4096, 32 heads of 128, ffn 16384, 4 layers,
//                          2 sequences of 4096 (8192 tokens)
//   moe                    hidden 2048, 16 heads of 128, 8 experts of ffn
//                          8192, top-2, every block MoE, 4 layers,
//                          2 sequences of 4096 (8192 tokens)
//   long    step_bench --cp: medium's shape (hidden 2048, 16 heads of 128,
//           ffn 8192, 8 layers), 1 sequence of 16384 (--cp N: N x 16384
//           over N GPUs)
//   tiny    host smoke test only: hidden 64, 2 heads of 32, ffn 256,
//           2 layers, 2 sequences of 32 (64 tokens), vocab 512
//   moe_tiny host smoke test of step_bench --ep: tiny with every block MoE,
//           4 experts of ffn 256, top-2
//
// Every benchmark config uses vocab kBenchVocab (8192), bf16, causal
// attention with rotary embeddings (base 10000), kv_heads = heads.
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
  std::int64_t tokens = 0;     // per step: sequences * seq_len
  std::int64_t sequences = 1;  // equal-length sequences per step (TrainStep's packing)
  std::int64_t seq_len = 0;    // tokens per sequence

  bool has_attention() const { return model.heads > 0; }
};

// The four benchmark configs, in report order (tiny is not among them).
const std::vector<StepConfig>& benchmark_configs();

// A config by name (the four, "long", "tiny" or "moe_tiny"); Error(kInvalidArgument) naming the
// known ones otherwise.
StepConfig step_config(std::string_view name);

// "small,medium" -> those configs in the order given; an empty item, an
// unknown name or a repeat is an Error.
std::vector<StepConfig> parse_config_list(std::string_view list);

}  // namespace stepgraph::bench
