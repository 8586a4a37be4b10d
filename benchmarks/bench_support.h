// What every benchmark shares: summaries of timed samples (median, min, max),
// timing launches with device events, and writing the JSON result.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/fp8.h"

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

// NVLink multicast stays off (DESIGN.md): NCCL_NVLS_ENABLE=0,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are put in
// the environment before NCCL reads them (another value is replaced, with a
// warning naming `program`). Returns the three as a JSON object for results.
nlohmann::json keep_multicast_off(const std::string& program);

// The table a benchmark prints as its rows come: row["name"] left-aligned
// `name_width` wide, then each column (a number's JSON key and its heading)
// right-aligned, 12 wide for the first and 10 after, with one decimal.
struct RowTable {
  int name_width = 48;
  std::vector<std::pair<std::string, std::string>> columns;  // {key, heading}

  void print_header() const;
  void print(const nlohmann::json& row) const;  // flushed: rows come slowly
};

// The JSON result of a benchmark that times rows on one GPU, as its PyTorch
// peer writes it: {"benchmark", "impl": "stepgraph", "device", "repeats",
// "warmup", "rows"}.
nlohmann::json rows_result(const std::string& benchmark, const std::string& device, int repeats, int warmup,
                           const nlohmann::json& rows);

// main()'s last step: returns run(); an Error (or another exception) is
// printed as "<program>: <message>" and gives EXIT_FAILURE.
int run_main(const char* program, const std::function<int()>& run);

// Writes `value` (indented) to `path`; nothing when `path` is empty.
void write_json(const std::string& path, const nlohmann::json& value);

// A device allocation owned by a benchmark (at least 256 bytes).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

// Fills the first `count` bf16 values of `buffer` uniform in [-1, 1) (never
// zeros: they can run faster than real data). A random block of up to 4M
// values is uploaded once and copied on the device over the rest: generating
// billions of values on the host would take minutes.
void fill_random_bf16(const DeviceBuffer& buffer, std::int64_t count, std::mt19937& rng);
// The same for FP8: codes of uniform values in [-1, 1) in `format`.
void fill_random_fp8(const DeviceBuffer& buffer, std::int64_t count, Fp8Format format, std::mt19937& rng);

}  // namespace stepgraph::bench
