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
//
//   gemm_bench --dtype fp8 --scaling tensor|block [--fast-accumulation]
//
// times our FP8 GEMM (Note [FP8 GEMMs] in kernels/gemm.h: E4M3 A and B, bf16
// D; tensor-wise scales, or 1 x 128 A and 128 x 128 B block scales) against
// our bf16 GEMM of the same shape, interleaved in the same run, and reports
// the FP8 speedup.
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
#include "engine/fp8.h"
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
  std::string dtype = "bf16";      // bf16 | fp8
  std::string scaling = "tensor";  // fp8: tensor | block
  bool fast_accumulation = false;  // fp8, tensor scaling only
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

// FP8 (E4M3) bytes of values in about [-4, 4), uploaded to `buffer`.
void fill_random_fp8(const DeviceBuffer& buffer, std::int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<std::uint8_t> host(static_cast<std::size_t>(count));
  for (std::uint8_t& q : host) q = float_to_fp8(Fp8Format::kE4M3, uniform(rng));
  SG_CUDA_CHECK(cudaMemcpy(buffer.get(), host.data(), host.size(), cudaMemcpyHostToDevice));
}

// A scale_inv buffer of `count` ones.
void fill_ones(const DeviceBuffer& buffer, std::int64_t count) {
  const std::vector<float> ones(static_cast<std::size_t>(count), 1.0f);
  SG_CUDA_CHECK(cudaMemcpy(buffer.get(), ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
}

// Our FP8 GEMM against our bf16 GEMM of the same shape, in one interleaved run.
int run_fp8(const Options& options, const DeviceProperties& device) {
  SG_CHECK(options.scaling == "tensor" || options.scaling == "block", "gemm_bench: --scaling must be tensor or block, "
           "got ", options.scaling);
  const bool blocks = options.scaling == "block";
  SG_CHECK(!(blocks && options.fast_accumulation), "gemm_bench: block scaling has no fast accumulation");
  kernels::GemmDesc bf16;
  bf16.m = options.m;
  bf16.n = options.n;
  bf16.k = options.k;
  bf16.trans_b = true;
  kernels::GemmDesc fp8 = bf16;
  fp8.a_type = fp8.b_type = DType::kFloat8E4M3;
  fp8.fast_accumulation = options.fast_accumulation;
  if (blocks) {
    fp8.a_blocks = kernels::BlockShape::k1x128;
    fp8.b_blocks = kernels::BlockShape::k128x128;
  }
  kernels::check_gemm(fp8);  // a clear error for shapes FP8 cannot take, before allocating
  const std::int64_t a_scales = blocks ? kernels::BlockScaleLayout{*fp8.a_blocks, options.m, options.k}.count() : 1;
  const std::int64_t b_scales = blocks ? kernels::BlockScaleLayout{*fp8.b_blocks, options.n, options.k}.count() : 1;
  const std::size_t workspace_bytes = kernels::gemm_workspace_bytes();
  DeviceBuffer a16(options.m * options.k * sizeof(std::uint16_t)), b16(options.n * options.k * sizeof(std::uint16_t));
  DeviceBuffer a8(options.m * options.k), b8(options.n * options.k);
  DeviceBuffer a_scale_inv(a_scales * sizeof(float)), b_scale_inv(b_scales * sizeof(float));
  DeviceBuffer d(options.m * options.n * sizeof(std::uint16_t)), workspace(workspace_bytes);
  std::mt19937 rng(std::random_device{}());
  fill_random_bf16(a16, options.m * options.k, rng);
  fill_random_bf16(b16, options.n * options.k, rng);
  fill_random_fp8(a8, options.m * options.k, rng);
  fill_random_fp8(b8, options.n * options.k, rng);
  fill_ones(a_scale_inv, a_scales);
  fill_ones(b_scale_inv, b_scales);
  Stream stream;
  kernels::gemm_prepare(bf16);
  kernels::gemm_prepare(fp8);
  const kernels::GemmOperands bf16_operands{.a = a16.get(), .b = b16.get(), .d = d.get(), .workspace = workspace.get()};
  const kernels::GemmOperands fp8_operands{.a = a8.get(),
                                           .b = b8.get(),
                                           .d = d.get(),
                                           .workspace = workspace.get(),
                                           .a_scale_inv = static_cast<const float*>(a_scale_inv.get()),
                                           .b_scale_inv = static_cast<const float*>(b_scale_inv.get())};
  const std::vector<Summary> timed = time_interleaved(
      options, stream.get(),
      {[&] { kernels::launch_gemm(bf16, bf16_operands, stream.get()); },
       [&] { kernels::launch_gemm(fp8, fp8_operands, stream.get()); }});
  const double speedup = timed[0].median_us / timed[1].median_us;
  const nlohmann::json result = {{"benchmark", "gemm_fp8"},
                                 {"device", device.name},
                                 {"problem", fp8.to_string()},
                                 {"m", options.m},
                                 {"n", options.n},
                                 {"k", options.k},
                                 {"scaling", options.scaling},
                                 {"fast_accumulation", options.fast_accumulation},
                                 {"repeats", options.repeats},
                                 {"warmup", options.warmup},
                                 {"bf16", to_json(options, timed[0])},
                                 {"fp8", to_json(options, timed[1])},
                                 {"fp8_speedup", speedup}};
  std::cout << "gemm_bench: " << fp8.to_string() << " against bf16, " << options.repeats << " repeats\n"
            << "  " << std::left << std::setw(22) << "variant" << std::right << std::setw(10) << "median us"
            << std::setw(10) << "min us" << std::setw(10) << "max us" << std::setw(10) << "TFLOP/s"
            << "\n"
            << format_row("ours bf16", options, timed[0]) << format_row("ours fp8 (" + options.scaling + ")", options, timed[1])
            << "  fp8 / bf16 speedup " << std::setprecision(3) << speedup << "\n";
  bench::write_json(options.out, result);
  return EXIT_SUCCESS;
}

int run(const Options& options) {
  SG_CHECK(options.m > 0 && options.n > 0 && options.k > 0 && options.repeats > 0 && options.warmup >= 0 &&
               options.candidates > 0,
           "gemm_bench: --m, --n, --k, --repeats and --candidates must be positive, --warmup not negative");
  SG_CHECK(options.dtype == "bf16" || options.dtype == "fp8", "gemm_bench: --dtype must be bf16 or fp8, got ",
           options.dtype);
  const DeviceProperties device = device_properties(0);
  std::cerr << "device: " << describe(device) << "\n";
  if (options.dtype == "fp8") return run_fp8(options, device);

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
  app.add_option("--dtype", options.dtype, "bf16 (against cuBLASLt's best) or fp8 (against our bf16)")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--scaling", options.scaling, "fp8: tensor (one scale each) or block (1x128 A, 128x128 B)")
      ->check(CLI::IsMember({"tensor", "block"}))
      ->capture_default_str();
  app.add_flag("--fast-accumulation", options.fast_accumulation, "fp8 with tensor scaling: cuBLASLt's fast accumulation");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("gemm_bench", [&] { return stepgraph::run(options); });
}
