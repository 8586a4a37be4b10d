// The StepGraph trainer. Today it reports the device it would train on; the
// training loop (eager and graphed) arrives with the dense layers.
//
//   ./bazelw run //trainer -- --device cuda
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <string>

#include "engine/device.h"
#include "engine/error.h"

namespace {

int run(const std::string& device) {
  const stepgraph::DeviceCount found = stepgraph::cuda_device_count();
  if (device == "host" || (device == "auto" && found.count == 0)) {
    if (device == "auto") std::cout << found.no_device_reason << "; using the host\n";
    std::cout << "device: host\n";
  } else {
    // --device cuda without a GPU is an error with the reason.
    const std::string description = stepgraph::describe(stepgraph::device_properties(0));
    std::cout << "device: " << description << "\n";
  }
  std::cout << "training is not implemented yet: this build only reports the device\n";
  return EXIT_SUCCESS;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"StepGraph trainer: trains a transformer-style model eager or as replayed CUDA graphs"};
  std::string device = "auto";
  app.add_option("--device", device, "cuda, host, or auto (cuda when there is a GPU)")
      ->check(CLI::IsMember({"auto", "cuda", "host"}));
  CLI11_PARSE(app, argc, argv);
  try {
    return run(device);
  } catch (const stepgraph::Error& error) {
    std::cerr << "trainer: " << error.message() << "\n";
    return EXIT_FAILURE;
  }
}
