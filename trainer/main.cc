// The StepGraph trainer: trains a token language model (by default a GPT:
// embedding, TransformerLayers with causal attention over packed sequences,
// LM head, softmax cross-entropy, AdamW; or with --heads 0 MLP blocks over a
// window of tokens) on a synthetic Markov source or a file, eager or as one
// replayed CUDA graph per step. See trainer/README.md.
//
//   ./bazelw run //trainer -- --mode graph --steps 2000
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/error.h"
#include "trainer/distributed.h"
#include "trainer/memory_budget.h"
#include "trainer/options.h"
#include "trainer/train_loop.h"

namespace {

// The worker's command line: the launcher's own flags removed.
std::vector<std::string> without_launcher_flags(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    bool launcher_flag = false;
    for (const std::string flag : {"--nproc-per-node", "--max-restarts"}) {
      if (args[i] == flag) {
        ++i;  // and its value
        launcher_flag = true;
      } else if (args[i].rfind(flag + "=", 0) == 0) {
        launcher_flag = true;
      }
    }
    if (!launcher_flag) out.push_back(args[i]);
  }
  return out;
}

std::chrono::milliseconds timeout_of(const stepgraph::trainer::TrainerOptions& options) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(options.comm_timeout_s * 1000));
}

std::ostream& null_stream() {
  static std::ostream discard(nullptr);
  return discard;
}

}  // namespace

int main(int argc, char** argv) {
  namespace trainer = stepgraph::trainer;
  const std::vector<std::string> args(argv + 1, argv + argc);
  const trainer::ParsedCommandLine parsed = trainer::parse_command_line(args);
  if (!parsed.options) {
    (parsed.exit_code == 0 ? std::cout : std::cerr) << parsed.message << "\n";
    return parsed.exit_code;
  }
  trainer::World world;
  try {
    if (parsed.options->nproc_per_node > 1 && std::getenv(trainer::kLocalWorkerVariable) == nullptr) {
      trainer::check_restart_options(*parsed.options);
      return trainer::run_local_workers(static_cast<int>(parsed.options->nproc_per_node),
                                        without_launcher_flags(args), timeout_of(*parsed.options),
                                        static_cast<int>(parsed.options->max_restarts), std::cerr);
    }
    const trainer::DeviceChoice choice = trainer::choose_device(*parsed.options);
    trainer::TrainerOptions options = trainer::resolve_defaults(*parsed.options, choice.device);
    // A restarted rank continues from the newest complete checkpoint, where one was saved (Note [Elastic restarts]).
    const int restart = trainer::restart_count_from_env();
    const bool resumes_after_restart =
        restart > 0 && !options.resume && !options.checkpoint.empty() && std::filesystem::exists(options.checkpoint);
    if (resumes_after_restart) options.resume = true;
    world = trainer::join_world(choice.device, timeout_of(options));
    // Rank 0 speaks for the run; the others print only their errors.
    std::ostream& out = world.rank() == 0 ? std::cout : null_stream();
    if (!choice.note.empty()) out << choice.note << "\n";
    // --device cuda without a GPU is an Error with the reason.
    const std::string description = choice.device == stepgraph::Device::kCuda
                                        ? stepgraph::describe(stepgraph::device_properties(world.launch.local_rank))
                                        : std::string("host");
    out << "device: " << description << "\n";
    if (world.size() > 1) out << "world: " << stepgraph::describe(world.launch) << "\n";
    if (restart > 0) {
      out << "restart " << restart << ": "
          << (resumes_after_restart ? "resuming from " + options.checkpoint
                                    : std::string("no checkpoint saved yet, starting over"))
          << "\n";
    }
    // Before anything is allocated: a data file's vocabulary or the flags may ask for more than the machine has.
    trainer::check_run_memory(options, choice.device, world.size(), world.launch.local_rank);
    trainer::train(options, choice.device, out, world.comm.get());
    return EXIT_SUCCESS;
  } catch (const stepgraph::Error& error) {
    const std::string who = world.size() > 1 ? "rank " + std::to_string(world.rank()) + ": " : "";
    std::cerr << "trainer: " << who << error.message() << "\n";
    // The other ranks may be waiting for this one: end them now, not at their timeout.
    if (world.comm) world.comm->abort(error.message());
    return error.code() == stepgraph::ErrorCode::kInvalidArgument ? 2 : EXIT_FAILURE;
  }
}
