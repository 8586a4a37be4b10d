#include "benchmarks/step_configs.h"

#include <algorithm>

#include "engine/error.h"

namespace stepgraph::bench {
namespace {

StepConfig make(std::string name, std::int64_t hidden, std::int64_t ffn, std::int64_t layers, std::int64_t tokens) {
  ResidualStackConfig model;
  model.hidden = hidden;
  model.ffn = ffn;
  model.layers = layers;
  model.vocab = kBenchVocab;
  model.dtype = DType::kBFloat16;
  return {std::move(name), model, tokens};
}

StepConfig make_moe() {
  StepConfig config = make("moe", 2048, 8192, 4, 8192);
  config.model.experts = 8;
  config.model.topk = 2;
  config.model.moe_every = 1;  // every block is an MoE block (Mixtral's layout)
  return config;
}

StepConfig make_tiny() {
  StepConfig config = make("tiny", 64, 256, 2, 64);
  config.model.vocab = 512;  // keeps the host reference's LM head quick
  return config;
}

std::string known_names() {
  std::string out;
  for (const StepConfig& c : benchmark_configs()) out += c.name + ", ";
  return out + "tiny";
}

}  // namespace

const std::vector<StepConfig>& benchmark_configs() {
  static const std::vector<StepConfig> configs = {
      make("small", 512, 2048, 8, 256),
      make("medium", 2048, 8192, 8, 4096),
      make("large", 4096, 16384, 4, 8192),
      make_moe(),
  };
  return configs;
}

StepConfig step_config(std::string_view name) {
  if (name == "tiny") return make_tiny();
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
