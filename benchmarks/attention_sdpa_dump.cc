// The attention kernels' results on random packed batches, written for
// benchmarks/attention_sdpa_check.py to compare against PyTorch's
// scaled_dot_product_attention on random shapes, including odd sequence
// lengths and one-token sequences.
//
//   attention_sdpa_dump --out DIR [--cases 16] [--seed N]
//
// Case i: bf16 or fp16, head_dim 64 or 128 (the tensor-core kernels) or 96
// (the plain ones), heads and kv heads (MHA, GQA, MQA), causal or not, and a
// packing of odd lengths, one-token and empty sequences and sequences over
// several 128-row tiles. DIR/case_<i>.json holds the description and the
// byte offset of each array in DIR/case_<i>.bin: q, k, v, dout (inputs, the
// dtype's raw 16-bit values), out, dq, dk, dv (the same dtype) and lse (fp32),
// all row-major as kernels/attention.h lays them out.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "kernels/attention.h"

namespace stepgraph {
namespace {

struct Options {
  std::string out;
  int cases = 16;
  std::uint32_t seed = 0;  // 0: from the clock
};

// Device memory holding a host vector's bytes, copied back on request.
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t bytes) : bytes_(bytes) { SG_CUDA_CHECK(cudaMalloc(&data_, bytes == 0 ? 1 : bytes)); }
  template <typename T>
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size() * sizeof(T)) {
    SG_CUDA_CHECK(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice));
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void* get() const { return data_; }
  std::vector<char> bytes() const {
    std::vector<char> host(bytes_);
    SG_CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

std::vector<std::uint16_t> random_16bit(DType dtype, std::int64_t count, std::mt19937& rng, float scale) {
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<std::uint16_t> values(static_cast<std::size_t>(count));
  for (auto& value : values) {
    const float x = uniform(rng);
    value = dtype == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
  }
  return values;
}

// Odd lengths, one-token and empty sequences, and some over several tiles.
std::vector<std::int32_t> random_lengths(std::mt19937& rng) {
  std::vector<std::int32_t> lengths{1, 0};
  const int count = 3 + static_cast<int>(rng() % 5);
  for (int i = 0; i < count; ++i) {
    lengths.push_back(rng() % 3 == 0 ? 129 + static_cast<int>(rng() % 300) : (1 + static_cast<int>(rng() % 90)) | 1);
  }
  std::shuffle(lengths.begin(), lengths.end(), rng);
  return lengths;
}

void dump_case(int index, std::mt19937& rng, const std::filesystem::path& dir, Stream& stream) {
  static constexpr std::int64_t kDims[] = {64, 128, 128, 96};
  static constexpr std::int64_t kHeads[][2] = {{4, 4}, {8, 2}, {4, 1}, {2, 2}};
  kernels::AttentionDesc desc;
  desc.dtype = rng() % 2 == 0 ? DType::kBFloat16 : DType::kFloat16;
  desc.head_dim = kDims[rng() % 4];
  const auto& heads = kHeads[rng() % 4];
  desc.heads = heads[0];
  desc.kv_heads = heads[1];
  desc.causal = rng() % 4 != 0;
  const std::vector<std::int32_t> lengths = random_lengths(rng);
  std::vector<std::int32_t> cu{0};
  for (const std::int32_t length : lengths) cu.push_back(cu.back() + length);
  desc.tokens = cu.back();
  desc.sequences = static_cast<std::int64_t>(lengths.size());
  kernels::check_attention_cuda(desc);

  const std::int64_t nq = desc.tokens * desc.heads * desc.head_dim;
  const std::int64_t nkv = desc.tokens * desc.kv_heads * desc.head_dim;
  // Scores of order 1-3 after the scale: peaked softmaxes too.
  const auto q_host = random_16bit(desc.dtype, nq, rng, 2.0f);
  const auto k_host = random_16bit(desc.dtype, nkv, rng, 2.0f);
  const auto v_host = random_16bit(desc.dtype, nkv, rng, 1.0f);
  const auto dout_host = random_16bit(desc.dtype, nq, rng, 1.0f);
  DeviceArray q(q_host), k(k_host), v(v_host), dout(dout_host), cu_dev(cu);
  DeviceArray out(nq * 2), dq(nq * 2), dk(nkv * 2), dv(nkv * 2), lse(desc.heads * desc.tokens * 4);
  DeviceArray workspace(kernels::attention_backward_workspace_bytes(desc));
  const auto* cu_ptr = static_cast<const std::int32_t*>(cu_dev.get());
  kernels::launch_attention_forward(desc, q.get(), k.get(), v.get(), cu_ptr, out.get(),
                                    static_cast<float*>(lse.get()), stream.get());
  kernels::launch_attention_backward(desc, q.get(), k.get(), v.get(), out.get(), static_cast<const float*>(lse.get()),
                                     dout.get(), cu_ptr, dq.get(), dk.get(), dv.get(), workspace.get(), stream.get());
  stream.synchronize();

  const std::string stem = "case_" + std::to_string(index);
  std::ofstream bin(dir / (stem + ".bin"), std::ios::binary);
  nlohmann::json arrays = nlohmann::json::object();
  std::size_t offset = 0;
  auto write = [&](const char* name, const std::vector<char>& bytes) {
    arrays[name] = {{"offset", offset}, {"bytes", bytes.size()}};
    bin.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    offset += bytes.size();
  };
  write("q", q.bytes());
  write("k", k.bytes());
  write("v", v.bytes());
  write("dout", dout.bytes());
  write("out", out.bytes());
  write("dq", dq.bytes());
  write("dk", dk.bytes());
  write("dv", dv.bytes());
  write("lse", lse.bytes());
  SG_CHECK(bin.good(), "attention_sdpa_dump: could not write ", (dir / (stem + ".bin")).string());
  const nlohmann::json meta = {{"dtype", std::string(dtype_name(desc.dtype))},
                               {"tokens", desc.tokens},
                               {"heads", desc.heads},
                               {"kv_heads", desc.kv_heads},
                               {"head_dim", desc.head_dim},
                               {"causal", desc.causal},
                               {"scale", desc.softmax_scale()},
                               {"tensor_cores", kernels::attention_uses_tensor_cores(desc)},
                               {"cu_seqlens", cu},
                               {"arrays", arrays}};
  std::ofstream(dir / (stem + ".json")) << meta.dump(1) << "\n";
}

int run(const Options& options) {
  const std::uint32_t seed = options.seed != 0 ? options.seed : std::random_device{}();
  std::cout << "attention_sdpa_dump: seed " << seed << " (rerun with --seed " << seed << ")\n";
  SG_CHECK(!options.out.empty(), "attention_sdpa_dump: --out DIR is required");
  SG_CHECK(options.cases > 0, "attention_sdpa_dump: --cases must be positive, got ", options.cases);
  const std::filesystem::path dir(options.out);
  std::filesystem::create_directories(dir);
  Stream stream;
  std::mt19937 rng(seed);
  for (int i = 0; i < options.cases; ++i) dump_case(i, rng, dir, stream);
  std::cout << "attention_sdpa_dump: " << options.cases << " cases in " << dir.string() << "\n";
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Attention kernels' results on random packed batches, for attention_sdpa_check.py"};
  stepgraph::Options options;
  app.add_option("--out", options.out, "directory for case_<i>.json and case_<i>.bin")->required();
  app.add_option("--cases", options.cases, "random cases")->capture_default_str();
  app.add_option("--seed", options.seed, "random seed (0: from the clock; printed)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("attention_sdpa_dump", [&] {
    const stepgraph::DeviceCount found = stepgraph::cuda_device_count();
    if (found.count == 0) {
      std::cerr << "attention_sdpa_dump: needs a GPU: " << found.no_device_reason << "\n";
      return EXIT_FAILURE;
    }
    std::cout << "device: " << stepgraph::describe(stepgraph::device_properties(0)) << "\n";
    return stepgraph::run(options);
  });
}
