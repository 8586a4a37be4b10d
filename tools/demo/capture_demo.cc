// Captures a small two-stream step and prints what StepGraph sees: the
// Program with its plan (offsets, events) and the pool report of a step that
// keeps one intermediate without returning it. The README shows its output.
//
//   ./bazelw run //tools/demo:capture_demo -- --device host
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "ops/elementwise_ops.h"
#include "graphs/captured_step.h"
#include "graphs/program_dump.h"

namespace stepgraph {
namespace {

int run(Device device, int replays) {
  Context ctx(device, /*side_streams=*/1);
  const TensorMeta meta{Shape{64, 256}, DType::kFloat32};
  const Tensor x = ctx.persistent("x", meta);
  const Tensor w = ctx.persistent("w", meta);
  const Tensor grad = ctx.persistent("grad", meta);
  std::vector<float> ones(static_cast<std::size_t>(meta.numel()), 1.0f);
  ctx.copy_from_host(x, ones.data(), ones.size() * sizeof(float));
  ctx.copy_from_host(w, ones.data(), ones.size() * sizeof(float));

  Tensor kept;  // the caller keeps an intermediate: the pool report lists it
  auto step = CapturedStep::capture(ctx, [&] {
    ctx.begin_segment("forward");
    const Tensor h = ops::mul(ctx, x, w).set_name("h");
    Tensor s;
    {
      StreamScope side(ctx, 1);
      s = ops::axpy(ctx, h, x, 0.5f).set_name("s");
    }
    const Tensor y = ops::add(ctx, h, s).set_name("y");
    kept = y;
    ctx.begin_segment("backward");
    const Tensor g = ops::mul(ctx, y, x).set_name("g");
    ops::axpy_(ctx, grad, g, 1.0f);
    return std::vector<Tensor>{ops::sum(ctx, g).set_name("loss")};
  });
  for (int i = 0; i < replays; ++i) step->replay();

  std::cout << dump_program(step->program(), &step->plan()) << "\n"
            << step->report().to_string() << "\n\n"
            << "loss " << ops::item(ctx, step->outputs()[0]) << ", grad[0] " << ctx.to_vector<float>(grad)[0]
            << " after " << replays << " replays on " << device_name(device) << "\n"
            << "trace " << step->timings().trace_ms << " ms, plan " << step->timings().plan_ms << " ms, capture "
            << step->timings().capture_ms << " ms, instantiate " << step->timings().instantiate_ms << " ms\n";
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Capture a small two-stream step and print its program, plan and pool report"};
  std::string device = "host";
  int replays = 3;
  app.add_option("--device", device, "cuda or host")->check(CLI::IsMember({"cuda", "host"}))->capture_default_str();
  app.add_option("--replays", replays, "replays before printing")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return stepgraph::run(device == "cuda" ? stepgraph::Device::kCuda : stepgraph::Device::kHost, replays);
  } catch (const stepgraph::Error& error) {
    std::cerr << "capture_demo: " << error.message() << "\n";
    return EXIT_FAILURE;
  }
}
