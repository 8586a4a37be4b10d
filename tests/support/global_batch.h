// The global batch of one step of a parallel-training test: activations x
// [tokens, hidden] from a normal draw and labels [tokens] uniform in
// [0, vocab), from `seed` and the step, the same in every rank (thread or
// process), so each rank takes its rows and one process the whole.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace stepgraph::testing {

struct GlobalBatch {
  std::vector<float> x;
  std::vector<std::int32_t> labels;
};

inline GlobalBatch global_batch(std::uint32_t seed, int step, std::int64_t tokens, std::int64_t hidden,
                                std::int64_t vocab) {
  std::mt19937 rng(seed + 1000u * static_cast<std::uint32_t>(step));
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<std::int32_t> label(0, static_cast<std::int32_t>(vocab - 1));
  GlobalBatch b;
  for (std::int64_t i = 0; i < tokens * hidden; ++i) b.x.push_back(normal(rng));
  for (std::int64_t i = 0; i < tokens; ++i) b.labels.push_back(label(rng));
  return b;
}

}  // namespace stepgraph::testing
