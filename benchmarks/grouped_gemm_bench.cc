// Grouped GEMM throughput: launch_grouped_gemm on the MoE expert shapes, with
// the split in device memory as the MoE layer has it.
//
//   grouped_gemm_bench --out grouped_gemm.json                 # forward, every row
//   grouped_gemm_bench --kinds forward,dgrad,wgrad --tokens 16384 --experts 8
//   grouped_gemm_bench --dtype fp8 --kinds forward,dgrad,wgrad   # E4M3 x and w, E5M2 dy
//
// Rows: E in {8, 128} experts x T in {16384, 65536} tokens x hidden
// {2048 -> 1536, 4096 -> 14336} x routing {balanced, skewed}. The forward is
// y [T, N] = x_e [n_e, K] w_e [N, K]^T, bf16 in and out, fp32 accumulation;
// TFLOP/s = 2 T N K / median time. benchmarks/grouped_gemm_peer.py times
// torch._grouped_mm on the same rows (same routing formula, same JSON row
// keys), so one GPU job gives both and the ratio. --dtype fp8 times the FP8
// products (Note [FP8 grouped GEMM]) on the operand layouts they read, with
// tensor-wise scales; the peer has no FP8 grouped GEMM, so their ratio is
// against the bf16 rows of the same job.
//
// Routing (shared with the peer, integers only so both agree exactly):
//   balanced  n_e = T / E, the remainder one each to the first groups;
//   skewed    n_e = T * w_e / sum(w), w_e = 720720 / (e + 1) (Zipf-like: group 0
//             holds ~1/3 of the tokens at E = 8, ~1/5 at E = 128), the
//             remainder to group 0.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
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
#include "kernels/grouped_gemm.h"

namespace stepgraph {
namespace {

using bench::DeviceBuffer;
using bench::fill_random_bf16;
using kernels::GroupedGemmKind;

struct Options {
  std::vector<std::int64_t> experts = {8, 128};
  std::vector<std::int64_t> tokens = {16384, 65536};
  std::vector<std::string> shapes = {"2048x1536", "4096x14336"};  // K x N (in -> out features)
  std::vector<std::string> routings = {"balanced", "skewed"};
  std::vector<std::string> kinds = {"forward"};
  std::string dtype = "bf16";
  bool split_accumulation = false;
  std::string wgrad_out = "fp32";  // bf16 (from bf16 inputs) as torch._grouped_mm's dw
  int repeats = 20;
  int warmup = 5;
  std::string out;
};

std::vector<std::int32_t> group_sizes(const std::string& routing, std::int64_t tokens, std::int64_t experts) {
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(experts));
  if (routing == "balanced") {
    for (std::int64_t e = 0; e < experts; ++e) sizes[e] = tokens / experts + (e < tokens % experts ? 1 : 0);
  } else {
    SG_CHECK(routing == "skewed", "grouped_gemm_bench: routing must be balanced or skewed, got ", routing);
    std::int64_t total_weight = 0;
    for (std::int64_t e = 0; e < experts; ++e) total_weight += 720720 / (e + 1);
    std::int64_t assigned = 0;
    for (std::int64_t e = 0; e < experts; ++e) {
      sizes[e] = tokens * (720720 / (e + 1)) / total_weight;
      assigned += sizes[e];
    }
    sizes[0] += tokens - assigned;
  }
  return {sizes.begin(), sizes.end()};
}

GroupedGemmKind parse_kind(const std::string& name) {
  if (name == "forward") return GroupedGemmKind::kForward;
  if (name == "dgrad") return GroupedGemmKind::kDgrad;
  SG_CHECK(name == "wgrad", "grouped_gemm_bench: kinds are forward, dgrad, wgrad; got ", name);
  return GroupedGemmKind::kWgrad;
}

nlohmann::json run_row(const Options& options, const std::string& kind_name, std::int64_t experts, std::int64_t tokens,
                       std::int64_t k, std::int64_t n, const std::string& routing, std::mt19937& rng, Stream& stream) {
  const GroupedGemmKind kind = parse_kind(kind_name);
  const std::vector<std::int32_t> sizes = group_sizes(routing, tokens, experts);
  std::vector<std::int32_t> offsets{0};
  for (std::int32_t s : sizes) offsets.push_back(offsets.back() + s);

  kernels::GroupedGemmDesc desc;
  desc.kind = kind;
  desc.tokens = tokens;
  desc.experts = experts;
  desc.n = n;
  desc.k = k;
  const bool fp8 = options.dtype == "fp8";
  desc.in_type = fp8 ? DType::kFloat8E4M3 : DType::kBFloat16;
  desc.dy_type = DType::kFloat8E5M2;
  desc.split_accumulation = fp8 && options.split_accumulation;
  desc.out_type = kind != GroupedGemmKind::kWgrad ? DType::kBFloat16
                  : options.wgrad_out == "bf16"   ? DType::kBFloat16
                                                  : DType::kFloat32;

  const bool uses_x = kind != GroupedGemmKind::kDgrad;
  const bool uses_w = kind != GroupedGemmKind::kWgrad;
  const bool uses_dy = kind != GroupedGemmKind::kForward;
  const std::int64_t element = fp8 ? 1 : 2;
  DeviceBuffer x(uses_x ? tokens * k * element : 0);
  DeviceBuffer w(uses_w ? experts * n * k * element : 0);
  DeviceBuffer dy(uses_dy ? tokens * n * element : 0);
  const std::int64_t out_elements = kind == GroupedGemmKind::kForward ? tokens * n
                                    : kind == GroupedGemmKind::kDgrad ? tokens * k
                                                                      : experts * n * k;
  DeviceBuffer out(out_elements * static_cast<std::int64_t>(dtype_size(desc.out_type)));
  DeviceBuffer offs(offsets.size() * sizeof(std::int32_t));
  // FP8: codes of uniform values in [-1, 1) (the transposed layouts hold as
  // many bytes, so one fill serves every kind).
  auto fill = [&](DeviceBuffer& buffer, std::int64_t count, Fp8Format format) {
    if (fp8) return bench::fill_random_fp8(buffer, count, format, rng);
    fill_random_bf16(buffer, count, rng);
  };
  if (uses_x) fill(x, tokens * k, Fp8Format::kE4M3);
  if (uses_w) fill(w, experts * n * k, Fp8Format::kE4M3);
  if (uses_dy) fill(dy, tokens * n, Fp8Format::kE5M2);
  const std::vector<float> ones = {1.0f, 1.0f, 1.0f};
  DeviceBuffer scales(sizeof(float) * ones.size());
  SG_CUDA_CHECK(cudaMemcpy(scales.get(), ones.data(), sizeof(float) * ones.size(), cudaMemcpyHostToDevice));
  const float* scale = static_cast<const float*>(scales.get());
  SG_CUDA_CHECK(cudaMemcpy(offs.get(), offsets.data(), offsets.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  const kernels::GroupedGemmOperands operands{.x = x.get(),
                                              .w = w.get(),
                                              .dy = dy.get(),
                                              .offsets = static_cast<const std::int32_t*>(offs.get()),
                                              .out = out.get(),
                                              .x_scale_inv = scale,
                                              .w_scale_inv = scale + 1,
                                              .dy_scale_inv = scale + 2};
  const bench::Summary s = bench::time_launches(stream.get(), options.warmup, options.repeats,
                                                [&] { kernels::launch_grouped_gemm(desc, operands, stream.get()); });
  const double flops = 2.0 * static_cast<double>(tokens) * static_cast<double>(n) * static_cast<double>(k);
  std::ostringstream name;
  name << kind_name << (fp8 ? (options.split_accumulation ? " fp8 split" : " fp8") : "") << " E=" << experts << " T=" << tokens << " " << k << "->" << n << " " << routing;
  nlohmann::json row = bench::to_json(s);
  row["name"] = name.str();
  row["impl"] = "stepgraph";
  row["kind"] = kind_name;
  row["dtype"] = options.dtype;
  row["split_accumulation"] = desc.split_accumulation;
  row["out_dtype"] = desc.out_type == DType::kFloat32 ? "fp32" : "bf16";
  row["experts"] = experts;
  row["tokens"] = tokens;
  row["in_features"] = k;
  row["out_features"] = n;
  row["routing"] = routing;
  row["largest_group"] = *std::max_element(sizes.begin(), sizes.end());
  row["tflops"] = flops / (s.median_us * 1e-6) / 1e12;
  return row;
}

int run(const Options& options) {
  SG_CHECK(options.repeats > 0 && options.warmup >= 0, "grouped_gemm_bench: --repeats > 0, --warmup >= 0");
  SG_CHECK(options.dtype == "bf16" || options.dtype == "fp8", "grouped_gemm_bench: --dtype is bf16 or fp8, got ",
           options.dtype);
  const DeviceProperties device = device_properties(0);
  std::cerr << "device: " << describe(device) << "\n";
  std::mt19937 rng(std::random_device{}());
  Stream stream;
  nlohmann::json rows = nlohmann::json::array();
  const bench::RowTable table{52, {{"median_us", "median us"}, {"tflops", "TFLOP/s"}}};
  table.print_header();
  for (const std::string& kind : options.kinds) {
    for (const std::string& shape : options.shapes) {
      const auto cross = shape.find('x');
      SG_CHECK(cross != std::string::npos, "grouped_gemm_bench: shapes are KxN, got ", shape);
      const std::int64_t k = std::stoll(shape.substr(0, cross));
      const std::int64_t n = std::stoll(shape.substr(cross + 1));
      for (std::int64_t experts : options.experts) {
        for (std::int64_t tokens : options.tokens) {
          for (const std::string& routing : options.routings) {
            rows.push_back(run_row(options, kind, experts, tokens, k, n, routing, rng, stream));
            table.print(rows.back());
          }
        }
      }
    }
  }
  nlohmann::json result = bench::rows_result("grouped_gemm", device.name, options.repeats, options.warmup, rows);
  result["dtype"] = options.dtype;
  bench::write_json(options.out, result);
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Grouped GEMM over device offsets: TFLOP/s on the MoE expert shapes"};
  stepgraph::Options options;
  app.add_option("--experts", options.experts, "expert counts")->delimiter(',')->capture_default_str();
  app.add_option("--tokens", options.tokens, "token counts")->delimiter(',')->capture_default_str();
  app.add_option("--shapes", options.shapes, "KxN (in x out features)")->delimiter(',')->capture_default_str();
  app.add_option("--routings", options.routings, "balanced, skewed")->delimiter(',')->capture_default_str();
  app.add_option("--kinds", options.kinds, "forward, dgrad, wgrad")->delimiter(',')->capture_default_str();
  app.add_option("--dtype", options.dtype, "bf16, or fp8 (E4M3 x and w, E5M2 dy, tensor-wise scales)")
      ->capture_default_str();
  app.add_flag("--split-accumulation", options.split_accumulation,
               "with --dtype fp8: fp32 totals every 128 of the reduction (cuBLASLt's default for FP8)");
  app.add_option("--wgrad-out", options.wgrad_out, "wgrad's dw: fp32 (a main grad), or bf16 (bf16 only)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed launches per row")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed launches first")->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("grouped_gemm_bench", [&] { return stepgraph::run(options); });
}
