#include "benchmarks/model_flops.h"

#include "engine/error.h"

namespace stepgraph::bench {

std::int64_t matmul_params_per_token(const ResidualStackConfig& config) {
  SG_CHECK(config.hidden > 0 && config.ffn > 0 && config.layers >= 0 && config.vocab > 0,
           "matmul_params_per_token: hidden, ffn, vocab must be > 0 and layers >= 0");
  SG_CHECK(config.experts == 0 || (config.topk >= 1 && config.topk <= config.experts && config.moe_every >= 1),
           "matmul_params_per_token: with experts = ", config.experts, ", topk must be in [1, experts] and moe_every ",
           ">= 1, got topk ", config.topk, " and moe_every ", config.moe_every);
  const std::int64_t mlp = 2 * config.hidden * config.ffn;
  std::int64_t params = config.hidden * config.vocab;
  for (std::int64_t block = 0; block < config.layers; ++block) {
    const bool moe = config.experts > 0 && (block + 1) % config.moe_every == 0;
    params += moe ? config.hidden * config.experts + config.topk * mlp : mlp;
  }
  return params;
}

double step_flops(const ResidualStackConfig& config, std::int64_t tokens) {
  SG_CHECK(tokens > 0, "step_flops: tokens must be > 0, got ", tokens);
  return 6.0 * static_cast<double>(tokens) * static_cast<double>(matmul_params_per_token(config));
}

double tflops_per_s(double flops, double seconds) {
  SG_CHECK(seconds > 0, "tflops_per_s: seconds must be > 0, got ", seconds);
  return flops / seconds / 1e12;
}

double mfu(double tflops) { return tflops / kH100PeakTflops; }

}  // namespace stepgraph::bench
