// GEMM chunking: what splitting a GEMM into token chunks costs on one GPU,
// the price of overlapping a tensor-parallel MLP's GEMMs with its collectives
// (each chunk's all-gather or reduce-scatter runs while the next
// chunk's GEMM computes; goal: chunked / one GEMM <= 1.05).
//
//   gemm_chunk_bench --config large --tp 2 --chunks 2,4,8 --repeats 50 --out gemm_chunk.json
//
// The GEMMs of one rank's sequence-parallel LayerNormMLP (Note
// [Sequence-parallel LayerNormMLP] in layers/layernorm_mlp.h) at a step
// config's shapes: T tokens (all ranks' tokens, after the all-gather), hidden
// H, ffn slice F/tp. bf16 inputs (uniform in [-1, 1)), fp32 accumulation,
// bf16 out (the weight gradients fp32, as the layer writes them); no
// epilogues (see kGemms).
//
//   fc1_fwd    y1[T, F/tp] = x[T, H]      W1[F/tp, H]^T     chunks: token rows of x, y1
//   fc2_fwd    y2[T, H]    = act[T, F/tp] W2[H, F/tp]^T     chunks: token rows of act, y2
//   fc2_dgrad  dact[T, F/tp] = dy[T, H]   W2[H, F/tp]       chunks: token rows of dy, dact
//   fc1_dgrad  dx[T, H]    = dpre[T, F/tp] W1[F/tp, H]      chunks: token rows of dpre, dx
//   fc2_wgrad  dW2[H, F/tp] = dy[T, H]^T act[T, F/tp]       chunks: token rows of both (the reduced dimension)
//   fc1_wgrad  dW1[F/tp, H] = dpre[T, F/tp]^T x[T, H]       chunks: likewise
//
// Per GEMM: (a) one launch_gemm over all T tokens, (b) for each k of --chunks,
// k launch_gemm calls of T/k tokens each, at row offsets into the same
// buffers (no copies): a row-chunked GEMM writes its row block of the output;
// a reduced-dimension chunk accumulates into the whole output (the first with
// beta = 0, the rest beta = 1). Every variant is one captured CUDA graph (the
// k calls in order on one stream), replayed; the variants of a GEMM are timed
// interleaved round by round with device events (as gemm_bench does, so the
// card's heating falls on all alike): median, min and max over --repeats.
// ratio = chunked median / one-GEMM median.
//
// The check: after one replay of each graph, the chunked output is compared
// with the one-GEMM output bit for bit. cuBLASLt may choose another algorithm
// (tile shape, split-K) for a chunk's smaller M or K, and the reduced-dimension
// chunks add their fp32 partial sums in another order, so bits may differ:
// then the JSON says so and gives the largest absolute difference; that is not
// a failure. An output element the chunks left unwritten (not finite where
// the one GEMM's is) is, and exits 1 after the report.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/step_configs.h"
#include "engine/cuda_check.h"
#include "engine/cuda_graph.h"
#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "engine/stream_capture.h"
#include "kernels/gemm.h"

namespace stepgraph {
namespace {

constexpr double kGoalRatio = 1.05;

struct Options {
  std::string config = "large";
  int tp = 2;
  std::vector<int> chunks = {2, 4, 8};
  std::vector<std::string> gemms = {"fc1_fwd", "fc2_fwd", "fc2_dgrad", "fc1_dgrad", "fc2_wgrad", "fc1_wgrad"};
  int repeats = 50;
  int warmup = 10;
  std::string out;
};

using bench::DeviceBuffer;
using bench::Summary;

// What the chunks split: the output's token rows (M), or the tokens summed
// over (K, the weight gradients).
enum class Split { kRows, kReduced };

// One GEMM of the layer, in gemm.h's row-major terms. A is stored [m, k]
// (or [k, m] with trans_a), B [k, n] (or [n, k] with trans_b); the tokens are
// M for kRows and K for kReduced, and always the leading (row) dimension of
// A's storage, and of B's for kReduced.
struct GemmShape {
  std::string name;
  std::string role;
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
  bool trans_a = false;
  bool trans_b = false;
  DType d_type = DType::kBFloat16;
  Split split = Split::kRows;
};

// The layer's GEMMs without its epilogues: the model fuses fc1's bias and GeLU
// (GELU_AUX_BIAS), fc2's bias, and the bias gradients (DGELU_BGRAD, BGRADB)
// into them; the bias gradients sum over all tokens, so token chunks of those
// would need partial sums of their own, and they are left out here.
std::vector<GemmShape> layer_gemms(std::int64_t t, std::int64_t h, std::int64_t f) {
  const DType bf16 = DType::kBFloat16;
  const DType fp32 = DType::kFloat32;
  return {
      {"fc1_fwd", "fc1 forward: y1[T, F/tp] = x[T, H] W1[F/tp, H]^T", t, f, h, false, true, bf16, Split::kRows},
      {"fc2_fwd", "fc2 forward: y2[T, H] = act[T, F/tp] W2[H, F/tp]^T", t, h, f, false, true, bf16, Split::kRows},
      {"fc2_dgrad", "fc2 dgrad: dact[T, F/tp] = dy[T, H] W2[H, F/tp]", t, f, h, false, false, bf16, Split::kRows},
      {"fc1_dgrad", "fc1 dgrad: dx[T, H] = dpre[T, F/tp] W1[F/tp, H]", t, h, f, false, false, bf16, Split::kRows},
      {"fc2_wgrad", "fc2 wgrad: dW2[H, F/tp] = dy[T, H]^T act[T, F/tp] (fp32)", h, f, t, true, false, fp32,
       Split::kReduced},
      {"fc1_wgrad", "fc1 wgrad: dW1[F/tp, H] = dpre[T, F/tp]^T x[T, H] (fp32)", f, h, t, true, false, fp32,
       Split::kReduced},
  };
}

std::string known_gemms() { return "fc1_fwd, fc2_fwd, fc2_dgrad, fc1_dgrad, fc2_wgrad, fc1_wgrad"; }

std::int64_t tokens_of(const GemmShape& shape) { return shape.split == Split::kRows ? shape.m : shape.k; }

kernels::GemmDesc whole_desc(const GemmShape& shape) {
  return {.m = shape.m,
          .n = shape.n,
          .k = shape.k,
          .trans_a = shape.trans_a,
          .trans_b = shape.trans_b,
          .d_type = shape.d_type};
}

// Chunk `index` of `chunks`: its desc and its operands at element offsets
// into the whole GEMM's buffers.
struct Chunk {
  kernels::GemmDesc desc;
  std::int64_t a_offset = 0;  // elements of A
  std::int64_t b_offset = 0;  // elements of B
  std::int64_t d_offset = 0;  // elements of D
};

Chunk chunk_of(const GemmShape& shape, int chunks, int index) {
  Chunk chunk;
  chunk.desc = whole_desc(shape);
  const std::int64_t rows = tokens_of(shape) / chunks;
  const std::int64_t first = rows * index;
  if (shape.split == Split::kRows) {
    // A [m, k] row-major: rows [first, first + rows) start at first * k; D likewise
    // at first * n. B (the weight) is whole.
    chunk.desc.m = rows;
    chunk.a_offset = first * shape.k;
    chunk.d_offset = first * shape.n;
  } else {
    // A stored [k, m] and B stored [k, n]: token rows of both; D whole, summed into.
    chunk.desc.k = rows;
    chunk.a_offset = first * shape.m;
    chunk.b_offset = first * shape.n;
    chunk.desc.beta = index == 0 ? 0.0f : 1.0f;
  }
  return chunk;
}

std::int64_t a_elements(const GemmShape& s) { return s.m * s.k; }
std::int64_t b_elements(const GemmShape& s) { return s.k * s.n; }
std::int64_t d_elements(const GemmShape& s) { return s.m * s.n; }

double tflops(const GemmShape& shape, double microseconds) {
  const double flops = 2.0 * static_cast<double>(shape.m) * static_cast<double>(shape.n) * static_cast<double>(shape.k);
  return flops / (microseconds * 1e-6) / 1e12;
}

// Every flag checked before the device is touched, each error naming the flag.
std::vector<GemmShape> check_options(const Options& options, const bench::StepConfig& config) {
  SG_CHECK(options.repeats > 0, "--repeats must be positive, got ", options.repeats);
  SG_CHECK(options.warmup >= 0, "--warmup must not be negative, got ", options.warmup);
  SG_CHECK(config.model.experts == 0, "--config ", config.name,
           " is a mixture-of-experts config; its MLPs are grouped GEMMs (grouped_gemm_bench); use small, medium, "
           "large or tiny");
  SG_CHECK(options.tp > 0, "--tp must be positive, got ", options.tp);
  const std::int64_t t = config.tokens;
  const std::int64_t h = config.model.hidden;
  const std::int64_t ffn = config.model.ffn;
  SG_CHECK(ffn % options.tp == 0, "--tp ", options.tp, " must divide config ", config.name, "'s ffn ", ffn);
  SG_CHECK(t % options.tp == 0, "--tp ", options.tp, " must divide config ", config.name, "'s tokens ", t,
           " (each rank holds tokens / tp outside the MLP)");
  SG_CHECK(!options.chunks.empty(), "--chunks: give at least one chunk count, e.g. 2,4,8");
  for (std::size_t i = 0; i < options.chunks.size(); ++i) {
    const int k = options.chunks[i];
    SG_CHECK(k >= 2, "--chunks: each count must be >= 2 (the one GEMM is always measured), got ", k);
    SG_CHECK(t % k == 0, "--chunks: ", k, " does not divide config ", config.name, "'s ", t, " tokens");
    SG_CHECK(std::count(options.chunks.begin(), options.chunks.end(), k) == 1, "--chunks: ", k, " is listed twice");
  }
  SG_CHECK(!options.gemms.empty(), "--gemms: name at least one of ", known_gemms());
  const std::vector<GemmShape> all = layer_gemms(t, h, ffn / options.tp);
  std::vector<GemmShape> chosen;
  for (const std::string& name : options.gemms) {
    const auto found = std::find_if(all.begin(), all.end(), [&](const GemmShape& s) { return s.name == name; });
    SG_CHECK(found != all.end(), "--gemms: unknown GEMM '", name, "'; known: ", known_gemms());
    SG_CHECK(std::count(options.gemms.begin(), options.gemms.end(), name) == 1, "--gemms: '", name,
             "' is listed twice");
    chosen.push_back(*found);
  }
  // Chunk operands are offsets into allocations: launch_gemm needs them 16-byte aligned.
  for (const GemmShape& shape : chosen) {
    for (const int k : options.chunks) {
      const Chunk second = chunk_of(shape, k, 1);
      const std::size_t d_size = dtype_size(shape.d_type);
      SG_CHECK(second.a_offset * 2 % 16 == 0 && second.b_offset * 2 % 16 == 0 &&
                   second.d_offset * static_cast<std::int64_t>(d_size) % 16 == 0,
               "--chunks ", k, ": ", shape.name, "'s chunks of ", tokens_of(shape) / k,
               " tokens start at offsets that are not 16-byte aligned; choose a count leaving a multiple of 8 tokens");
    }
  }
  return chosen;
}

// One variant: the whole GEMM (chunks = 1) or k chunks, captured into a graph.
struct Variant {
  int chunks = 1;
  std::unique_ptr<GraphExec> exec;
  std::size_t graph_nodes = 0;
  std::string problem;  // the desc of its first launch
};

struct Buffers {
  DeviceBuffer a;
  DeviceBuffer b;
  DeviceBuffer d_one;
  DeviceBuffer d_chunked;
  DeviceBuffer workspace;
};

void enqueue(const GemmShape& shape, int chunks, const Buffers& buffers, void* d, cudaStream_t stream) {
  const auto* a = static_cast<const std::uint16_t*>(buffers.a.get());
  const auto* b = static_cast<const std::uint16_t*>(buffers.b.get());
  auto* d_bytes = static_cast<unsigned char*>(d);
  const std::size_t d_size = dtype_size(shape.d_type);
  for (int i = 0; i < chunks; ++i) {
    const Chunk chunk = chunk_of(shape, chunks, i);
    const kernels::GemmOperands operands{.a = a + chunk.a_offset,
                                         .b = b + chunk.b_offset,
                                         .d = d_bytes + chunk.d_offset * static_cast<std::int64_t>(d_size),
                                         .workspace = buffers.workspace.get()};
    kernels::launch_gemm(chunk.desc, operands, stream);
  }
}

Variant build_variant(const GemmShape& shape, int chunks, const Buffers& buffers, void* d, Stream& stream) {
  for (int i = 0; i < chunks; ++i) kernels::gemm_prepare(chunk_of(shape, chunks, i).desc);
  // One eager run first: it caches (and times) the algorithm of every chunk's
  // alignment outside the capture, and fails here, not under capture.
  enqueue(shape, chunks, buffers, d, stream.get());
  stream.synchronize();
  Variant variant;
  variant.chunks = chunks;
  variant.problem = chunk_of(shape, chunks, 0).desc.to_string();
  StreamCapture capture(stream.get());
  enqueue(shape, chunks, buffers, d, stream.get());
  const Graph graph = capture.end();
  variant.graph_nodes = graph.node_count();
  variant.exec = std::make_unique<GraphExec>(graph);
  variant.exec->upload(stream.get());
  return variant;
}

// Replays every variant's graph `repeats` times, interleaved: each round runs
// each variant once, starting at a rotating position, so drift over the run
// falls on all variants alike (gemm_bench's time_interleaved).
std::vector<Summary> time_interleaved(const Options& options, cudaStream_t stream,
                                      const std::vector<Variant>& variants) {
  for (const Variant& v : variants) {
    for (int i = 0; i < options.warmup; ++i) v.exec->launch(stream);
  }
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  Event start(Event::Timing::kEnabled);
  Event stop(Event::Timing::kEnabled);
  std::vector<std::vector<double>> samples(variants.size());
  for (int round = 0; round < options.repeats; ++round) {
    for (std::size_t j = 0; j < variants.size(); ++j) {
      const std::size_t v = (j + static_cast<std::size_t>(round)) % variants.size();
      start.record(stream);
      variants[v].exec->launch(stream);
      stop.record(stream);
      stop.synchronize();
      samples[v].push_back(1000.0 * Event::elapsed_ms(start, stop));
    }
  }
  std::vector<Summary> out;
  for (auto& s : samples) out.push_back(bench::summarize(std::move(s)));
  return out;
}

// Runs `exec` once on `d` first filled with 0xFF bytes (NaN in bf16 and fp32,
// so an element left unwritten shows) and returns D's bytes.
std::vector<unsigned char> replay_once(const GraphExec& exec, void* d, std::size_t bytes, cudaStream_t stream) {
  SG_CUDA_CHECK(cudaMemsetAsync(d, 0xFF, bytes, stream));
  exec.launch(stream);
  std::vector<unsigned char> host(bytes);
  SG_CUDA_CHECK(cudaMemcpyAsync(host.data(), d, bytes, cudaMemcpyDeviceToHost, stream));
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

float element(DType dtype, const std::vector<unsigned char>& bytes, std::int64_t i) {
  if (dtype == DType::kFloat32) {
    float value = 0.0f;
    std::memcpy(&value, bytes.data() + i * 4, 4);
    return value;
  }
  std::uint16_t bits = 0;
  std::memcpy(&bits, bytes.data() + i * 2, 2);
  return bf16_to_float(bits);
}

struct Comparison {
  bool identical = true;
  std::int64_t differing = 0;
  std::int64_t unwritten = 0;  // not finite in the chunked output, finite in the one GEMM's
  double max_abs_diff = 0.0;
};

double max_abs_finite(DType dtype, const std::vector<unsigned char>& bytes) {
  double out = 0.0;
  const std::int64_t count = static_cast<std::int64_t>(bytes.size() / dtype_size(dtype));
  for (std::int64_t i = 0; i < count; ++i) {
    const float value = element(dtype, bytes, i);
    if (std::isfinite(value)) out = std::max(out, std::fabs(double{value}));
  }
  return out;
}

Comparison compare(DType dtype, const std::vector<unsigned char>& reference,
                   const std::vector<unsigned char>& chunked) {
  Comparison c;
  c.identical = reference == chunked;
  if (c.identical) return c;
  const std::size_t size = dtype_size(dtype);
  const std::int64_t count = static_cast<std::int64_t>(reference.size() / size);
  for (std::int64_t i = 0; i < count; ++i) {
    if (std::memcmp(reference.data() + i * size, chunked.data() + i * size, size) == 0) continue;
    ++c.differing;
    const float want = element(dtype, reference, i);
    const float got = element(dtype, chunked, i);
    if (std::isfinite(want) && !std::isfinite(got)) {
      ++c.unwritten;
    } else if (std::isfinite(want) && std::isfinite(got)) {
      c.max_abs_diff = std::max(c.max_abs_diff, std::fabs(double{got} - double{want}));
    }
  }
  return c;
}

nlohmann::json timing_json(const GemmShape& shape, const Summary& s, const Variant& v) {
  return {{"median_us", s.median_us},     {"min_us", s.min_us},
          {"max_us", s.max_us},           {"tflops_at_median", tflops(shape, s.median_us)},
          {"graph_nodes", v.graph_nodes}, {"problem", v.problem}};
}

std::string fixed(double value, int precision) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(precision) << value;
  return out.str();
}

struct RowResult {
  nlohmann::json json;
  bool unwritten = false;
  int rows = 0;
  int meeting_goal = 0;
  double worst_ratio = 0.0;
};

RowResult run_gemm(const Options& options, const GemmShape& shape, std::mt19937& rng, Stream& stream) {
  const std::size_t d_bytes = static_cast<std::size_t>(d_elements(shape)) * dtype_size(shape.d_type);
  Buffers buffers{DeviceBuffer(static_cast<std::size_t>(a_elements(shape)) * 2),
                  DeviceBuffer(static_cast<std::size_t>(b_elements(shape)) * 2), DeviceBuffer(d_bytes),
                  DeviceBuffer(d_bytes), DeviceBuffer(kernels::gemm_workspace_bytes())};
  bench::fill_random_bf16(buffers.a, a_elements(shape), rng);
  bench::fill_random_bf16(buffers.b, b_elements(shape), rng);

  std::vector<Variant> variants;
  variants.push_back(build_variant(shape, 1, buffers, buffers.d_one.get(), stream));
  for (const int k : options.chunks) {
    variants.push_back(build_variant(shape, k, buffers, buffers.d_chunked.get(), stream));
  }

  const std::vector<unsigned char> reference =
      replay_once(*variants[0].exec, buffers.d_one.get(), d_bytes, stream.get());
  const double max_abs_reference = max_abs_finite(shape.d_type, reference);
  std::vector<Comparison> checks;
  for (std::size_t v = 1; v < variants.size(); ++v) {
    checks.push_back(compare(shape.d_type, reference,
                             replay_once(*variants[v].exec, buffers.d_chunked.get(), d_bytes, stream.get())));
  }
  const std::vector<Summary> timed = time_interleaved(options, stream.get(), variants);

  RowResult result;
  const Summary& one = timed[0];
  std::cout << "\n"
            << shape.name << ": " << shape.role << "\n  " << variants[0].problem << "\n  " << std::left << std::setw(10)
            << "variant" << std::right << std::setw(11) << "median us" << std::setw(10) << "min us" << std::setw(10)
            << "max us" << std::setw(9) << "TFLOP/s" << std::setw(7) << "nodes" << std::setw(8) << "ratio"
            << "  goal <= " << fixed(kGoalRatio, 2) << "x  output\n";
  const auto print_row = [&](const std::string& name, const Summary& s, const Variant& v) {
    std::cout << "  " << std::left << std::setw(10) << name << std::right << std::setw(11) << fixed(s.median_us, 1)
              << std::setw(10) << fixed(s.min_us, 1) << std::setw(10) << fixed(s.max_us, 1) << std::setw(9)
              << fixed(tflops(shape, s.median_us), 0) << std::setw(7) << v.graph_nodes;
  };
  print_row("one", one, variants[0]);
  std::cout << std::setw(8) << "1.000"
            << "\n";

  nlohmann::json chunked = nlohmann::json::array();
  for (std::size_t v = 1; v < variants.size(); ++v) {
    const Summary& s = timed[v];
    const Comparison& c = checks[v - 1];
    const double ratio = s.median_us / one.median_us;
    const bool meets = ratio <= kGoalRatio;
    ++result.rows;
    result.meeting_goal += meets ? 1 : 0;
    result.worst_ratio = std::max(result.worst_ratio, ratio);
    result.unwritten = result.unwritten || c.unwritten > 0;
    nlohmann::json check = {{"bits_identical", c.identical},          {"differing_elements", c.differing},
                            {"elements", d_elements(shape)},          {"max_abs_diff", c.max_abs_diff},
                            {"max_abs_reference", max_abs_reference}, {"unwritten_elements", c.unwritten}};
    std::string verdict = "bits identical";
    if (c.unwritten > 0) {
      check["status"] = "failed";
      check["note"] = "chunked output has elements not written (NaN fill left) where the one GEMM wrote finite values";
      verdict = "FAILED: " + std::to_string(c.unwritten) + " elements unwritten";
    } else if (!c.identical) {
      check["status"] = "differs";
      check["note"] =
          shape.split == Split::kRows
              ? "bits differ, most likely because cuBLASLt runs the chunk's smaller M with another algorithm "
                "(tile shape or K split) than the one GEMM's"
              : "bits differ: the chunks add their fp32 partial sums in another order (and cuBLASLt may run "
                "the chunk's smaller K with another algorithm)";
      std::ostringstream text;
      text << "differs: " << c.differing << " elements, max |diff| " << std::setprecision(3) << c.max_abs_diff
           << " (max |ref| " << max_abs_reference << ")";
      verdict = text.str();
    } else {
      check["status"] = "identical";
    }
    nlohmann::json row = timing_json(shape, s, variants[v]);
    row["chunks"] = variants[v].chunks;
    row["tokens_per_chunk"] = tokens_of(shape) / variants[v].chunks;
    row["ratio"] = ratio;
    row["ratio_of_mins"] = s.min_us / one.min_us;
    row["meets_goal"] = meets;
    row["check"] = check;
    chunked.push_back(row);
    print_row("k=" + std::to_string(variants[v].chunks), s, variants[v]);
    std::cout << std::setw(8) << fixed(ratio, 3) << "  " << std::left << std::setw(12) << (meets ? "met" : "NOT met")
              << std::right << verdict << "\n";
  }

  result.json = {
      {"name", shape.name},
      {"role", shape.role},
      {"m", shape.m},
      {"n", shape.n},
      {"k", shape.k},
      {"trans_a", shape.trans_a},
      {"trans_b", shape.trans_b},
      {"out_dtype", dtype_name(shape.d_type)},
      {"chunked_dim", shape.split == Split::kRows
                          ? "m: token rows of A and D, each chunk writes its row block of D"
                          : "k: token rows of A and B, each chunk adds into all of D (beta 0 first, then 1)"},
      {"one_gemm", timing_json(shape, one, variants[0])},
      {"chunked", chunked}};
  return result;
}

int run(const Options& options) {
  bench::StepConfig config;
  try {
    config = bench::step_config(options.config);
  } catch (const Error& error) {
    SG_THROW(ErrorCode::kInvalidArgument, "--config: ", error.message());
  }
  const std::vector<GemmShape> shapes = check_options(options, config);
  const DeviceProperties device = device_properties(0);
  std::cerr << "device: " << describe(device) << "\n";
  const std::int64_t ffn_per_rank = config.model.ffn / options.tp;
  std::cout << "gemm_chunk_bench: config " << config.name << " (T " << config.tokens << " tokens, H "
            << config.model.hidden << ", F " << config.model.ffn << "), tp " << options.tp << " (F/tp " << ffn_per_rank
            << "), bf16 in, fp32 accumulate, " << options.repeats << " repeats after " << options.warmup
            << " warm-up; ratio = chunked median / one-GEMM median, goal <= " << fixed(kGoalRatio, 2) << "x\n";

  std::mt19937 rng(std::random_device{}());
  Stream stream;
  nlohmann::json gemms = nlohmann::json::array();
  bool unwritten = false;
  int rows = 0;
  int meeting = 0;
  double worst = 0.0;
  for (const GemmShape& shape : shapes) {
    const RowResult r = run_gemm(options, shape, rng, stream);
    gemms.push_back(r.json);
    unwritten = unwritten || r.unwritten;
    rows += r.rows;
    meeting += r.meeting_goal;
    worst = std::max(worst, r.worst_ratio);
  }

  const nlohmann::json result = {
      {"benchmark", "gemm_chunk"},
      {"device", device.name},
      {"config", config.name},
      {"tokens", config.tokens},
      {"hidden", config.model.hidden},
      {"ffn", config.model.ffn},
      {"tp", options.tp},
      {"ffn_per_rank", ffn_per_rank},
      {"chunks", options.chunks},
      {"repeats", options.repeats},
      {"warmup", options.warmup},
      {"dtype", {{"inputs", "bf16"}, {"accumulate", "fp32"}, {"output", "bf16; weight gradients fp32"}}},
      {"epilogues", "none (the model fuses bias, GeLU and bias gradients; see gemm_chunk_bench.cc)"},
      {"timing",
       "each variant one CUDA graph (the one GEMM, or its k chunk launches in order on one stream), replayed; device "
       "events around each replay; variants of a GEMM interleaved round by round; median, min, max over repeats"},
      {"check",
       "one replay of each graph on NaN-filled outputs, chunked output against the one GEMM's bit for bit; a "
       "difference (another cuBLASLt algorithm, or another fp32 summation order) is reported, not a failure; "
       "unwritten elements are"},
      {"goal", {{"ratio", "chunked median_us / one-GEMM median_us"}, {"max", kGoalRatio}}},
      {"gemms", gemms},
      {"summary",
       {{"rows", rows},
        {"rows_meeting_goal", meeting},
        {"all_meet_goal", meeting == rows},
        {"worst_ratio", worst},
        {"status", unwritten ? "failed" : "ok"}}},
  };
  std::cout << "\n"
            << meeting << " of " << rows << " chunked rows meet the goal (ratio <= " << fixed(kGoalRatio, 2)
            << "x); worst ratio " << fixed(worst, 3) << "\n";
  bench::write_json(options.out, result);
  if (unwritten) {
    std::cerr << "gemm_chunk_bench: a chunked output left elements unwritten (see the rows marked FAILED)\n";
    return EXIT_FAILURE;
  }
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"GEMM chunking: a tensor-parallel MLP's GEMMs split into k token chunks against one GEMM"};
  stepgraph::Options options;
  app.add_option("--config", options.config, "step config whose shapes to use (small, medium, large, tiny)")
      ->capture_default_str();
  app.add_option("--tp", options.tp, "tensor-parallel ranks: each rank's ffn slice is ffn / tp")->capture_default_str();
  app.add_option("--chunks", options.chunks, "chunk counts, each >= 2 and dividing the tokens")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--gemms", options.gemms,
                 "GEMMs to measure: fc1_fwd, fc2_fwd, fc2_dgrad, fc1_dgrad, fc2_wgrad, "
                 "fc1_wgrad")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed replays per variant")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed replays per variant first")->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("gemm_chunk_bench", [&] { return stepgraph::run(options); });
}
