// GEMM throughput: launch_gemm (its cached algorithm) against the best that
// cuBLASLt offers for the same problem, found by timing cuBLASLt directly
// (its own handle, descriptors and layouts) with each of its top heuristic
// algorithms.
//
//   gemm_bench --m 8192 --n 8192 --k 8192 --repeats 50 --out gemm.json
//
// bf16 A[m, k] times B[n, k]^T into bf16 D[m, n] (a linear layer's forward),
// fp32 accumulation, inputs uniform in [-1, 1). Each variant is timed with
// device events around single launches after a warm-up, the variants
// interleaved round by round (see time_interleaved); the report gives the
// median, min and max, TFLOP/s from the median, and ours / best (goal >= 0.95).
#include <cublasLt.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "kernels/gemm.h"

namespace stepgraph {
namespace {

struct Options {
  std::int64_t m = 8192;
  std::int64_t n = 8192;
  std::int64_t k = 8192;
  int repeats = 50;
  int warmup = 10;
  int candidates = 8;
  std::string out;
};

using bench::DeviceBuffer;
using bench::fill_random_bf16;
using bench::Summary;

double tflops(const Options& options, double microseconds) {
  const double flops =
      2.0 * static_cast<double>(options.m) * static_cast<double>(options.n) * static_cast<double>(options.k);
  return flops / (microseconds * 1e-6) / 1e12;
}

nlohmann::json to_json(const Options& options, const Summary& s) {
  return {{"median_us", s.median_us},
          {"min_us", s.min_us},
          {"max_us", s.max_us},
          {"tflops_at_median", tflops(options, s.median_us)}};
}

// Times `launch` (which enqueues one GEMM on `stream`) `repeats` times.
// Times every launch `repeats` times, interleaved: each round runs each
// variant once, starting at a rotating position, so clock and temperature
// drift over the run (an H100 slows as it heats under back-to-back 8192^3
// GEMMs) falls on all variants alike instead of on whichever runs last.
std::vector<Summary> time_interleaved(const Options& options, cudaStream_t stream,
                                      const std::vector<std::function<void()>>& launches) {
  for (const auto& launch : launches) {
    for (int i = 0; i < options.warmup; ++i) launch();
  }
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  Event start(Event::Timing::kEnabled);
  Event stop(Event::Timing::kEnabled);
  std::vector<std::vector<double>> samples(launches.size());
  for (int round = 0; round < options.repeats; ++round) {
    for (std::size_t j = 0; j < launches.size(); ++j) {
      const std::size_t v = (j + static_cast<std::size_t>(round)) % launches.size();
      start.record(stream);
      launches[v]();
      stop.record(stream);
      stop.synchronize();
      samples[v].push_back(1000.0 * Event::elapsed_ms(start, stop));
    }
  }
  std::vector<Summary> out;
  for (auto& variant : samples) out.push_back(bench::summarize(std::move(variant)));
  return out;
}

// cuBLASLt with no wrapper: D^T[n, m] = B[n, k] A[k, m] in its column-major
// terms, which is row-major D[m, n] = A[m, k] B[n, k]^T.
class DirectCublasLt {
 public:
  DirectCublasLt(const Options& options, std::size_t workspace_bytes) {
    SG_CUBLAS_CHECK(cublasLtCreate(&handle_));
    SG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T;
    const cublasOperation_t as_stored = CUBLAS_OP_N;
    SG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
    SG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &as_stored, sizeof(as_stored)));
    SG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, options.k, options.n, options.k));
    SG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, options.k, options.m, options.k));
    SG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d_, CUDA_R_16BF, options.n, options.m, options.n));
    SG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference_));
    const std::uint64_t max_workspace = workspace_bytes;
    SG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &max_workspace, sizeof(max_workspace)));
  }
  ~DirectCublasLt() {
    cublasLtMatmulPreferenceDestroy(preference_);
    cublasLtMatrixLayoutDestroy(d_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatmulDescDestroy(op_);
    cublasLtDestroy(handle_);
  }
  DirectCublasLt(const DirectCublasLt&) = delete;
  DirectCublasLt& operator=(const DirectCublasLt&) = delete;

  // The heuristic's top `count` algorithms that it says can run.
  std::vector<cublasLtMatmulAlgo_t> top_algorithms(int count) {
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(count));
    int returned = 0;
    SG_CUBLAS_CHECK(
        cublasLtMatmulAlgoGetHeuristic(handle_, op_, a_, b_, d_, d_, preference_, count, results.data(), &returned));
    std::vector<cublasLtMatmulAlgo_t> algos;
    for (int i = 0; i < returned; ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS) algos.push_back(results[i].algo);
    }
    SG_CHECK_CODE(!algos.empty(), ErrorCode::kUnsupported, "gemm_bench: cuBLASLt has no algorithm for this problem");
    return algos;
  }

  void launch(const cublasLtMatmulAlgo_t& algo, const void* a, const void* b, void* d, void* workspace,
              std::size_t workspace_bytes, cudaStream_t stream) {
    const float alpha = 1.0f;
    const float beta = 0.0f;
    SG_CUBLAS_CHECK(cublasLtMatmul(handle_, op_, &alpha, b, a_, a, b_, &beta, d, d_, d, d_, &algo, workspace,
                                   workspace_bytes, stream));
  }

 private:
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr;  // our B, stored [n, k]
  cublasLtMatrixLayout_t b_ = nullptr;  // our A, stored [m, k]
  cublasLtMatrixLayout_t d_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
};

std::string format_row(const std::string& name, const Options& options, const Summary& s) {
  std::ostringstream row;
  row << "  " << std::left << std::setw(22) << name << std::right << std::fixed << std::setprecision(1) << std::setw(10)
      << s.median_us << std::setw(10) << s.min_us << std::setw(10) << s.max_us << std::setw(10)
      << tflops(options, s.median_us) << "\n";
  return row.str();
}

int run(const Options& options) {
  SG_CHECK(options.m > 0 && options.n > 0 && options.k > 0 && options.repeats > 0 && options.warmup >= 0 &&
               options.candidates > 0,
           "gemm_bench: --m, --n, --k, --repeats and --candidates must be positive, --warmup not negative");
  const DeviceProperties device = device_properties(0);
  std::cerr << "device: " << describe(device) << "\n";

  kernels::GemmDesc desc;
  desc.m = options.m;
  desc.n = options.n;
  desc.k = options.k;
  desc.trans_b = true;
  const std::size_t workspace_bytes = kernels::gemm_workspace_bytes();
  DeviceBuffer a(options.m * options.k * sizeof(std::uint16_t));
  DeviceBuffer b(options.n * options.k * sizeof(std::uint16_t));
  DeviceBuffer d(options.m * options.n * sizeof(std::uint16_t));
  DeviceBuffer workspace(workspace_bytes);
  std::mt19937 rng(std::random_device{}());
  fill_random_bf16(a, options.m * options.k, rng);
  fill_random_bf16(b, options.n * options.k, rng);
  Stream stream;

  DirectCublasLt direct(options, workspace_bytes);
  const std::vector<cublasLtMatmulAlgo_t> algos = direct.top_algorithms(options.candidates);
  kernels::gemm_prepare(desc);
  const kernels::GemmOperands operands{.a = a.get(), .b = b.get(), .d = d.get(), .workspace = workspace.get()};
  std::vector<std::function<void()>> launches;
  for (const cublasLtMatmulAlgo_t& algo : algos) {
    launches.emplace_back(
        [&, algo] { direct.launch(algo, a.get(), b.get(), d.get(), workspace.get(), workspace_bytes, stream.get()); });
  }
  launches.emplace_back([&] { kernels::launch_gemm(desc, operands, stream.get()); });
  const std::vector<Summary> timed = time_interleaved(options, stream.get(), launches);

  nlohmann::json candidates = nlohmann::json::array();
  Summary best;
  int best_index = -1;
  for (std::size_t i = 0; i < algos.size(); ++i) {
    candidates.push_back(to_json(options, timed[i]));
    if (best_index < 0 || timed[i].median_us < best.median_us) {
      best = timed[i];
      best_index = static_cast<int>(i);
    }
  }
  const Summary ours = timed.back();
  const double ratio = tflops(options, ours.median_us) / tflops(options, best.median_us);

  nlohmann::json best_json = to_json(options, best);
  best_json["heuristic_rank"] = best_index;
  const nlohmann::json result = {
      {"benchmark", "gemm"},
      {"device", device.name},
      {"problem", desc.to_string()},
      {"m", options.m},
      {"n", options.n},
      {"k", options.k},
      {"repeats", options.repeats},
      {"warmup", options.warmup},
      {"cublaslt_candidates", candidates},
      {"cublaslt_best", best_json},
      {"ours", to_json(options, ours)},
      {"ours_over_best", ratio},
  };
  std::cout << "gemm_bench: " << desc.to_string() << ", " << options.repeats << " repeats\n"
            << "  " << std::left << std::setw(22) << "variant" << std::right << std::setw(10) << "median us"
            << std::setw(10) << "min us" << std::setw(10) << "max us" << std::setw(10) << "TFLOP/s"
            << "\n";
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const nlohmann::json& c = candidates[i];
    std::cout << format_row("cuBLASLt algo #" + std::to_string(i), options,
                            {c["median_us"].get<double>(), c["min_us"].get<double>(), c["max_us"].get<double>()});
  }
  std::cout << format_row("cuBLASLt best (#" + std::to_string(best_index) + ")", options, best)
            << format_row("ours (launch_gemm)", options, ours) << "  ours / best " << std::setprecision(3) << ratio
            << (ratio >= 0.95 ? " (goal >= 0.95 met)" : " (goal >= 0.95 NOT met)") << "\n";
  bench::write_json(options.out, result);
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"GEMM: launch_gemm against the best of cuBLASLt's top heuristic algorithms"};
  stepgraph::Options options;
  app.add_option("--m", options.m, "rows of A and D")->capture_default_str();
  app.add_option("--n", options.n, "columns of D (rows of the transposed B)")->capture_default_str();
  app.add_option("--k", options.k, "the reduced dimension")->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed launches per variant")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed launches first")->capture_default_str();
  app.add_option("--candidates", options.candidates, "cuBLASLt heuristic algorithms to time")->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  try {
    return stepgraph::run(options);
  } catch (const stepgraph::Error& error) {
    std::cerr << "gemm_bench: " << error.message() << "\n";
    return EXIT_FAILURE;
  }
}
