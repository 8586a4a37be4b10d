#include "engine/algorithm_choice.h"

namespace stepgraph {

std::string algorithm_choice_name(AlgorithmChoice choice) {
  switch (choice) {
    case AlgorithmChoice::kHeuristic: return "heuristic";
    case AlgorithmChoice::kTimed: return "timed";
  }
  return "algorithm_choice(" + std::to_string(static_cast<int>(choice)) + ")";
}

std::optional<AlgorithmChoice> parse_algorithm_choice(std::string_view name) {
  if (name == "heuristic") return AlgorithmChoice::kHeuristic;
  if (name == "timed") return AlgorithmChoice::kTimed;
  return std::nullopt;
}

}  // namespace stepgraph
