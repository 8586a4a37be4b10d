// The expert-parallel exchange's bandwidth: ep_dispatch + ep_combine
// (ops/moe_exchange_ops.h) on a step config's MoE shapes (tokens per rank x
// topk rows of hidden, the config's dtype), captured in a graph and eager,
// against NCCL's all-to-all with host counts moving the same rows
// (benchmarks/nccl_all_to_all.h), under uniform and skewed routing.
//
//   torchrun --no-python --nproc-per-node 2 bin/ep_exchange_bench --out ep_exchange_bench.json
//   ... bin/ep_exchange_bench --copy-blocks 8,16,32,64,132 ...   # the peer copy's thread blocks, swept
//   ep_exchange_bench --device host --config moe_tiny --reference none ...   # two host processes: a smoke run
//
// Rows, per routing (Note [Exchange bandwidth] in ep_exchange_plan.h):
//   stepgraph_graph              one replay of a captured step holding
//                                ep_dispatch and ep_combine over the counts
//                                (every rank's splits, int32 [P, E]) in a
//                                persistent tensor: the transport the
//                                communicator gives a captured exchange (read
//                                from the captured program's ops and the
//                                communicator: the padded exchange of the
//                                bound by send_recv, on NCCL or peer copies,
//                                or routed rows by peer copies), recorded in
//                                the row. The goal's row;
//   stepgraph_graph_with_counts  the same with ep_counts captured too (the
//                                all-gather of the splits a step makes);
//   stepgraph_graph_blocksN      stepgraph_graph with the peer copy's kernel
//                                on N thread blocks (EpPeerOptions::blocks;
//                                stepgraph_graph runs the op's default), one
//                                row per N of --copy-blocks (default: the
//                                op's default alone); the routing's
//                                best_copy_blocks names the fastest. The
//                                padded exchange has no copy kernel: there N
//                                changes nothing;
//   stepgraph_eager              dispatch and combine launched from the host
//                                (the padded exchange over NCCL: eager calls
//                                take no peer window);
//   nccl_all_to_all              two NCCL all-to-alls (dispatch, then combine
//                                back) with the row counts on the host, given
//                                before timing: the bandwidth reference. It
//                                leaves out what a real step must add to use
//                                it (exchanging the counts and copying them
//                                to the host, a synchronization).
// Timing: before each sample the ranks meet; each times --iters exchanges
// back to back and one synchronize, divided by --iters; a sample is the
// slowest rank's; the systems alternate sample by sample. Before
// timing every system is checked: combine(dispatch(x)) must be x, bit for
// bit (a failure marks the row and the run exits 1).
//
// One process per GPU under a launcher (torchrun, srun, mpirun), at least 2
// ranks; NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others, set
// before NCCL starts). Rank 0 prints and writes the JSON.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "benchmarks/bench_support.h"
#include "benchmarks/ep_exchange_plan.h"
#include "benchmarks/nccl_all_to_all.h"
#include "benchmarks/step_configs.h"
#include "engine/communicator.h"
#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/peer_window.h"
#include "graphs/captured_step.h"
#include "kernels/moe_exchange_peer.h"
#include "launch/join.h"
#include "launch/launch_env.h"
#include "ops/moe_exchange_ops.h"

namespace stepgraph::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string config = "moe";
  Device device = Device::kCuda;
  std::string routings = "uniform,skewed";
  bool reference = true;  // --reference nccl (false: none)
  int samples = 20;
  int warmup = 5;
  int iters = 10;
  int timeout_s = 300;
  std::string copy_blocks = std::to_string(ops::EpPeerOptions{}.blocks);  // as given; copy_block_counts checks it
  std::string out;
};

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return out;
    start = comma + 1;
  }
}

// --copy-blocks "8,16,32" -> {8, 16, 32}: whole numbers in [1, kMaxEpPeerCopyBlocks], each once, in the order given.
std::vector<int> copy_block_counts(const std::string& text) {
  constexpr int kMax = kernels::kMaxEpPeerCopyBlocks;
  std::vector<int> out;
  std::set<int> seen;
  for (const std::string& item : split_list(text)) {
    int blocks = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), blocks);
    SG_CHECK_CODE(!item.empty() && error == std::errc() && end == item.data() + item.size(),
                  ErrorCode::kInvalidArgument, "--copy-blocks: '", item, "' in '", text,
                  "' is not a whole number of thread blocks; pass a comma-separated list, e.g. 8,16,32,64,", kMax);
    SG_CHECK_CODE(blocks >= 1 && blocks <= kMax, ErrorCode::kInvalidArgument, "--copy-blocks: ", blocks,
                  " thread blocks is outside [1, ", kMax, "], the peer copy's range (EpPeerOptions::blocks)");
    SG_CHECK_CODE(seen.insert(blocks).second, ErrorCode::kInvalidArgument, "--copy-blocks: ", blocks,
                  " appears twice in '", text, "'; name each count once");
    out.push_back(blocks);
  }
  return out;
}

std::vector<double> as_doubles(const std::string& text) {
  return nlohmann::json::parse(text).get<std::vector<double>>();
}

// The captured exchange's transport, from what was recorded: routed rows by
// peer copies (an ep_peer_copy op), or the padded exchange by send_recv,
// whose captured calls take the communicator's transport.
std::string graph_transport(const Program& program, const Communicator& world, std::map<std::string, int>& ops) {
  for (const Instruction& instruction : program.instructions()) ++ops[std::string(instruction.op->name)];
  for (const auto& [name, count] : ops) {
    if (name.find("peer_copy") != std::string::npos) return "peer_copy";
  }
  return "padded_" + std::string(peer_transport_name(world.peer_transport()));
}

// One system's timed exchanges on this rank: warm-up, then a sample per call
// of `sample` (the caller interleaves the systems).
struct System {
  std::string name;
  std::string transport;
  std::function<void()> exchange;  // one exchange, enqueued
  std::function<void()> synchronize;
  std::function<bool()> round_trip_is_x;  // after an exchange: combine(dispatch(x)) == x
  std::int64_t bytes_moved_per_rank = 0;   // on the links, dispatch and combine
  std::vector<double> samples_us;
  int copy_blocks = 0;  // a captured exchange's peer copy's thread blocks; 0: none
};

void take_sample(System& s, Communicator& world, int iters) {
  (void)world.exchange("", "sample of " + s.name);  // the ranks meet
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iters; ++i) s.exchange();
  s.synchronize();
  s.samples_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() / iters);
}

// The system's row: the slowest rank's sample, sample by sample, and the bandwidths.
nlohmann::json system_row(System& s, Communicator& world, const ExchangeBytes& bytes, bool verified) {
  const std::vector<std::string> all = world.exchange(nlohmann::json(s.samples_us).dump(), "samples of " + s.name);
  std::vector<double> slowest(s.samples_us.size(), 0.0);
  std::vector<double> rank_median;
  for (const std::string& text : all) {
    const std::vector<double> rank = as_doubles(text);
    SG_CHECK_CODE(rank.size() == slowest.size(), ErrorCode::kInvalidState, "a rank timed ", rank.size(),
                  " samples of ", s.name, ", this one ", slowest.size());
    for (std::size_t i = 0; i < rank.size(); ++i) slowest[i] = std::max(slowest[i], rank[i]);
    rank_median.push_back(summarize(rank).median_us);
  }
  const Summary t = summarize(slowest);
  const double seconds = t.median_us * 1e-6;
  return {{"system", s.name},
          {"transport", s.transport},
          {"verified", verified},
          {"exchange_us", to_json(t)},
          {"rank_median_us", rank_median},
          {"algbw_gbps", static_cast<double>(bytes.routed_bytes) / seconds / 1e9},
          {"cross_rank_gbps", static_cast<double>(bytes.cross_rank_bytes_max) / seconds / 1e9}};
}

int run(const Options& options) {
  const nlohmann::json env = keep_multicast_off("ep_exchange_bench");  // before anything starts NCCL
  const StepConfig config = step_config(options.config);
  const std::vector<std::string> routings = split_list(options.routings);
  for (const std::string& routing : routings) (void)routing_splits(routing, 1, 1);  // names checked up front
  const std::vector<int> copy_blocks = copy_block_counts(options.copy_blocks);
  SG_CHECK(options.samples >= 1 && options.warmup >= 0 && options.iters >= 1, "--samples and --iters must be >= 1 ",
           "and --warmup >= 0, got ", options.samples, ", ", options.iters, " and ", options.warmup);
  SG_CHECK(config.model.experts > 0, "--config ", config.name,
           " has no experts: the exchange moves MoE rows; pass --config moe (host: moe_tiny)");
  const LaunchInfo launch = launch_info_from_env();
  const int n = launch.world_size;
  SG_CHECK(n >= 2, "ep_exchange_bench needs 2 or more ranks, one process per GPU (e.g. torchrun --no-python ",
           "--nproc-per-node 2 bin/ep_exchange_bench), but this run has ", n);
  SG_CHECK(config.model.experts % n == 0, "--config ", config.name, "'s ", config.model.experts,
           " experts do not divide by the ", n, " ranks");
  const std::string tag = detail::concat("ep_exchange_bench --config ", config.name, " --routings ", options.routings,
                                         " --samples ", options.samples, " --iters ", options.iters, " --reference ",
                                         options.reference ? "nccl" : "none", " --copy-blocks ", options.copy_blocks);
  JoinedWorld joined = join_world(options.device, tag, std::chrono::seconds(options.timeout_s), launch);
  Communicator& world = *joined.comm;
  const bool leader = world.rank() == 0;

  const std::int64_t hidden = config.model.hidden;
  const std::int64_t experts = config.model.experts;
  const std::int64_t rows = config.tokens * config.model.topk;  // R
  const DType dtype = config.model.dtype;
  const auto row_bytes = static_cast<std::int64_t>(dtype_size(dtype)) * hidden;

  Context ctx(options.device, 1);
  ctx.set_communication_stream(1);
  const Tensor x = ctx.persistent("x_perm", {Shape{rows, hidden}, dtype});
  const Tensor splits = ctx.persistent("splits", {Shape{experts}, DType::kInt32});
  const Tensor counts = ctx.persistent("counts", {Shape{n, experts}, DType::kInt32});  // what ep_counts makes
  std::vector<std::uint8_t> x_host(static_cast<std::size_t>(rows * row_bytes));
  std::mt19937 rng(1234u + static_cast<std::uint32_t>(world.rank()));
  // Random rows (every second byte 0x3C: finite bf16 values); the exchange moves bytes, checked bit for bit.
  for (std::size_t i = 0; i < x_host.size(); ++i) x_host[i] = i % 2 == 1 ? 0x3C : static_cast<std::uint8_t>(rng());
  ctx.copy_from_host(x, x_host.data(), x_host.size());
  const auto dispatch_and_combine = [&](const Tensor& with_counts,
                                        const ops::EpPeerOptions& peer = {}) -> std::vector<Tensor> {
    const ops::EpDispatch d = ops::ep_dispatch(ctx, world, x, with_counts, peer);
    return {ops::ep_combine(ctx, world, d.rows, with_counts, peer)};
  };
  const std::int64_t windows_before = world.window_transfers();
  const CaptureOptions capture_options{.pool_report_policy = PoolReportPolicy::kError, .communicators = {&world}};
  std::shared_ptr<CapturedStep> captured =
      CapturedStep::capture(ctx, [&] { return dispatch_and_combine(counts); }, capture_options);
  std::shared_ptr<CapturedStep> captured_with_counts = CapturedStep::capture(
      ctx, [&] { return dispatch_and_combine(ops::ep_counts(ctx, world, splits)); }, capture_options);
  // The sweep of the copy's thread blocks: a captured step each (the count is in the ops' params, so in the key).
  std::vector<std::shared_ptr<CapturedStep>> captured_by_blocks;
  for (const int blocks : copy_blocks) {
    captured_by_blocks.push_back(CapturedStep::capture(
        ctx, [&] { return dispatch_and_combine(counts, ops::EpPeerOptions{.blocks = blocks}); }, capture_options));
  }
  std::map<std::string, int> captured_ops;
  const std::string transport = graph_transport(captured->program(), world, captured_ops);
  const auto round_trip_is_x = [&](const Tensor& y) {
    std::vector<std::uint8_t> got(x_host.size());
    ctx.copy_to_host(y, got.data(), got.size());
    return got == x_host;
  };

  // NCCL's all-to-all: x -> received (the bound, P R rows) -> back (R rows).
  std::unique_ptr<NcclAllToAll> nccl;
  std::unique_ptr<DeviceBuffer> nccl_x, nccl_received, nccl_back;
  cudaStream_t nccl_stream = nullptr;
  if (options.reference) {
    nccl = std::make_unique<NcclAllToAll>(world);
    nccl_x = std::make_unique<DeviceBuffer>(x_host.size());
    nccl_received = std::make_unique<DeviceBuffer>(static_cast<std::size_t>(n) * x_host.size());
    nccl_back = std::make_unique<DeviceBuffer>(x_host.size());
    SG_CUDA_CHECK(cudaMemcpy(nccl_x->get(), x_host.data(), x_host.size(), cudaMemcpyHostToDevice));
    SG_CUDA_CHECK(cudaStreamCreateWithFlags(&nccl_stream, cudaStreamNonBlocking));
  }

  nlohmann::json result = {
      {"benchmark", "ep_exchange"},
      {"source", "stepgraph"},
      {"config",
       {{"name", config.name},
        {"hidden", hidden},
        {"tokens_per_rank", config.tokens},
        {"topk", config.model.topk},
        {"experts", experts},
        {"dtype", std::string(dtype_name(dtype))}}},
      {"world_size", n},
      {"launcher", launch.launcher},
      {"communicator", world.describe()},
      {"communicator_peer_transport", std::string(peer_transport_name(world.peer_transport()))},
      {"communicator_peer_transport_reason", world.peer_transport_reason()},
      {"graph_transport", transport},
      {"captured_ops", captured_ops},
      {"multicast_env", env},
      {"samples", options.samples},
      {"warmup", options.warmup},
      {"iters", options.iters},
      {"rows_per_rank", rows},
      {"row_bytes", row_bytes},
      {"timing",
       "the ranks meet before each sample; each times --iters exchanges back to back and one synchronize, / "
       "--iters; a sample is the slowest rank's; the systems alternate sample by sample"},
      {"bytes", "Note [Exchange bandwidth] in benchmarks/ep_exchange_plan.h"},
      {"goal", "stepgraph_graph ratio_vs_nccl >= 0.8 (the same rows moved)"},
      {"copy_blocks", copy_blocks},
      {"default_copy_blocks", ops::EpPeerOptions{}.blocks},
      {"routings", nlohmann::json::array()},
  };
  if (leader) {
    std::printf("%s; %s; captured exchange: %s (%s)\n", describe(launch).c_str(), world.describe().c_str(),
                transport.c_str(), world.peer_transport_reason().c_str());
    std::fflush(stdout);
  }

  bool failed = false;
  for (const std::string& routing : routings) {
    const std::vector<std::int64_t> rank_splits = routing_splits(routing, rows, experts);
    std::vector<std::int32_t> splits32(rank_splits.begin(), rank_splits.end());
    ctx.copy_from_host(splits, splits32.data(), splits32.size() * sizeof(std::int32_t));
    const std::vector<std::vector<std::int64_t>> between = rows_between_ranks(rank_splits, n);
    const ExchangeBytes bytes = exchange_bytes(between, rows, hidden, static_cast<std::int64_t>(dtype_size(dtype)));
    const auto r = static_cast<std::size_t>(world.rank());
    std::vector<std::int64_t> send_rows(between[r]), send_offsets, recv_rows, recv_offsets;
    for (int p = 0; p < n; ++p) recv_rows.push_back(between[static_cast<std::size_t>(p)][r]);
    std::int64_t at = 0;
    for (const std::int64_t c : send_rows) send_offsets.push_back(std::exchange(at, at + c));
    at = 0;
    for (const std::int64_t c : recv_rows) recv_offsets.push_back(std::exchange(at, at + c));

    std::vector<std::int32_t> counts32;  // every rank routes alike: P copies of the splits
    for (int p = 0; p < n; ++p) counts32.insert(counts32.end(), splits32.begin(), splits32.end());
    ctx.copy_from_host(counts, counts32.data(), counts32.size() * sizeof(std::int32_t));

    // The bytes each system puts on the links a rank: the padded exchange the bound, the others the routed rows.
    const std::int64_t graph_bytes = transport == "peer_copy" ? bytes.cross_rank_bytes_max : bytes.padded_bytes;
    const auto sync = [&] { ctx.synchronize(); };
    const int default_blocks = ops::EpPeerOptions{}.blocks;
    std::vector<System> systems;
    systems.push_back({"stepgraph_graph", transport, [&] { captured->replay(); }, sync,
                       [&] { return round_trip_is_x(captured->outputs().at(0)); }, graph_bytes, {}, default_blocks});
    systems.push_back({"stepgraph_graph_with_counts", transport, [&] { captured_with_counts->replay(); }, sync,
                       [&] { return round_trip_is_x(captured_with_counts->outputs().at(0)); }, graph_bytes, {},
                       default_blocks});
    systems.push_back({"stepgraph_eager", "padded_nccl", [&] { (void)dispatch_and_combine(counts); }, sync,
                       [&] { return round_trip_is_x(dispatch_and_combine(counts).at(0)); }, bytes.padded_bytes, {}});
    if (nccl) {
      systems.push_back({"nccl_all_to_all", "nccl (grouped send/recv, host counts)",
                         [&] {
                           nccl->run(nccl_x->get(), send_rows, send_offsets, nccl_received->get(), recv_rows,
                                     recv_offsets, row_bytes, nccl_stream);
                           nccl->run(nccl_received->get(), recv_rows, recv_offsets, nccl_back->get(), send_rows,
                                     send_offsets, row_bytes, nccl_stream);
                         },
                         [&] { SG_CUDA_CHECK(cudaStreamSynchronize(nccl_stream)); },
                         [&] {
                           std::vector<std::uint8_t> back(x_host.size());
                           SG_CUDA_CHECK(cudaMemcpy(back.data(), nccl_back->get(), back.size(),
                                                    cudaMemcpyDeviceToHost));
                           return back == x_host;
                         },
                         bytes.cross_rank_bytes_max,
                         {}});
    }
    for (std::size_t i = 0; i < copy_blocks.size(); ++i) {
      CapturedStep& step = *captured_by_blocks[i];
      systems.push_back({detail::concat("stepgraph_graph_blocks", copy_blocks[i]), transport,
                         [&step] { step.replay(); }, sync,
                         [&step, &round_trip_is_x] { return round_trip_is_x(step.outputs().at(0)); }, graph_bytes, {},
                         copy_blocks[i]});
    }
    // Each system once, then its round trip against x.
    std::vector<bool> verified;
    for (System& s : systems) {
      s.exchange();
      s.synchronize();
      verified.push_back(s.round_trip_is_x());
    }
    for (int i = 0; i < options.warmup; ++i) {
      for (System& s : systems) {
        s.exchange();
        s.synchronize();
      }
    }
    for (int i = 0; i < options.samples; ++i) {
      for (System& s : systems) take_sample(s, world, options.iters);
    }

    nlohmann::json row = {{"routing", routing},
                          {"splits", rank_splits},
                          {"rows_between_ranks", between},
                          {"routed_bytes", bytes.routed_bytes},
                          {"cross_rank_bytes", bytes.cross_rank_bytes},
                          {"cross_rank_bytes_max", bytes.cross_rank_bytes_max},
                          {"padded_bytes", bytes.padded_bytes},
                          {"systems", nlohmann::json::array()}};
    for (std::size_t i = 0; i < systems.size(); ++i) {
      row["systems"].push_back(system_row(systems[i], world, bytes, verified[i]));
      row["systems"].back()["bytes_moved_per_rank"] = systems[i].bytes_moved_per_rank;
      if (systems[i].copy_blocks > 0) row["systems"].back()["copy_blocks"] = systems[i].copy_blocks;
      // Every rank's check: one rank's wrong bytes fail the row.
      const std::vector<std::string> checks = world.exchange(verified[i] ? "1" : "0", "check of " + systems[i].name);
      for (const std::string& c : checks) failed = failed || c != "1";
      row["systems"].back()["verified"] = std::all_of(checks.begin(), checks.end(), [](auto& c) { return c == "1"; });
    }
    std::map<std::string, nlohmann::json*> by_name;
    for (nlohmann::json& system : row["systems"]) by_name[system["system"].get<std::string>()] = &system;
    const auto median = [&](const std::string& name) {
      return (*by_name.at(name))["exchange_us"]["median_us"].get<double>();
    };
    (*by_name.at("stepgraph_graph"))["graph_speedup_vs_eager"] = median("stepgraph_eager") / median("stepgraph_graph");
    std::vector<std::string> ours = {"stepgraph_graph", "stepgraph_graph_with_counts", "stepgraph_eager"};
    std::string fastest;  // of the sweep's rows
    for (const int blocks : copy_blocks) {
      ours.push_back(detail::concat("stepgraph_graph_blocks", blocks));
      if (fastest.empty() || median(ours.back()) < median(fastest)) fastest = ours.back();
    }
    row["best_copy_blocks"] = (*by_name.at(fastest))["copy_blocks"];
    if (nccl) {
      for (const std::string& name : ours) {
        (*by_name.at(name))["ratio_vs_nccl"] = median("nccl_all_to_all") / median(name);
      }
    }
    if (leader) {
      std::printf("%-8s", routing.c_str());
      for (const nlohmann::json& s : row["systems"]) {
        std::printf("  %s %.1f us (%.1f GB/s routed, %.1f GB/s busiest link%s)%s", s["system"].get<std::string>().c_str(),
                    s["exchange_us"]["median_us"].get<double>(), s["algbw_gbps"].get<double>(),
                    s["cross_rank_gbps"].get<double>(),
                    s.contains("ratio_vs_nccl") ? detail::concat(", ", s["ratio_vs_nccl"].get<double>(), "x NCCL").c_str()
                                                : "",
                    s["verified"].get<bool>() ? "" : " WRONG BYTES");
      }
      std::printf("\n%-8s  fastest copy: %d blocks\n", routing.c_str(), row["best_copy_blocks"].get<int>());
      std::fflush(stdout);
      result["routings"].push_back(std::move(row));
      write_json(options.out, result);  // after every routing: a later failure keeps the earlier rows
    }
  }
  result["window_transfers"] = world.window_transfers() - windows_before;
  if (leader) write_json(options.out, result);
  if (nccl_stream != nullptr) SG_CUDA_CHECK(cudaStreamDestroy(nccl_stream));
  (void)world.exchange("done", "ep_exchange_bench done");
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph::bench

int main(int argc, char** argv) {
  CLI::App app{"The expert-parallel exchange (dispatch, combine), captured and eager, against NCCL's "
               "all-to-all on the same rows"};
  stepgraph::bench::Options options;
  std::string device = "cuda";
  std::string reference = "nccl";
  app.add_option("--config", options.config, "a step config with experts: its hidden, tokens x topk rows, experts")
      ->capture_default_str();
  app.add_option("--device", device, "cuda, or host (a smoke run: --config moe_tiny --reference none)")
      ->check(CLI::IsMember({"cuda", "host"}))
      ->capture_default_str();
  app.add_option("--routings", options.routings, "comma-separated: uniform, skewed (Zipf over the experts)")
      ->capture_default_str();
  app.add_option("--reference", reference, "nccl (NCCL's all-to-all with host counts), or none")
      ->check(CLI::IsMember({"nccl", "none"}))
      ->capture_default_str();
  app.add_option("--samples", options.samples, "timed samples per system")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed exchanges per system first")->capture_default_str();
  app.add_option("--iters", options.iters, "exchanges per sample, back to back")->capture_default_str();
  app.add_option("--copy-blocks", options.copy_blocks,
                 "comma-separated thread-block counts of the captured exchange's peer copy (1 to 132): a "
                 "stepgraph_graph_blocksN row each")
      ->capture_default_str();
  app.add_option("--timeout-s", options.timeout_s, "a rank that does not answer within this is an error")
      ->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  options.device = device == "cuda" ? stepgraph::Device::kCuda : stepgraph::Device::kHost;
  options.reference = reference == "nccl";
  return stepgraph::bench::run_main("ep_exchange_bench", [&] { return stepgraph::bench::run(options); });
}
