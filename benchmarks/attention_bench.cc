// Attention throughput: launch_attention_forward / launch_attention_backward
// on packed batches of equal sequences (cu_seqlens on the device, as the
// layer has it).
//
//   attention_bench --out attention.json                       # every row
//   attention_bench --seqs 4096 --heads 32 --dims 128 --kinds forward
//
// Rows: sequence length {1k, 2k, 4k, 8k, 16k} x heads {16, 32} x head_dim
// {128, 64}, batch = tokens / seq (tokens 16384 by default), MHA, causal,
// bf16. FLOPs as FlashAttention counts them: forward 4 seq^2 H D per
// sequence, halved when causal; backward 2.5x the forward. TFLOP/s = FLOPs /
// median time. benchmarks/attention_peer.py times PyTorch SDPA (flash and
// cuDNN backends) on the same rows with the same JSON row keys.
#include <CLI/CLI.hpp>
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
#include "engine/stream.h"
#include "kernels/attention.h"

namespace stepgraph {
namespace {

using bench::DeviceBuffer;
using bench::fill_random_bf16;

struct Options {
  std::vector<std::int64_t> seqs = {1024, 2048, 4096, 8192, 16384};
  std::vector<std::int64_t> heads = {16, 32};
  std::vector<std::int64_t> dims = {128, 64};
  std::vector<std::string> kinds = {"forward", "backward"};
  std::int64_t tokens = 16384;
  std::int64_t kv_heads = 0;  // 0: = heads
  bool causal = true;
  int repeats = 20;
  int warmup = 5;
  std::string out;
};

double attention_flops(const std::string& kind, std::int64_t seq, std::int64_t batch, std::int64_t heads,
                       std::int64_t dim, bool causal) {
  const double forward = 4.0 * static_cast<double>(seq) * static_cast<double>(seq) * static_cast<double>(heads) *
                         static_cast<double>(dim) * static_cast<double>(batch) * (causal ? 0.5 : 1.0);
  return kind == "forward" ? forward : 2.5 * forward;
}

nlohmann::json run_row(const Options& options, const std::string& kind, std::int64_t seq, std::int64_t heads,
                       std::int64_t dim, std::mt19937& rng, Stream& stream) {
  SG_CHECK(kind == "forward" || kind == "backward", "attention_bench: kinds are forward, backward; got ", kind);
  const std::int64_t batch = std::max<std::int64_t>(1, options.tokens / seq);
  kernels::AttentionDesc desc;
  desc.dtype = DType::kBFloat16;
  desc.tokens = batch * seq;
  desc.sequences = batch;
  desc.heads = heads;
  desc.kv_heads = options.kv_heads > 0 ? options.kv_heads : heads;
  desc.head_dim = dim;
  desc.causal = options.causal;
  kernels::check_attention_cuda(desc);
  const std::int64_t nq = desc.tokens * heads * dim;
  const std::int64_t nkv = desc.tokens * desc.kv_heads * dim;
  DeviceBuffer q(nq * 2), k(nkv * 2), v(nkv * 2), out(nq * 2), dout(nq * 2), dq(nq * 2), dk(nkv * 2), dv(nkv * 2);
  DeviceBuffer lse(heads * desc.tokens * 4);
  DeviceBuffer workspace(kernels::attention_backward_workspace_bytes(desc));
  fill_random_bf16(q, nq, rng);
  fill_random_bf16(k, nkv, rng);
  fill_random_bf16(v, nkv, rng);
  fill_random_bf16(dout, nq, rng);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(batch + 1));
  for (std::int64_t s = 0; s <= batch; ++s) cu[s] = static_cast<std::int32_t>(s * seq);
  DeviceBuffer cu_dev(cu.size() * sizeof(std::int32_t));
  SG_CUDA_CHECK(cudaMemcpy(cu_dev.get(), cu.data(), cu.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  const auto* cu_ptr = static_cast<const std::int32_t*>(cu_dev.get());
  auto forward = [&] {
    kernels::launch_attention_forward(desc, q.get(), k.get(), v.get(), cu_ptr, out.get(), static_cast<float*>(lse.get()),
                                      stream.get());
  };
  forward();  // out and lse for the backward
  stream.synchronize();
  const bench::Summary s = kind == "forward"
                               ? bench::time_launches(stream.get(), options.warmup, options.repeats, forward)
                               : bench::time_launches(stream.get(), options.warmup, options.repeats, [&] {
                                   kernels::launch_attention_backward(
                                       desc, q.get(), k.get(), v.get(), out.get(), static_cast<float*>(lse.get()),
                                       dout.get(), cu_ptr, dq.get(), dk.get(), dv.get(), workspace.get(), stream.get());
                                 });
  const double flops = attention_flops(kind, seq, batch, heads, dim, options.causal);
  std::ostringstream name;
  name << kind << " seq=" << seq << " batch=" << batch << " H=" << heads << " D=" << dim
       << (options.causal ? " causal" : " full");
  nlohmann::json row = bench::to_json(s);
  row["name"] = name.str();
  row["impl"] = "stepgraph";
  row["kind"] = kind;
  row["seq"] = seq;
  row["batch"] = batch;
  row["heads"] = heads;
  row["kv_heads"] = desc.kv_heads;
  row["head_dim"] = dim;
  row["causal"] = options.causal;
  row["tflops"] = flops / (s.median_us * 1e-6) / 1e12;
  row["tflops_best"] = flops / (s.min_us * 1e-6) / 1e12;
  return row;
}

int run(const Options& options) {
  SG_CHECK(options.repeats > 0 && options.warmup >= 0, "attention_bench: --repeats > 0, --warmup >= 0");
  const DeviceProperties device = device_properties(0);
  std::cerr << "device: " << describe(device) << "\n";
  std::mt19937 rng(std::random_device{}());
  Stream stream;
  nlohmann::json rows = nlohmann::json::array();
  const bench::RowTable table{
      48, {{"median_us", "median us"}, {"min_us", "min us"}, {"max_us", "max us"}, {"tflops", "TFLOP/s"}}};
  table.print_header();
  for (const std::string& kind : options.kinds) {
    for (std::int64_t dim : options.dims) {
      for (std::int64_t heads : options.heads) {
        for (std::int64_t seq : options.seqs) {
          rows.push_back(run_row(options, kind, seq, heads, dim, rng, stream));
          table.print(rows.back());
        }
      }
    }
  }
  bench::write_json(options.out, bench::rows_result("attention", device.name, options.repeats, options.warmup, rows));
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Attention over packed sequences: forward and backward TFLOP/s"};
  stepgraph::Options options;
  app.add_option("--seqs", options.seqs, "sequence lengths")->delimiter(',')->capture_default_str();
  app.add_option("--heads", options.heads, "query head counts")->delimiter(',')->capture_default_str();
  app.add_option("--dims", options.dims, "head dims")->delimiter(',')->capture_default_str();
  app.add_option("--kinds", options.kinds, "forward, backward")->delimiter(',')->capture_default_str();
  app.add_option("--tokens", options.tokens, "tokens per batch (batch = tokens / seq)")->capture_default_str();
  app.add_option("--kv-heads", options.kv_heads, "kv heads (0: as many as query heads)")->capture_default_str();
  app.add_option("--causal", options.causal, "causal masking")->capture_default_str();
  app.add_option("--repeats", options.repeats, "timed launches per row")->capture_default_str();
  app.add_option("--warmup", options.warmup, "untimed launches first")->capture_default_str();
  app.add_option("--out", options.out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("attention_bench", [&] { return stepgraph::run(options); });
}
