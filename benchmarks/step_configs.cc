#include "benchmarks/step_configs.h"

#include <algorithm>

#include "engine/error.h"

namespace stepgraph::bench {
namespace {

// A GPT-style config: `heads` heads of hidden / heads, ffn = 4 x hidden,
// `sequences` sequences of seq_len tokens per step.
StepConfig make(std::string name, std::int64_t hidden, std::int64_t heads, std::int64_t layers, std::int64_t seq_len,
                std::int64_t sequences) {
  ResidualStackConfig model;
  model.hidden = hidden;
  model.ffn = 4 * hidden;
  model.layers = layers;
  model.vocab = kBenchVocab;
  model.dtype = DType::kBFloat16;
  model.heads = heads;
  model.kv_heads = 0;  // = heads
  model.rope_base = 10000.0f;
  return {std::move(name), model, sequences * seq_len, sequences, seq_len};
}

StepConfig make_moe() {
  StepConfig config = make("moe", 2048, 16, 4, 4096, 2);
  config.model.experts = 8;
  config.model.topk = 2;
  config.model.moe_every = 1;  // every block is an MoE block (Mixtral's layout)
  return config;
}

StepConfig make_tiny() {
  StepConfig config = make("tiny", 64, 2, 2, 32, 2);
  config.model.vocab = 512;  // keeps the host reference's LM head quick
  return config;
}

// The host smoke config with experts (step_bench --ep on --device host):
// tiny with every block an MoE block of 4 experts of ffn 256, top-2.
StepConfig make_moe_tiny() {
  StepConfig config = make_tiny();
  config.name = "moe_tiny";
  config.model.experts = 4;
  config.model.topk = 2;
  config.model.moe_every = 1;
  return config;
}

// step_bench --cp's config: medium's shape with one sequence of 16k tokens
// (the cp1 baseline; --cp 2 trains one of 32k over two GPUs, 16k each).
// Memory per GPU at 16k tokens: about 420M parameters x 18 bytes (fp32
// master, gradient and two moments, bf16 copy) = 7.6 GB persistent; the
// activations each block keeps, about 16 x hidden bf16 values a token
// (norms, q/k/v, attention output, fc1 and GeLU outputs at 4 x hidden,
// residuals) = 64 KiB a token, x 16k tokens x 8 layers = 8 GiB, plus 1 GiB
// of logits and their gradient: under 20 GiB of an 80 GiB GPU, which leaves
// room for the graph pool's slack and the CP ranks' gathered keys and values.
StepConfig make_long() { return make("long", 2048, 16, 8, 16384, 1); }

std::string known_names() {
  std::string out;
  for (const StepConfig& c : benchmark_configs()) out += c.name + ", ";
  return out + "long, tiny, moe_tiny";
}

}  // namespace

const std::vector<StepConfig>& benchmark_configs() {
  static const std::vector<StepConfig> configs = {
      make("small", 512, 8, 8, 256, 1),
      make("medium", 2048, 16, 8, 2048, 2),
      make("large", 4096, 32, 4, 4096, 2),
      make_moe(),
  };
  return configs;
}

StepConfig step_config(std::string_view name) {
  if (name == "tiny") return make_tiny();
  if (name == "moe_tiny") return make_moe_tiny();
  if (name == "long") return make_long();
  for (const StepConfig& c : benchmark_configs()) {
    if (c.name == name) return c;
  }
  SG_THROW(ErrorCode::kInvalidArgument, "unknown step config '", name, "'; known: ", known_names());
}

std::vector<StepConfig> parse_config_list(std::string_view list) {
  std::vector<StepConfig> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = list.find(',', start);
    const std::string_view item = list.substr(start, comma == std::string_view::npos ? list.npos : comma - start);
    SG_CHECK(!item.empty(), "--configs: empty name in '", list, "' (use e.g. small,medium)");
    StepConfig config = step_config(item);
    SG_CHECK(std::none_of(out.begin(), out.end(), [&](const StepConfig& c) { return c.name == config.name; }),
             "--configs: '", item, "' is listed twice");
    out.push_back(std::move(config));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace stepgraph::bench
