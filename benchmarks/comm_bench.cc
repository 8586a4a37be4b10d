// Collective bus bandwidth: all-gather, reduce-scatter and all-reduce through
// the NCCL Communicator (engine/nccl_communicator.h), each issued from the
// host every time (eager) and replayed inside a CUDA graph (graph), over
// message sizes from --min-bytes to --max-bytes.
//
//   comm_bench --out comm_bench.json                                   # one process: world size 1
//   torchrun --nproc-per-node 8 --no-python bin/comm_bench --out comm_bench.json
//   srun -n 8 bin/comm_bench ...     mpirun -np 8 bin/comm_bench ...
//
// One process per GPU: rank, world size and local rank come from the
// launcher's variables (launch_info_from_env: torchrun, Slurm srun, Open MPI
// mpirun; none set is one process of world size 1); each rank drives GPU
// `local_rank`; rank 0 makes NCCL's unique id and the Rendezvous
// (launch/rendezvous.h) carries it to the others. At world size 1
// NCCL's collectives are local copies (or nothing, for the in-place
// all-reduce): no link is crossed, the output says so, and busbw is 0.
// benchmarks/comm_peer.py measures the same rows through torch.distributed
// and writes the same JSON.
//
// NVLink multicast stays off (DESIGN.md): NCCL_NVLS_ENABLE=0,
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are put in
// the environment before NCCL starts (a different value is replaced, with a
// warning), and nothing here calls cuMulticastCreate.
//
// Note [Bytes and bus bandwidth]
// nccl-tests' definitions (its doc/PERFORMANCE.md). A row's "bytes" S is the
// size nccl-tests gives the collective, for n ranks and elements of E bytes:
//   all_reduce      S = the buffer each rank reduces (count * E); in place, as gradients are
//   all_gather      S = the gathered output of each rank = n * its input; out of place
//   reduce_scatter  S = the input of each rank = n * its output; out of place
// (S is rounded down to a multiple of n * E; the row gives the bytes used.)
// With t the time of one collective (GB/s are 1e9 bytes per second):
//   algbw = S / t
//   busbw = algbw * 2 (n - 1) / n   for all_reduce
//   busbw = algbw * (n - 1) / n     for all_gather and reduce_scatter
// busbw is the rate at which the busiest link moves data, comparable across
// n and with the hardware's link bandwidth. At n = 1 it is 0.
//
// Note [Timing]
// A sample is --iters collectives on the rank's stream between two CUDA
// events, t = the events' time / iters. Eager: --iters calls of the
// Communicator from the host. Graph: iters / graph_iters launches of one
// CUDA graph holding --graph-iters collectives. After --warmup untimed
// samples of each mode, --repeats samples are taken, eager and graph
// alternating sample by sample so that clock and temperature drift reach
// both alike. Each rank times its own samples; a row's sample is their mean
// over the ranks (nccl-tests' default, -a 1); the row gives the median, min
// and max over the samples, and each rank's median. graph_over_eager is the
// graph's median bandwidth over the eager's (= eager median time / graph
// median time; > 1: the graph is faster).
//
// Note [What the graph holds]
// The graph is recorded by StreamCapture (engine/stream_capture.h) around the
// very Communicator calls the eager mode makes, on the same stream and
// buffers, so the two modes differ only in how each collective is issued: a
// host call (enqueue, and the non-blocking communicator's poll until NCCL has
// taken it) or a node of a replayed graph. CapturedStep with the collective
// ops records the same NCCL kernels, but around them the step's own work
// (fork/join events to the communication stream, outputs in the pool, the
// cross-rank uniformity check at capture): that is the training step's cost,
// which step_bench measures, not the collective's.
//
// Before timing, every row checks that the collective moved the bytes: the
// send buffer is filled with the value v (bytes 0x3F), the receive buffer
// zeroed, and the first and last elements read back after one eager call and
// after one graph launch (all_gather: v; reduce_scatter: n v; the in-place
// all_reduce: v n^k after k collectives). A failed check marks the row and
// the run exits 1 at the end.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_support.h"
#include "engine/communicator.h"
#include "engine/cuda_check.h"
#include "engine/cuda_graph.h"
#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "launch/join.h"
#include "launch/launch_env.h"
#include "launch/rendezvous.h"
#include "engine/nccl_communicator.h"
#include "engine/stream.h"
#include "engine/stream_capture.h"

namespace stepgraph {
namespace {

using nlohmann::json;

struct Options {
  std::string min_bytes = "1M";
  std::string max_bytes = "1G";
  int factor = 2;
  std::vector<std::string> ops = {"all_gather", "reduce_scatter", "all_reduce"};
  std::string dtype = "bf16";
  int iters = 20;
  int graph_iters = 20;
  int warmup = 3;
  int repeats = 10;
  int timeout_s = 300;
  int rendezvous_port = 0;  // 0: see rendezvous_port()
  std::string out;
};

// ---------------------------------------------------------------- environment

// ---------------------------------------------------------------- flags

// "64M", "1G", "4096", "512KiB": bytes, with a 1024-based suffix.
std::int64_t parse_bytes(std::string_view flag, const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string suffix;
  for (char c : text.substr(digits)) suffix += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  int shift = -1;
  if (suffix.empty() || suffix == "b") shift = 0;
  if (suffix == "k" || suffix == "kib") shift = 10;
  if (suffix == "m" || suffix == "mib") shift = 20;
  if (suffix == "g" || suffix == "gib") shift = 30;
  SG_CHECK(digits > 0 && digits <= 12 && shift >= 0, flag, ": '", text,
           "' is not a size: give bytes, or a number with K, M or G (1024-based), e.g. 64M");
  const std::int64_t value = std::stoll(text.substr(0, digits));
  SG_CHECK(value > 0, flag, " must be positive, got '", text, "'");
  SG_CHECK(value <= (std::int64_t{1} << 40) >> shift, flag, ": '", text, "' is more than 1 TiB");
  return value << shift;
}

enum class Collective { kAllGather, kReduceScatter, kAllReduce };

Collective parse_collective(const std::string& name) {
  if (name == "all_gather") return Collective::kAllGather;
  if (name == "reduce_scatter") return Collective::kReduceScatter;
  SG_CHECK(name == "all_reduce", "--ops: the collectives are all_gather, reduce_scatter and all_reduce; got '", name,
           "'");
  return Collective::kAllReduce;
}

const char* collective_name(Collective op) {
  switch (op) {
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllReduce: return "all_reduce";
  }
  return "?";
}

// nccl-tests' bus bandwidth factor (Note [Bytes and bus bandwidth]).
double bus_factor(Collective op, int world) {
  const double n = world;
  return op == Collective::kAllReduce ? 2.0 * (n - 1.0) / n : (n - 1.0) / n;
}

struct Plan {
  std::vector<Collective> ops;
  std::vector<std::int64_t> sizes;  // requested S, bytes
  DType dtype = DType::kBFloat16;
};

Plan make_plan(const Options& options) {
  Plan plan;
  SG_CHECK(!options.ops.empty(), "--ops: name at least one of all_gather, reduce_scatter, all_reduce");
  for (const std::string& name : options.ops) {
    const Collective op = parse_collective(name);
    SG_CHECK(std::find(plan.ops.begin(), plan.ops.end(), op) == plan.ops.end(), "--ops names ", name, " twice");
    plan.ops.push_back(op);
  }
  SG_CHECK(options.dtype == "bf16" || options.dtype == "fp32", "--dtype is bf16 or fp32, got '", options.dtype, "'");
  plan.dtype = options.dtype == "bf16" ? DType::kBFloat16 : DType::kFloat32;
  SG_CHECK(options.factor >= 2, "--factor (between one size and the next) must be at least 2, got ", options.factor);
  SG_CHECK(options.iters > 0, "--iters (collectives per timed sample) must be positive, got ", options.iters);
  SG_CHECK(options.graph_iters > 0, "--graph-iters (collectives per graph) must be positive, got ",
           options.graph_iters);
  SG_CHECK(options.iters % options.graph_iters == 0, "--iters (", options.iters,
           ") must be a multiple of --graph-iters (", options.graph_iters,
           "): a graph sample launches the graph iters / graph-iters times");
  SG_CHECK(options.warmup >= 0, "--warmup must be >= 0, got ", options.warmup);
  SG_CHECK(options.repeats > 0, "--repeats (timed samples per mode) must be positive, got ", options.repeats);
  SG_CHECK(options.timeout_s > 0, "--timeout-s must be positive, got ", options.timeout_s);
  SG_CHECK(options.rendezvous_port >= 0 && options.rendezvous_port <= 65535,
           "--rendezvous-port must be a port (1-65535, or 0 for the default), got ", options.rendezvous_port);
  const std::int64_t min_bytes = parse_bytes("--min-bytes", options.min_bytes);
  const std::int64_t max_bytes = parse_bytes("--max-bytes", options.max_bytes);
  SG_CHECK(max_bytes >= min_bytes, "--max-bytes (", options.max_bytes, ") is below --min-bytes (", options.min_bytes,
           ")");
  for (std::int64_t size = min_bytes; size <= max_bytes; size *= options.factor) {
    plan.sizes.push_back(size);
    if (size > max_bytes / options.factor) break;
  }
  return plan;
}

// ---------------------------------------------------------------- one row

// The Communicator's arguments for one row (Note [Bytes and bus bandwidth]).
struct Row {
  Collective op;
  std::int64_t bytes = 0;          // S as used: a multiple of world * element size
  std::int64_t elements = 0;       // S / E
  std::int64_t count = 0;          // the Communicator's count argument
  std::int64_t send_elements = 0;  // of the send buffer (all_reduce: the buffer itself)
  std::int64_t recv_elements = 0;
};

Row make_row(Collective op, std::int64_t requested, DType dtype, int world) {
  const auto element = static_cast<std::int64_t>(dtype_size(dtype));
  const std::int64_t per_rank = requested / (element * world);
  SG_CHECK(per_rank > 0, "--min-bytes: ", requested, " bytes is less than one ", dtype_name(dtype),
           " element per rank (", world, " ranks)");
  Row row{.op = op};
  row.elements = per_rank * world;
  row.bytes = row.elements * element;
  switch (op) {
    case Collective::kAllReduce: row.count = row.send_elements = row.recv_elements = row.elements; break;
    case Collective::kAllGather:
      row.count = row.send_elements = per_rank;
      row.recv_elements = row.elements;
      break;
    case Collective::kReduceScatter:
      row.count = row.recv_elements = per_rank;
      row.send_elements = row.elements;
      break;
  }
  return row;
}

void issue(Communicator& comm, const Row& row, DType dtype, void* send, void* recv, cudaStream_t stream) {
  switch (row.op) {
    case Collective::kAllReduce: comm.all_reduce(recv, recv, row.count, dtype, ReduceOp::kSum, stream); break;
    case Collective::kAllGather: comm.all_gather(send, recv, row.count, dtype, stream); break;
    case Collective::kReduceScatter: comm.reduce_scatter(send, recv, row.count, dtype, ReduceOp::kSum, stream); break;
  }
}

// Waits for `event` without hanging: a peer that died or an NCCL error ends
// the wait with an Error (the communicator aborted) after `timeout`.
void wait_for(const Event& event, Communicator& comm, std::chrono::milliseconds timeout, std::string_view what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const cudaError_t status = cudaEventQuery(event.get());
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) SG_CUDA_CHECK(status);
    comm.check_health();
    if (std::chrono::steady_clock::now() > deadline) {
      comm.abort(detail::concat(what, " did not finish within ", timeout.count() / 1000, " s"));
      SG_THROW(ErrorCode::kNccl, comm.describe(), ": ", what, " did not finish within ", timeout.count() / 1000,
               " s (a rank that stopped?); the communicator was aborted");
    }
    std::this_thread::yield();
  }
}

// The fill value v: every byte 0x3F.
float fill_value(DType dtype) {
  if (dtype == DType::kBFloat16) return bf16_to_float(0x3F3F);
  const std::uint32_t bits = 0x3F3F3F3Fu;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Empty when the receive buffer holds what `collectives` launches of the
// row's collective leave (Note at the top), else what differs.
std::string check_result(const Row& row, DType dtype, const void* recv, int world, int collectives,
                         std::string_view mode) {
  const float v = fill_value(dtype);
  double expected = v;
  if (row.op == Collective::kReduceScatter) expected = v * world;
  if (row.op == Collective::kAllReduce) expected = v * std::pow(static_cast<double>(world), collectives);
  // Each sum of n values rounds once per step of NCCL's reduction.
  const double unit = dtype == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -20);
  const int reductions = row.op == Collective::kAllGather ? 0 : row.op == Collective::kReduceScatter ? 1 : collectives;
  const double tolerance = reductions * world * unit * std::abs(expected);
  const auto element = static_cast<std::int64_t>(dtype_size(dtype));
  for (const std::int64_t index : {std::int64_t{0}, row.recv_elements - 1}) {
    std::uint32_t raw = 0;
    SG_CUDA_CHECK(cudaMemcpy(&raw, static_cast<const char*>(recv) + index * element, static_cast<std::size_t>(element),
                             cudaMemcpyDeviceToHost));
    float got;
    if (dtype == DType::kBFloat16) {
      got = bf16_to_float(static_cast<std::uint16_t>(raw));
    } else {
      std::memcpy(&got, &raw, sizeof(got));
    }
    const bool ok = expected > std::numeric_limits<float>::max() ? std::isinf(got) && got > 0
                                                                 : std::abs(got - expected) <= tolerance;
    if (!ok) {
      std::ostringstream message;
      message << collective_name(row.op) << " " << row.bytes << " bytes (" << mode << ", " << collectives
              << " collective(s)): element " << index << " is " << got << ", expected " << expected;
      return message.str();
    }
  }
  return "";
}

std::string format_bytes(std::int64_t bytes) {
  std::ostringstream text;
  if (bytes >= (std::int64_t{1} << 30) && bytes % (std::int64_t{1} << 30) == 0) {
    text << (bytes >> 30) << " GiB";
  } else if (bytes >= (std::int64_t{1} << 20) && bytes % (std::int64_t{1} << 20) == 0) {
    text << (bytes >> 20) << " MiB";
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    text << (bytes >> 10) << " KiB";
  } else {
    text << bytes << " B";
  }
  return text.str();
}

std::string to_bytes(const std::vector<double>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(double));
}

std::vector<double> from_bytes(const std::string& bytes) {
  std::vector<double> values(bytes.size() / sizeof(double));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(double));
  return values;
}

// One mode's samples (mean over ranks) as JSON: time, algbw and busbw.
json mode_json(const Row& row, int world, const std::vector<double>& mean_us, const std::vector<double>& rank_medians,
               bench::Summary* summary_out) {
  const bench::Summary time = bench::summarize(mean_us);
  *summary_out = time;
  const double gb = static_cast<double>(row.bytes) / 1e9;
  const double factor = bus_factor(row.op, world);
  auto bandwidth = [&](double scale) {
    return json{{"median", scale * gb / (time.median_us * 1e-6)},
                {"min", scale * gb / (time.max_us * 1e-6)},
                {"max", scale * gb / (time.min_us * 1e-6)}};
  };
  return {{"time_us", bench::to_json(time)},
          {"algbw_gbps", bandwidth(1.0)},
          {"busbw_gbps", bandwidth(factor)},
          {"rank_median_us", rank_medians}};
}

struct Bench {
  const Options& options;
  const Plan& plan;
  const LaunchInfo& info;
  Communicator& comm;
  Rendezvous& rendezvous;
  Stream& stream;
  void* send;
  void* recv;
  std::chrono::milliseconds timeout;
};

json run_row(Bench& c, const Row& row, std::vector<std::string>* failures) {
  const int world = c.info.world_size;
  const DType dtype = c.plan.dtype;
  const auto element = static_cast<std::size_t>(dtype_size(dtype));
  const cudaStream_t stream = c.stream.get();
  const std::string what = detail::concat(collective_name(row.op), " ", row.bytes, " bytes");
  Event start(Event::Timing::kEnabled);
  Event stop(Event::Timing::kEnabled);
  auto drain = [&](std::string_view step) {
    stop.record(stream);
    wait_for(stop, c.comm, c.timeout, detail::concat(what, " ", step));
  };
  // Fill (all_reduce is in place: its input is the receive buffer).
  auto reset = [&] {
    if (row.op == Collective::kAllReduce) {
      SG_CUDA_CHECK(cudaMemsetAsync(c.recv, 0x3F, row.recv_elements * element, stream));
    } else {
      SG_CUDA_CHECK(cudaMemsetAsync(c.send, 0x3F, row.send_elements * element, stream));
      SG_CUDA_CHECK(cudaMemsetAsync(c.recv, 0, row.recv_elements * element, stream));
    }
  };

  std::vector<std::string> checks;
  reset();
  issue(c.comm, row, dtype, c.send, c.recv, stream);
  drain("(eager check)");
  checks.push_back(check_result(row, dtype, c.recv, world, 1, "eager"));

  StreamCapture capture(stream);
  for (int i = 0; i < c.options.graph_iters; ++i) issue(c.comm, row, dtype, c.send, c.recv, stream);
  const Graph graph = capture.end();
  const GraphExec exec(graph);
  exec.upload(stream);
  reset();
  exec.launch(stream);
  drain("(graph check)");
  checks.push_back(check_result(row, dtype, c.recv, world, c.options.graph_iters, "graph"));

  auto eager_sample = [&] {
    for (int i = 0; i < c.options.iters; ++i) issue(c.comm, row, dtype, c.send, c.recv, stream);
  };
  auto graph_sample = [&] {
    for (int i = 0; i < c.options.iters / c.options.graph_iters; ++i) exec.launch(stream);
  };
  for (int i = 0; i < c.options.warmup; ++i) {
    eager_sample();
    graph_sample();
  }
  drain("(warm-up)");
  // [0, repeats): eager; [repeats, 2 repeats): graph. Microseconds per collective.
  std::vector<double> samples(2 * static_cast<std::size_t>(c.options.repeats));
  for (int r = 0; r < c.options.repeats; ++r) {
    for (int mode = 0; mode < 2; ++mode) {
      start.record(stream);
      if (mode == 0) {
        eager_sample();
      } else {
        graph_sample();
      }
      stop.record(stream);
      wait_for(stop, c.comm, c.timeout, detail::concat(what, mode == 0 ? " (eager)" : " (graph)"));
      samples[static_cast<std::size_t>(mode * c.options.repeats + r)] =
          1000.0 * Event::elapsed_ms(start, stop) / c.options.iters;
    }
  }

  std::string my_checks;
  for (const std::string& check : checks) {
    if (!check.empty()) my_checks += (my_checks.empty() ? "" : "; ") + check;
  }
  const std::vector<std::string> all_samples = c.rendezvous.all_gather(to_bytes(samples), "samples of " + what);
  const std::vector<std::string> all_checks = c.rendezvous.all_gather(my_checks, "checks of " + what);

  std::string check = "ok";
  for (int r = 0; r < world; ++r) {
    if (all_checks[static_cast<std::size_t>(r)].empty()) continue;
    const std::string failure = detail::concat("rank ", r, ": ", all_checks[static_cast<std::size_t>(r)]);
    check = check == "ok" ? failure : check + "; " + failure;
    failures->push_back(failure);
  }
  const auto repeats = static_cast<std::size_t>(c.options.repeats);
  json modes = json::object();
  bench::Summary summaries[2];
  for (std::size_t mode = 0; mode < 2; ++mode) {
    std::vector<double> mean(repeats, 0.0);
    std::vector<double> rank_medians;
    for (const std::string& bytes : all_samples) {
      const std::vector<double> theirs = from_bytes(bytes);
      SG_CHECK_CODE(theirs.size() == 2 * repeats, ErrorCode::kInternal, "a rank sent ", theirs.size(), " samples, not ",
                    2 * repeats);
      std::vector<double> own(theirs.begin() + static_cast<std::ptrdiff_t>(mode * repeats),
                              theirs.begin() + static_cast<std::ptrdiff_t>((mode + 1) * repeats));
      for (std::size_t i = 0; i < repeats; ++i) mean[i] += own[i] / world;
      rank_medians.push_back(bench::summarize(own).median_us);
    }
    modes[mode == 0 ? "eager" : "graph"] = mode_json(row, world, mean, rank_medians, &summaries[mode]);
  }
  return {{"op", collective_name(row.op)},
          {"bytes", row.bytes},
          {"elements", row.elements},
          {"count", row.count},
          {"in_place", row.op == Collective::kAllReduce},
          {"dtype", dtype == DType::kBFloat16 ? "bf16" : "fp32"},
          {"check", check},
          {"eager", modes["eager"]},
          {"graph", modes["graph"]},
          {"graph_over_eager", summaries[0].median_us / summaries[1].median_us}};
}

// ---------------------------------------------------------------- the run

// The rendezvous port: --rendezvous-port, else the launcher's (launch_env.h:
// MASTER_PORT, one up under torchrun's agent store).
int rendezvous_port(const Options& options, const LaunchInfo& info, std::string* note) {
  if (options.rendezvous_port == 0) return info.master_port;
  *note = detail::concat("the rendezvous uses --rendezvous-port ", options.rendezvous_port);
  return options.rendezvous_port;
}

std::string run_tag(const Options& options, const Plan& plan) {
  std::ostringstream tag;
  tag << "comm_bench";
  for (const Collective op : plan.ops) tag << " " << collective_name(op);
  tag << " sizes";
  for (const std::int64_t size : plan.sizes) tag << " " << size;
  tag << " dtype " << options.dtype << " iters " << options.iters << " graph_iters " << options.graph_iters
      << " warmup " << options.warmup << " repeats " << options.repeats;
  return tag.str();
}

void print_header(std::ostream& out) {
  out << std::left << std::setw(15) << "op" << std::right << std::setw(9) << "size"
      << " | " << std::setw(26) << "eager us (min-max)" << std::setw(11) << "algbw" << std::setw(11) << "busbw"
      << " | " << std::setw(26) << "graph us (min-max)" << std::setw(11) << "algbw" << std::setw(11) << "busbw"
      << " | " << std::setw(11) << "graph/eager"
      << "  check\n";
}

void print_row(std::ostream& out, const json& row) {
  auto cell = [](const json& mode) {
    std::ostringstream text;
    text << std::fixed << std::setprecision(1) << mode["time_us"]["median_us"].get<double>() << " ("
         << mode["time_us"]["min_us"].get<double>() << "-" << mode["time_us"]["max_us"].get<double>() << ")";
    return text.str();
  };
  out << std::left << std::setw(15) << row["op"].get<std::string>() << std::right << std::setw(9)
      << format_bytes(row["bytes"].get<std::int64_t>()) << " | " << std::fixed << std::setprecision(2) << std::setw(26)
      << cell(row["eager"]) << std::setw(11) << row["eager"]["algbw_gbps"]["median"].get<double>() << std::setw(11)
      << row["eager"]["busbw_gbps"]["median"].get<double>() << " | " << std::setw(26) << cell(row["graph"])
      << std::setw(11) << row["graph"]["algbw_gbps"]["median"].get<double>() << std::setw(11)
      << row["graph"]["busbw_gbps"]["median"].get<double>() << " | " << std::setw(10)
      << row["graph_over_eager"].get<double>() << "x  " << row["check"].get<std::string>() << "\n";
}

constexpr const char* kCopiesNote =
    "world size 1: NCCL's collectives are local copies (the in-place all_reduce may move nothing): no link is "
    "crossed, busbw is 0 by its formula and algbw is a device-memory rate; launch one rank per GPU (torchrun, srun, "
    "mpirun) to measure the links";

int run_ranked(const Options& options, const Plan& plan, const LaunchInfo& info, const json& env) {
  const bool leader = info.rank == 0;
  const auto timeout = std::chrono::milliseconds(std::int64_t{1000} * options.timeout_s);
  const DeviceCount found = cuda_device_count();
  SG_CHECK_CODE(found.count > 0, ErrorCode::kNoDevice, found.no_device_reason, "; comm_bench needs one GPU per rank");
  SG_CHECK(info.local_rank < found.count, "local rank ", info.local_rank, " but this host has ", found.count,
           " GPU(s): start at most one rank per GPU");
  SG_CUDA_CHECK(cudaSetDevice(info.local_rank));
  const DeviceProperties device = device_properties(info.local_rank);

  // Buffers for the largest row of any op: send and receive S bytes each.
  std::int64_t largest = 0;
  for (const Collective op : plan.ops) {
    for (const std::int64_t size : plan.sizes) {
      const Row row = make_row(op, size, plan.dtype, info.world_size);
      largest = std::max({largest, row.send_elements, row.recv_elements});
    }
  }
  const std::int64_t buffer_bytes = largest * static_cast<std::int64_t>(dtype_size(plan.dtype));
  const DeviceMemory memory = device_memory(info.local_rank);
  SG_CHECK_CODE(2 * buffer_bytes + (std::int64_t{1} << 30) <= static_cast<std::int64_t>(memory.free_bytes),
                ErrorCode::kOutOfMemory, "--max-bytes ", options.max_bytes, " needs 2 x ", format_bytes(buffer_bytes),
                " of buffers (send and receive) and room for NCCL (1 GiB), but ", device.name, " has ",
                memory.free_bytes >> 20, " MiB free; lower --max-bytes");

  LaunchInfo meeting = info;
  std::string port_note;
  meeting.master_port = rendezvous_port(options, info, &port_note);
  if (leader && !port_note.empty()) std::cerr << "comm_bench: " << port_note << "\n";
  std::unique_ptr<Rendezvous> rendezvous = Rendezvous::connect(meeting, run_tag(options, plan), timeout);
  std::unique_ptr<Communicator> comm = join_nccl(info, *rendezvous, timeout);
  const std::string version = nccl_version();

  if (leader) {
    std::cout << "comm_bench: NCCL " << version << ", " << describe(info) << "; " << describe(device) << "\n"
              << "  " << options.dtype << ", " << options.iters << " collectives per sample, graphs of "
              << options.graph_iters << ", " << options.warmup << " warm-up + " << options.repeats
              << " timed samples per mode; sample times are means over ranks, medians (min-max) over samples;"
              << " GB/s; " << env.dump() << "\n";
    if (info.world_size == 1) std::cout << "  NOTE: " << kCopiesNote << "\n";
    print_header(std::cout);
  }

  bench::DeviceBuffer send(static_cast<std::size_t>(buffer_bytes));
  bench::DeviceBuffer recv(static_cast<std::size_t>(buffer_bytes));
  Stream stream;
  Bench bench{options, plan, info, *comm, *rendezvous, stream, send.get(), recv.get(), timeout};
  json rows = json::array();
  std::vector<std::string> failures;
  for (const Collective op : plan.ops) {
    for (const std::int64_t size : plan.sizes) {
      json row = run_row(bench, make_row(op, size, plan.dtype, info.world_size), &failures);
      if (leader) print_row(std::cout, row);
      rows.push_back(std::move(row));
    }
  }
  comm->check_health();
  rendezvous->barrier("comm_bench done");

  if (leader) {
    const json result = {
        {"benchmark", "comm"},
        {"source", "stepgraph"},
        {"device", device.name},
        {"nccl_version", version},
        {"world_size", info.world_size},
        {"local_world_size", info.local_world_size},
        {"launcher", info.launcher},
        {"copies_only", info.world_size == 1},
        {"note", info.world_size == 1 ? kCopiesNote : ""},
        {"dtype", options.dtype},
        {"iters", options.iters},
        {"graph_iters", options.graph_iters},
        {"warmup", options.warmup},
        {"repeats", options.repeats},
        {"multicast_env", env},
        {"capture", "StreamCapture around the Communicator's calls (Note [What the graph holds] in comm_bench.cc)"},
        {"timing",
         "CUDA events around iters collectives, per collective; mean over ranks; median/min/max over repeats"},
        {"formulas",
         {{"bytes",
           {{"all_reduce", "count * E, in place"},
            {"all_gather", "n * per-rank input (the gathered output)"},
            {"reduce_scatter", "n * per-rank output (the input)"}}},
          {"algbw", "bytes / time, GB/s = 1e9 B/s"},
          {"busbw",
           {{"all_reduce", "algbw * 2(n-1)/n"},
            {"all_gather", "algbw * (n-1)/n"},
            {"reduce_scatter", "algbw * (n-1)/n"}}},
          {"graph_over_eager", "graph median bandwidth / eager median bandwidth"}}},
        {"status", failures.empty() ? "ok" : "failed"},
        {"rows", rows},
    };
    bench::write_json(options.out, result);
    if (!failures.empty()) {
      std::cout << "comm_bench: " << failures.size() << " check(s) failed:\n";
      for (const std::string& failure : failures) std::cout << "  " << failure << "\n";
    }
  }
  return failures.empty() ? EXIT_SUCCESS : EXIT_FAILURE;
}

int run(const Options& options) {
  const json env = bench::keep_multicast_off("comm_bench");  // before anything reads NCCL's variables
  const Plan plan = make_plan(options);
  const LaunchInfo info = launch_info_from_env();
  try {
    return run_ranked(options, plan, info, env);
  } catch (const Error& error) {
    if (info.world_size > 1) {
      std::cerr << "comm_bench rank " << info.rank << ": " << error.message() << "\n";
      return EXIT_FAILURE;
    }
    throw;
  }
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Collective bus bandwidth (all-gather, reduce-scatter, all-reduce), eager and replayed in CUDA graphs"};
  stepgraph::Options options;
  app.add_option("--min-bytes", options.min_bytes, "smallest message: bytes, or with K, M, G (1024-based)")
      ->capture_default_str();
  app.add_option("--max-bytes", options.max_bytes, "largest message (nccl-tests' size: see the file's comment)")
      ->capture_default_str();
  app.add_option("--factor", options.factor, "each size is the previous one times this")->capture_default_str();
  app.add_option("--ops", options.ops, "all_gather, reduce_scatter, all_reduce")->delimiter(',')->capture_default_str();
  app.add_option("--dtype", options.dtype, "bf16 or fp32")->capture_default_str();
  app.add_option("--iters", options.iters, "collectives per timed sample")->capture_default_str();
  app.add_option("--graph-iters", options.graph_iters, "collectives captured in one graph (divides --iters)")
      ->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed samples per mode and row first")->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed samples per mode and row")->capture_default_str();
  app.add_option("--timeout-s", options.timeout_s, "a rank that does not answer within this is an error")
      ->capture_default_str();
  app.add_option("--rendezvous-port", options.rendezvous_port,
                 "where rank 0 listens for the others (0: MASTER_PORT; under torchrun MASTER_PORT + 1)")
      ->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("comm_bench", [&] { return stepgraph::run(options); });
}
