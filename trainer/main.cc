// The StepGraph trainer: trains a token language model (window embedding,
// residual LayerNormMLP blocks, LM head, softmax cross-entropy, AdamW) on a
// synthetic Markov source or a file, eager or as one replayed CUDA graph per
// step. See trainer/README.md.
//
//   ./bazelw run //trainer -- --mode graph --steps 2000
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/error.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

int main(int argc, char** argv) {
  namespace trainer = stepgraph::trainer;
  const std::vector<std::string> args(argv + 1, argv + argc);
  const trainer::ParsedCommandLine parsed = trainer::parse_command_line(args);
  if (!parsed.options) {
    (parsed.exit_code == 0 ? std::cout : std::cerr) << parsed.message << "\n";
    return parsed.exit_code;
  }
  try {
    const trainer::DeviceChoice choice = trainer::choose_device(*parsed.options);
    if (!choice.note.empty()) std::cout << choice.note << "\n";
    const trainer::TrainerOptions options = trainer::resolve_defaults(*parsed.options, choice.device);
    // --device cuda without a GPU is an Error with the reason.
    const std::string description = choice.device == stepgraph::Device::kCuda
                                        ? stepgraph::describe(stepgraph::device_properties(0))
                                        : std::string("host");
    std::cout << "device: " << description << "\n";
    trainer::train(options, choice.device, std::cout);
    return EXIT_SUCCESS;
  } catch (const stepgraph::Error& error) {
    std::cerr << "trainer: " << error.message() << "\n";
    return error.code() == stepgraph::ErrorCode::kInvalidArgument ? 2 : EXIT_FAILURE;
  }
}
