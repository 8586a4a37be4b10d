// What every benchmark shares: summaries of timed samples (median, min, max),
// timing launches with device events, and writing the JSON result.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace stepgraph::bench {

struct Summary {
  double median_us = 0;
  double min_us = 0;
  double max_us = 0;
};

Summary summarize(std::vector<double> samples_us);

// {"median_us": ..., "min_us": ..., "max_us": ...}
nlohmann::json to_json(const Summary& summary);

// Runs `launch` (which enqueues work on `stream`) `warmup` times untimed, then
// `repeats` times each between two device events; microseconds per call.
Summary time_launches(cudaStream_t stream, int warmup, int repeats, const std::function<void()>& launch);

// Writes `value` (indented) to `path`; nothing when `path` is empty.
void write_json(const std::string& path, const nlohmann::json& value);

}  // namespace stepgraph::bench
