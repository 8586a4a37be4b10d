// Launch overhead: the same K small kernels launched one by one from the host
// (eager) and as one replayed CUDA graph. This is the cost StepGraph removes
// from launch-bound training steps.
//
//   launch_overhead --kernels 200 --elements 4096 --repeats 100 --out overhead.json
//
// Reports per mode the wall time of one round of K kernels (median, min, max
// over the repeats, timed with device events after a warm-up) and the ratio.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "engine/stream_capture.h"
#include "kernels/elementwise.h"

namespace stepgraph {
namespace {

struct Options {
  int kernels = 200;
  std::int64_t elements = 4096;
  int repeats = 100;
  int warmup = 10;
  std::string out;
};

int run(const Options& options) {
  SG_CHECK(options.kernels > 0 && options.elements > 0 && options.repeats > 0,
           "--kernels, --elements and "
           "--repeats must be positive");
  const DeviceProperties device = device_properties(0);
  std::cerr << "device: " << describe(device) << "\n";

  float* x = nullptr;
  float* y = nullptr;
  SG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&x), options.elements * sizeof(float)));
  SG_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&y), options.elements * sizeof(float)));
  Stream stream;
  kernels::launch_fill_f32(x, 1.0f, options.elements, stream.get());
  kernels::launch_fill_f32(y, 0.0f, options.elements, stream.get());

  auto enqueue_round = [&] {
    for (int k = 0; k < options.kernels; ++k) kernels::launch_axpy_f32(y, x, 1e-3f, options.elements, stream.get());
  };
  const bench::Summary eager = bench::time_launches(stream.get(), options.warmup, options.repeats, enqueue_round);

  StreamCapture capture(stream.get());
  enqueue_round();
  Graph graph = capture.end();
  GraphExec exec(graph);
  exec.upload(stream.get());
  const bench::Summary graphed =
      bench::time_launches(stream.get(), options.warmup, options.repeats, [&] { exec.launch(stream.get()); });

  SG_CUDA_CHECK(cudaFree(x));
  SG_CUDA_CHECK(cudaFree(y));

  const nlohmann::json result = {
      {"benchmark", "launch_overhead"},       {"device", device.name},
      {"kernels_per_round", options.kernels}, {"elements_per_kernel", options.elements},
      {"repeats", options.repeats},           {"eager", bench::to_json(eager)},
      {"graph", bench::to_json(graphed)},     {"eager_over_graph_median", eager.median_us / graphed.median_us},
  };
  std::cout << "launch_overhead: " << options.kernels << " kernels of " << options.elements << " elements, "
            << options.repeats << " repeats\n"
            << "  eager  median " << eager.median_us << " us (min " << eager.min_us << ", max " << eager.max_us << ")\n"
            << "  graph  median " << graphed.median_us << " us (min " << graphed.min_us << ", max " << graphed.max_us
            << ")\n"
            << "  eager/graph " << eager.median_us / graphed.median_us << "x\n";
  bench::write_json(options.out, result);
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Launch overhead: K kernels launched eagerly versus one replayed CUDA graph"};
  stepgraph::Options options;
  app.add_option("--kernels", options.kernels, "kernels per round")->capture_default_str();
  app.add_option("--elements", options.elements, "fp32 elements per kernel")->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed rounds per mode")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed rounds first")->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("launch_overhead", [&] { return stepgraph::run(options); });
}
