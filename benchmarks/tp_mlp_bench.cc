// tp_mlp_bench: what tensor parallelism costs one sequence-parallel
// LayerNormMLP, forward and backward, captured in one graph, per overlap mode
// (Note [Communication-GEMM overlap]), against the same local GEMMs without
// any communication.
//
//   torchrun --nproc-per-node 2 tp_mlp_bench --config large --out tp_mlp.json
//   tp_mlp_bench --config large        # one process: one NCCL rank (collectives are copies)
//
// Rows (every rank runs every row; bf16, fp32 accumulation):
//   no_comm   LayerNormMLP(hidden, ffn / N) on all T tokens, no communicator:
//             the local GEMMs of one TP rank, the floor overlap aims at
//   none      the TP layer, each collective on the compute stream, then its GEMM
//   bulk      each collective whole on the communication stream
//   overlap   ring_exchange for the two all-gathers, pipelined for the two
//             reduce-scatters; where the ranks map each other's GPUs its ring
//             steps are peer copies into the neighbour's pool (copy engines,
//             no SMs: Note [The pool as symmetric memory]), and the row
//             overlap_nccl runs the same rings through NCCL's kernels on a
//             second communicator without peer copies
// (other --modes: any MLPOverlap text, e.g. ring_exchange,bulk,bulk,pipelined).
// T is the step config's tokens per step, each rank holding T / N outside
// the MLP. Timing: rounds of one sample per row, interleaved (so drift hits
// every row alike); a sample is `--replays` graph replays between device
// events after a host barrier of all ranks; per row the median over samples
// of the slowest rank. Goals (docs/communication_performance.md, "Tensor parallelism"):
// the best mode <= 1.03x no_comm, its GEMMs <= 1.03x no_comm's, at N = 2.
// --profile prints each row's step profile (stream busy time, exposed
// communication) from one more profiled run.
#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/step_configs.h"
#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "launch/join.h"
#include "engine/nccl_communicator.h"
#include "graphs/captured_step.h"
#include "layers/comm_gemm_overlap.h"
#include "layers/layernorm_mlp.h"

namespace stepgraph {
namespace {

using nlohmann::json;

struct Options {
  std::string config = "large";
  std::vector<std::string> modes{"none", "bulk", "overlap"};
  int replays = 10;
  int warmup = 3;
  int repeats = 15;
  int timeout_s = 300;
  bool profile = false;
  bool nccl_rings = true;
  std::string out;
};

bool has_rings(const MLPOverlap& o) {
  return o.fc1_fprop == CommOverlap::kRingExchange || o.fc2_fprop == CommOverlap::kPipelined ||
         o.fc2_dgrad == CommOverlap::kRingExchange || o.fc1_dgrad == CommOverlap::kPipelined;
}

// The summed time of the step's GEMMs in a profile (every op whose name
// holds "gemm"): beside communication they may run slower.
double gemm_us(const StepProfile& profile) {
  double total = 0;
  for (const ProfiledOpTotal& op : profile.by_op()) {
    if (op.op.find("gemm") != std::string::npos) total += op.total_us;
  }
  return total;
}

// One row: a layer, its inputs and its captured forward + backward.
struct Row {
  std::string name;
  std::string overlap;  // the MLPOverlap, or "" for no_comm
  std::unique_ptr<LayerNormMLP> layer;
  Tensor x, dy;
  std::shared_ptr<CapturedStep> graph;
  std::vector<double> samples_us;
  std::string transport;  // how its ring steps move bytes ("" for no_comm)
};

Tensor random_bf16(Context& ctx, const std::string& name, std::int64_t rows, std::int64_t cols, std::mt19937& rng) {
  const Tensor t = ctx.persistent(name, {Shape{rows, cols}, DType::kBFloat16});
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(rows * cols));
  for (std::uint16_t& b : bits) b = float_to_bf16(uniform(rng));
  ctx.copy_from_host(t, bits.data(), bits.size() * 2);
  return t;
}

std::vector<std::uint16_t> bits_of(Context& ctx, const Tensor& t) { return ctx.to_vector<std::uint16_t>(t); }

double max_abs_difference(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(bf16_to_float(a[i]) - bf16_to_float(b[i]))));
  }
  return worst;
}

// Every rank's value, slowest first: the exchange doubles as a barrier.
double slowest(Communicator& comm, double value, const std::string& what) {
  double worst = value;
  for (const std::string& v : comm.exchange(std::to_string(value), what)) worst = std::max(worst, std::stod(v));
  return worst;
}

int run(const Options& options) {
  const json env = bench::keep_multicast_off("tp_mlp_bench");
  SG_CHECK(options.replays > 0 && options.repeats > 0 && options.warmup >= 0,
           "--replays and --repeats must be > 0 and --warmup >= 0");
  const bench::StepConfig config = bench::step_config(options.config);
  const auto timeout = std::chrono::milliseconds(std::int64_t{1000} * options.timeout_s);
  const LaunchInfo launch = launch_info_from_env();
  const DeviceCount found = cuda_device_count();
  SG_CHECK_CODE(found.count > launch.local_rank, ErrorCode::kNoDevice,
                found.count == 0 ? found.no_device_reason
                                 : detail::concat("local rank ", launch.local_rank, " needs GPU ", launch.local_rank,
                                                  " but this host has ", found.count));
  SG_CUDA_CHECK(cudaSetDevice(launch.local_rank));
  std::ostringstream tag;
  tag << "tp_mlp_bench --config " << options.config << " --replays " << options.replays << " --repeats "
      << options.repeats;
  JoinedWorld joined = join_world(Device::kCuda, tag.str(), timeout, launch);
  // A world of one runs the same collectives through one NCCL rank.
  std::unique_ptr<Communicator> comm =
      joined.comm != nullptr ? std::move(joined.comm) : make_nccl_communicator(make_nccl_unique_id(), 0, 1);
  const int n = comm->world_size();
  const bool leader = comm->rank() == 0;
  const std::int64_t hidden = config.model.hidden;
  const std::int64_t ffn = config.model.ffn;
  const std::int64_t tokens = config.tokens;
  SG_CHECK(ffn % n == 0 && tokens % n == 0, "config ", config.name, ": ffn ", ffn, " and tokens ", tokens,
           " must divide by the ", n, " ranks");

  Context ctx(Device::kCuda, 2);
  ctx.set_communication_stream(2);
  std::mt19937 rng(1234 + static_cast<unsigned>(comm->rank()));
  // The same ranks without peer copies: the rings through NCCL, for
  // comparison. Declared before the rows: a communicator must outlive the
  // graphs that captured its calls (NCCL's finalize waits for them).
  std::unique_ptr<Communicator> nccl;
  std::vector<Row> rows;
  auto capture = [&](Row& row, std::vector<Communicator*> comms) {
    if (leader) std::cerr << "tp_mlp_bench: capturing " << row.name << std::endl;
    row.graph = CapturedStep::capture(ctx,
                                      [&] {
                                        const LayerNormMLP::Forward f = row.layer->forward(ctx, {row.x});
                                        return std::vector<Tensor>{f.y, row.layer->backward(ctx, f.saved, {row.dy})};
                                      },
                                      {.pool_report_policy = PoolReportPolicy::kError, .communicators = comms});
  };
  {
    Row row{.name = "no_comm"};
    row.layer = std::make_unique<LayerNormMLP>(
        ctx, "mlp", LayerNormMLPConfig{.hidden = hidden, .ffn = ffn / n, .dtype = DType::kBFloat16}, 7);
    row.x = random_bf16(ctx, "x_all", tokens, hidden, rng);
    row.dy = random_bf16(ctx, "dy_all", tokens, hidden, rng);
    capture(row, {});
    rows.push_back(std::move(row));
  }
  const Tensor x = random_bf16(ctx, "x", tokens / n, hidden, rng);
  const Tensor dy = random_bf16(ctx, "dy", tokens / n, hidden, rng);
  if (options.nccl_rings && comm->peer_transport() == PeerTransport::kPeerCopy) {
    nccl = make_nccl_communicator_like(*comm, {.name = "tp_nccl", .device = launch.local_rank, .peer_copies = false});
  }
  auto add_mode = [&](const std::string& name, const MLPOverlap& overlap, Communicator& group) {
    Row row{.name = name, .overlap = overlap.to_string()};
    row.layer = std::make_unique<LayerNormMLP>(
        ctx, "mlp",
        LayerNormMLPConfig{.hidden = hidden, .ffn = ffn, .dtype = DType::kBFloat16, .overlap = overlap}, 7, &group);
    row.x = x;
    row.dy = dy;
    row.transport = std::string(peer_transport_name(group.peer_transport()));
    capture(row, {&group});
    rows.push_back(std::move(row));
  };
  for (const std::string& mode : options.modes) {
    const MLPOverlap overlap = MLPOverlap::parse(mode);
    add_mode(mode, overlap, *comm);
    if (nccl != nullptr && has_rings(overlap)) add_mode(mode + "_nccl", overlap, *nccl);
  }

  if (leader) {
    std::cout << "tp_mlp_bench: " << describe(device_properties(launch.local_rank)) << "; NCCL " << nccl_version()
              << ", " << n << " rank(s) (" << launch.launcher << ")\n"
              << "  config " << config.name << ": hidden " << hidden << ", ffn " << ffn << " (" << ffn / n
              << " per rank), " << tokens << " tokens (" << tokens / n << " per rank), bf16; " << options.replays
              << " replays per sample, " << options.repeats << " samples per row, interleaved\n";
    if (n == 1) std::cout << "  NOTE: one rank: every collective is a local copy and the chunked modes run whole\n";
    std::cout << "  ring steps: " << peer_transport_name(comm->peer_transport()) << " ("
              << comm->peer_transport_reason() << ")" << (nccl != nullptr ? "; rows *_nccl by NCCL" : "") << "\n";
  }

  // Outputs of each mode against none's: the same math, maybe other GEMM algorithms per chunk.
  json agreement = json::object();
  cudaStream_t stream = ctx.cuda_stream(0);
  for (Row& row : rows) row.graph->replay();
  ctx.synchronize();
  std::vector<std::vector<std::uint16_t>> none_out;
  for (const Row& row : rows) {
    if (row.name != "none") continue;
    for (const Tensor& t : row.graph->outputs()) none_out.push_back(bits_of(ctx, t));
  }
  for (const Row& row : rows) {
    if (row.overlap.empty() || none_out.empty()) continue;
    json diffs = json::object();
    const std::vector<Tensor>& outs = row.graph->outputs();
    diffs["y_max_abs_diff_vs_none"] = max_abs_difference(bits_of(ctx, outs[0]), none_out[0]);
    diffs["dx_max_abs_diff_vs_none"] = max_abs_difference(bits_of(ctx, outs[1]), none_out[1]);
    agreement[row.name] = diffs;
  }

  if (leader) std::cerr << "tp_mlp_bench: timing " << rows.size() << " rows" << std::endl;
  cudaEvent_t start = nullptr, stop = nullptr;
  SG_CUDA_CHECK(cudaEventCreate(&start));
  SG_CUDA_CHECK(cudaEventCreate(&stop));
  for (int round = -options.warmup; round < options.repeats; ++round) {
    for (Row& row : rows) {
      slowest(*comm, 0, "round " + std::to_string(round) + " " + row.name);  // a barrier
      SG_CUDA_CHECK(cudaEventRecord(start, stream));
      for (int i = 0; i < options.replays; ++i) row.graph->replay();
      SG_CUDA_CHECK(cudaEventRecord(stop, stream));
      SG_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      SG_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (round >= 0) row.samples_us.push_back(1000.0 * ms / options.replays);
    }
  }
  SG_CUDA_CHECK(cudaEventDestroy(start));
  SG_CUDA_CHECK(cudaEventDestroy(stop));

  json results = json::array();
  double no_comm_us = 0, none_us = 0;
  std::vector<double> medians;
  for (Row& row : rows) {
    bench::Summary mine = bench::summarize(row.samples_us);
    const double median = slowest(*comm, mine.median_us, row.name + " median");
    const double low = slowest(*comm, mine.min_us, row.name + " min");
    const double high = slowest(*comm, mine.max_us, row.name + " max");
    medians.push_back(median);
    if (row.name == "no_comm") no_comm_us = median;
    if (row.name == "none") none_us = median;
    json entry = {{"name", row.name}, {"overlap", row.overlap}, {"transport", row.transport},
                  {"median_us", median}, {"min_us", low}, {"max_us", high}};
    if (options.profile) {
      if (leader) std::cerr << "tp_mlp_bench: profiling " << row.name << std::endl;
      const StepProfile p = row.graph->profile();  // every rank: the profiled run holds collectives
      entry["profile"] = {{"total_us", p.total_us},
                          {"stream_busy_us", p.stream_busy_us},
                          {"communication_us", p.communication_us},
                          {"exposed_communication_us", p.exposed_communication_us},
                          {"gemm_us", slowest(*comm, gemm_us(p), row.name + " gemm")}};
    }
    results.push_back(entry);
  }
  comm->check_health();
  if (!leader) return EXIT_SUCCESS;
  double no_comm_gemm_us = 0;
  for (const json& entry : results) {
    if (entry["name"] == "no_comm" && entry.contains("profile")) no_comm_gemm_us = entry["profile"]["gemm_us"];
  }
  for (json& entry : results) {
    const double median = entry["median_us"].get<double>();
    entry["ratio_to_no_comm"] = median / no_comm_us;
    if (entry.contains("profile") && no_comm_gemm_us > 0) {
      entry["profile"]["gemm_slowdown_vs_no_comm"] = entry["profile"]["gemm_us"].get<double>() / no_comm_gemm_us;
    }
    if (none_us > 0 && entry["name"] != "no_comm") entry["speedup_vs_none"] = none_us / median;
    std::printf("  %-13s %9.1f us [%.1f-%.1f]  %.3fx no_comm", entry["name"].get<std::string>().c_str(), median,
                entry["min_us"].get<double>(), entry["max_us"].get<double>(), median / no_comm_us);
    if (entry.contains("speedup_vs_none")) std::printf("  %.3fx faster than none", entry["speedup_vs_none"].get<double>());
    if (entry.contains("profile")) {
      const json& p = entry["profile"];
      std::printf("  (profile: communication %.1f us, exposed %.1f us; GEMMs %.1f us", p["communication_us"].get<double>(),
                  p["exposed_communication_us"].get<double>(), p["gemm_us"].get<double>());
      if (p.contains("gemm_slowdown_vs_no_comm")) std::printf(", %.3fx no_comm's", p["gemm_slowdown_vs_no_comm"].get<double>());
      std::printf(")");
    }
    std::printf("\n");
  }
  if (!agreement.empty()) std::cout << "  outputs against none: " << agreement.dump() << "\n";
  const json result = {
      {"benchmark", "tp_mlp"},
      {"source", "stepgraph"},
      {"device", describe(device_properties(launch.local_rank))},
      {"nccl_version", nccl_version()},
      {"world_size", n},
      {"launcher", launch.launcher},
      {"config", config.name},
      {"ring_transport", {{"world", peer_transport_name(comm->peer_transport())},
                          {"reason", comm->peer_transport_reason()},
                          {"nccl_rows", nccl != nullptr}}},
      {"hidden", hidden},
      {"ffn", ffn},
      {"tokens", tokens},
      {"dtype", "bf16"},
      {"replays_per_sample", options.replays},
      {"repeats", options.repeats},
      {"multicast_env", env},
      {"timing",
       "rows interleaved in rounds; a sample = replays of the captured fwd+bwd between events after a barrier; "
       "per row the slowest rank's median/min/max over samples"},
      {"goals", {{"best_ratio_to_no_comm_max", 1.03}, {"gemm_slowdown_vs_no_comm_max", 1.03}}},
      {"agreement_with_none", agreement},
      {"rows", results},
  };
  bench::write_json(options.out, result);
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"A sequence-parallel LayerNormMLP, fwd+bwd in one graph, per overlap mode vs no communication"};
  stepgraph::Options options;
  app.add_option("--config", options.config, "step config whose shapes to use (small, medium, large, moe)")
      ->capture_default_str();
  app.add_option("--modes", options.modes, "overlap modes (MLPOverlap texts)")->delimiter(';')->capture_default_str();
  app.add_option("--replays", options.replays, "graph replays per sample")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed rounds first")->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed rounds")->capture_default_str();
  app.add_option("--timeout-s", options.timeout_s, "a rank that does not answer within this is an error")
      ->capture_default_str();
  app.add_flag("--profile", options.profile, "print each row's step profile (one more run per row)");
  app.add_flag("!--no-nccl-rings", options.nccl_rings,
               "skip the *_nccl rows (rings through NCCL beside the peer-copy rings)");
  app.add_option("--out", options.out, "write the results as JSON here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("tp_mlp_bench", [&] { return stepgraph::run(options); });
}
