#include "benchmarks/model_flops.h"

#include "engine/error.h"

namespace stepgraph::bench {
namespace {

// H, Hkv and D of the config's attention (heads > 0), checked.
struct AttentionShape {
  std::int64_t heads, kv_heads, head_dim;
};

AttentionShape attention_shape(const ResidualStackConfig& config) {
  SG_CHECK(config.heads > 0 && config.hidden % config.heads == 0, "model FLOPs: heads ", config.heads,
           " must divide hidden ", config.hidden);
  const std::int64_t kv = config.kv_heads != 0 ? config.kv_heads : config.heads;
  SG_CHECK(kv > 0 && config.heads % kv == 0, "model FLOPs: kv_heads ", config.kv_heads, " must divide heads ",
           config.heads);
  return {config.heads, kv, config.hidden / config.heads};
}

}  // namespace

std::int64_t matmul_params_per_token(const ResidualStackConfig& config) {
  SG_CHECK(config.hidden > 0 && config.ffn > 0 && config.layers >= 0 && config.vocab > 0,
           "matmul_params_per_token: hidden, ffn, vocab must be > 0 and layers >= 0");
  SG_CHECK(config.experts == 0 || (config.topk >= 1 && config.topk <= config.experts && config.moe_every >= 1),
           "matmul_params_per_token: with experts = ", config.experts, ", topk must be in [1, experts] and moe_every ",
           ">= 1, got topk ", config.topk, " and moe_every ", config.moe_every);
  SG_CHECK(config.heads >= 0, "matmul_params_per_token: heads must be >= 0, got ", config.heads);
  std::int64_t attention = 0;
  if (config.heads > 0) {
    const AttentionShape a = attention_shape(config);
    attention = config.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim + a.heads * a.head_dim * config.hidden;
  }
  const std::int64_t mlp = 2 * config.hidden * config.ffn;
  std::int64_t params = config.hidden * config.vocab;
  for (std::int64_t block = 0; block < config.layers; ++block) {
    const bool moe = config.experts > 0 && (block + 1) % config.moe_every == 0;
    params += attention + (moe ? config.hidden * config.experts + config.topk * mlp : mlp);
  }
  return params;
}

double attention_core_flops(const ResidualStackConfig& config, std::int64_t tokens, std::int64_t sequences) {
  if (config.heads == 0) return 0.0;
  const AttentionShape a = attention_shape(config);
  SG_CHECK(sequences > 0 && tokens > 0 && tokens % sequences == 0, "attention_core_flops: ", tokens,
           " tokens do not split into ", sequences, " sequences of equal length");
  const double length = static_cast<double>(tokens / sequences);
  // Note [Attention core FLOPs]: forward 2 * L^2 * H * D per sequence (causal), the step 3.5 x that.
  const double forward = 2.0 * length * length * static_cast<double>(a.heads * a.head_dim);
  return static_cast<double>(config.layers) * static_cast<double>(sequences) * 3.5 * forward;
}

double step_flops(const ResidualStackConfig& config, std::int64_t tokens, std::int64_t sequences) {
  SG_CHECK(tokens > 0, "step_flops: tokens must be > 0, got ", tokens);
  return 6.0 * static_cast<double>(tokens) * static_cast<double>(matmul_params_per_token(config)) +
         attention_core_flops(config, tokens, sequences);
}

double tflops_per_s(double flops, double seconds) {
  SG_CHECK(seconds > 0, "tflops_per_s: seconds must be > 0, got ", seconds);
  return flops / seconds / 1e12;
}

double mfu(double tflops) { return tflops / kH100PeakTflops; }

}  // namespace stepgraph::bench
