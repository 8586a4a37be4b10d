// Memory-bound kernels against the device-to-device copy bandwidth measured in
// the same run: LayerNorm forward and backward (hidden 4096 x 16384 tokens,
// bf16), softmax cross-entropy (vocab 32768, bf16 logits) and AdamW over 100M
// parameters (fp32 master, grads and moments, bf16 copies), and FP8
// quantization at 8192 x 4096 bf16 (tensor-wise quantize with both copies,
// and the fused LayerNorm/GeLU/dGeLU -> FP8 kernels), and the token
// embedding's backward at step_bench medium's table (2048 and 16384
// positions). Each kernel's
// bandwidth counts the bytes it must move (inputs read once, outputs written
// once); the goal is >= 80% of the copy's.
//
//   memory_bound_bench --repeats 50 --out memory_bound.json
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/step_configs.h"
#include "engine/cuda_check.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "kernels/adamw.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/fp8_fused.h"
#include "kernels/fp8_quantize.h"
#include "kernels/norm.h"

namespace stepgraph {
namespace {

// A device buffer filled with random values in [-1, 1) of the given kind
// (never zeros: zeros can run faster than real data).
class Buffer {
 public:
  // `bf16`: the buffer holds bf16 values, else fp32.
  Buffer(double bytes_in, Stream& stream, std::uint32_t seed, bool bf16 = false)
      : bytes_(static_cast<std::size_t>(bytes_in)) {
    SG_CUDA_CHECK(cudaMalloc(&data_, bytes_));
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<std::uint8_t> host(bytes_);
    if (bf16) {
      auto* values = reinterpret_cast<std::uint16_t*>(host.data());
      for (std::size_t i = 0; i < bytes_ / 2; ++i) values[i] = float_to_bf16(uniform(rng));
    } else {
      auto* values = reinterpret_cast<float*>(host.data());
      for (std::size_t i = 0; i < bytes_ / 4; ++i) values[i] = uniform(rng);
    }
    SG_CUDA_CHECK(cudaMemcpyAsync(data_, host.data(), bytes_, cudaMemcpyHostToDevice, stream.get()));
    stream.synchronize();
  }
  ~Buffer() { cudaFree(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

nlohmann::json row(const std::string& name, const bench::Summary& t, double bytes, double copy_gbps) {
  const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
  std::cout << "  " << name << ": median " << t.median_us << " us (min " << t.min_us << ", max " << t.max_us << "), "
            << gbps << " GB/s, " << 100.0 * gbps / copy_gbps << "% of copy\n";
  return {{"kernel", name},
          {"median_us", t.median_us},
          {"min_us", t.min_us},
          {"max_us", t.max_us},
          {"bytes", bytes},
          {"gbps", gbps},
          {"fraction_of_copy", gbps / copy_gbps}};
}

int run(int repeats, const std::string& out_path) {
  const DeviceProperties device = device_properties(0);
  std::cout << "device: " << describe(device) << "\n";
  Stream stream;
  nlohmann::json rows = nlohmann::json::array();

  // Device-to-device copy: 1 GiB, bytes read + written.
  const std::size_t copy_bytes = std::size_t{1} << 30;
  Buffer src(copy_bytes, stream, 1);
  Buffer dst(copy_bytes, stream, 2);
  const bench::Summary copy = bench::time_launches(stream.get(), 5, repeats, [&] {
    SG_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), copy_bytes, cudaMemcpyDeviceToDevice, stream.get()));
  });
  const double copy_gbps = 2.0 * copy_bytes / (copy.median_us * 1e-6) / 1e9;
  std::cout << "  copy 1 GiB: median " << copy.median_us << " us, " << copy_gbps << " GB/s (read + write)\n";
  rows.push_back(row("copy_d2d_1GiB", copy, 2.0 * copy_bytes, copy_gbps));

  {  // LayerNorm bf16, hidden 4096, 16384 tokens.
    const kernels::NormDesc desc{kernels::NormKind::kLayerNorm, DType::kBFloat16, 16384, 4096, 1e-5f};
    const double elems = static_cast<double>(desc.rows) * desc.hidden;
    Buffer x(elems * 2, stream, 3, true), y(elems * 2, stream, 4, true), dy(elems * 2, stream, 5, true),
        dx(elems * 2, stream, 6, true);
    Buffer gamma(desc.hidden * 2, stream, 7, true), beta(desc.hidden * 2, stream, 8, true);
    Buffer mean(desc.rows * 4, stream, 9), rstd(desc.rows * 4, stream, 10);
    Buffer dgamma(desc.hidden * 4, stream, 11), dbeta(desc.hidden * 4, stream, 12);
    Buffer workspace(std::max<std::size_t>(kernels::norm_backward_workspace_bytes(desc), 256), stream, 13);
    const bench::Summary fwd = bench::time_launches(stream.get(), 5, repeats, [&] {
      kernels::launch_norm_forward(desc, x.get(), gamma.get(), beta.get(), y.get(), mean.as<float>(), rstd.as<float>(),
                                   stream.get());
    });
    // Reads x, gamma, beta; writes y, mean, rstd.
    rows.push_back(
        row("layernorm_fwd_bf16_16384x4096", fwd, elems * 2 * 2 + desc.rows * 8.0 + desc.hidden * 4.0, copy_gbps));
    // Reads dy, x, mean, rstd, gamma; writes dx, dgamma, dbeta.
    const double bwd_bytes = elems * 2 * 3 + desc.rows * 8.0 + desc.hidden * 10.0;
    auto time_backward = [&](const kernels::NormBackwardTuning& tuning) {
      return bench::time_launches(stream.get(), 5, repeats, [&] {
        kernels::launch_norm_backward(desc, dy.get(), x.get(), mean.as<float>(), rstd.as<float>(), gamma.get(),
                                      dx.get(), dgamma.as<float>(), dbeta.as<float>(), workspace.get(), stream.get(),
                                      tuning);
      });
    };
    rows.push_back(row("layernorm_bwd_bf16_16384x4096", time_backward({}), bwd_bytes, copy_gbps));
    // The other register budget (4 vectors per thread; the default holds 2
    // at this size), so the README can say why the default is what it is.
    rows.push_back(row("layernorm_bwd_bf16_16384x4096_vecs4", time_backward({.vecs = 4}), bwd_bytes, copy_gbps));
  }

  {  // LayerNorm bf16 backward at the small step config's shape (256 tokens, hidden 512): the
     // automatic rows per block (one) against the 8 a block of 256 threads holds.
    const kernels::NormDesc desc{kernels::NormKind::kLayerNorm, DType::kBFloat16, 256, 512, 1e-5f};
    const double elems = static_cast<double>(desc.rows) * desc.hidden;
    Buffer x(elems * 2, stream, 3, true), dy(elems * 2, stream, 5, true), dx(elems * 2, stream, 6, true);
    Buffer gamma(desc.hidden * 2, stream, 7, true);
    Buffer mean(desc.rows * 4, stream, 9), rstd(desc.rows * 4, stream, 10);
    Buffer dgamma(desc.hidden * 4, stream, 11), dbeta(desc.hidden * 4, stream, 12);
    Buffer workspace(std::max<std::size_t>(kernels::norm_backward_workspace_bytes(desc), 256), stream, 13);
    const double bwd_bytes = elems * 2 * 3 + desc.rows * 8.0 + desc.hidden * 10.0;
    for (const int rows_per_block : {0, 8}) {
      const bench::Summary t = bench::time_launches(stream.get(), 5, repeats, [&] {
        kernels::launch_norm_backward(desc, dy.get(), x.get(), mean.as<float>(), rstd.as<float>(), gamma.get(),
                                      dx.get(), dgamma.as<float>(), dbeta.as<float>(), workspace.get(), stream.get(),
                                      {.rows_per_block = rows_per_block});
      });
      rows.push_back(row(rows_per_block == 0 ? "layernorm_bwd_bf16_256x512" : "layernorm_bwd_bf16_256x512_rows8", t,
                         bwd_bytes, copy_gbps));
    }
  }

  {  // Cross-entropy, bf16 logits, vocab 32768, 8192 tokens.
    kernels::CrossEntropyDesc desc;
    desc.logits_type = DType::kBFloat16;
    desc.label_type = DType::kInt32;
    desc.tokens = 8192;
    desc.vocab = 32768;
    const double elems = static_cast<double>(desc.tokens) * desc.vocab;
    Buffer logits(elems * 2, stream, 14, true), dlogits(elems * 2, stream, 15, true);
    std::vector<std::int32_t> labels_host(desc.tokens);
    std::mt19937 rng(16);
    for (auto& l : labels_host) l = static_cast<std::int32_t>(rng() % desc.vocab);
    Buffer labels(desc.tokens * 4, stream, 17);
    SG_CUDA_CHECK(
        cudaMemcpyAsync(labels.get(), labels_host.data(), desc.tokens * 4, cudaMemcpyHostToDevice, stream.get()));
    Buffer loss(256, stream, 18), flag(256, stream, 19);
    SG_CUDA_CHECK(cudaMemsetAsync(flag.get(), 0, 4, stream.get()));
    Buffer workspace(std::max<std::size_t>(kernels::cross_entropy_workspace_bytes(desc), 256), stream, 20);
    const bench::Summary t = bench::time_launches(stream.get(), 5, repeats, [&] {
      kernels::launch_cross_entropy(desc, logits.get(), labels.get(), loss.as<float>(), dlogits.get(), workspace.get(),
                                    flag.as<std::int32_t>(), stream.get());
    });
    rows.push_back(row("cross_entropy_bf16_8192x32768", t, elems * 2 * 2 + desc.tokens * 4.0, copy_gbps));
  }

  {  // Embedding backward, bf16 dout, medium's table (vocab x hidden): one
     // microbatch of 2048 tokens and 8 of them at once. Tokens uniform over
     // the vocabulary. Bytes: dout read, tokens read, the fp32 table written;
     // dout_read_gbps is dout's bytes alone over the time.
    const bench::StepConfig medium = bench::step_config("medium");
    for (const std::int64_t positions : {std::int64_t{2048}, std::int64_t{16384}}) {
      const kernels::EmbeddingDesc desc{
          .dtype = DType::kBFloat16, .vocab = medium.model.vocab, .dim = medium.model.hidden, .rows = 1,
          .width = positions};
      const double dout_bytes = static_cast<double>(positions) * desc.dim * 2;
      const double table_bytes = static_cast<double>(desc.vocab) * desc.dim * 4;
      Buffer dout(dout_bytes, stream, 50, true), dtable(table_bytes, stream, 51);
      std::vector<std::int32_t> tokens_host(static_cast<std::size_t>(positions));
      std::mt19937 rng(52);
      for (auto& t : tokens_host) t = static_cast<std::int32_t>(rng() % desc.vocab);
      Buffer tokens(positions * 4.0, stream, 53);
      SG_CUDA_CHECK(cudaMemcpyAsync(tokens.get(), tokens_host.data(), tokens_host.size() * 4, cudaMemcpyHostToDevice,
                                    stream.get()));
      const bench::Summary t = bench::time_launches(stream.get(), 5, repeats, [&] {
        kernels::launch_embedding_backward(desc, dout.get(), tokens.as<const std::int32_t>(), dtable.as<float>(),
                                           stream.get());
      });
      nlohmann::json r = row("embedding_bwd_bf16_" + std::to_string(desc.vocab) + "x" + std::to_string(desc.dim) +
                                 "_" + std::to_string(positions) + "_positions",
                             t, dout_bytes + positions * 4.0 + table_bytes, copy_gbps);
      r["dout_read_gbps"] = dout_bytes / (t.median_us * 1e-6) / 1e9;
      std::cout << "    dout read: " << r["dout_read_gbps"].get<double>() << " GB/s\n";
      rows.push_back(r);
    }
  }

  {  // AdamW over 100M parameters in 100 tensors of 1M.
    constexpr int kTensors = 100;
    constexpr std::int64_t kNumel = 1 << 20;
    std::vector<std::unique_ptr<Buffer>> buffers;
    std::vector<kernels::AdamWTensor> tensors;
    for (int t = 0; t < kTensors; ++t) {
      auto make = [&](std::size_t bytes) {
        buffers.push_back(std::make_unique<Buffer>(bytes, stream, 100 + static_cast<std::uint32_t>(buffers.size())));
        return buffers.back()->get();
      };
      kernels::AdamWTensor tensor;
      tensor.weight = static_cast<float*>(make(kNumel * 4));
      tensor.grad = static_cast<const float*>(make(kNumel * 4));
      tensor.m = static_cast<float*>(make(kNumel * 4));
      tensor.v = static_cast<float*>(make(kNumel * 4));
      SG_CUDA_CHECK(cudaMemsetAsync(tensor.v, 0, kNumel * 4, stream.get()));  // second moments start at 0
      tensor.copy = make(kNumel * 2);  // written, never read: its contents do not matter
      tensor.numel = kNumel;
      tensors.push_back(tensor);
    }
    const std::size_t table_bytes = kernels::adamw_table_bytes(tensors);
    std::vector<std::uint8_t> table_host(table_bytes);
    kernels::build_adamw_table(tensors, table_host.data());
    Buffer table(table_bytes, stream, 21);
    SG_CUDA_CHECK(cudaMemcpyAsync(table.get(), table_host.data(), table_bytes, cudaMemcpyHostToDevice, stream.get()));
    Buffer step(256, stream, 22);
    SG_CUDA_CHECK(cudaMemsetAsync(step.get(), 0, 8, stream.get()));
    const std::int64_t total = kTensors * kNumel;
    const bench::Summary t = bench::time_launches(stream.get(), 5, repeats, [&] {
      kernels::launch_adamw({.lr = 1e-4f}, table.get(), kTensors, total, step.as<std::int64_t>(), stream.get());
    });
    // Reads w, g, m, v (16 B); writes w, m, v (12 B) and the bf16 copy (2 B).
    rows.push_back(row("adamw_104.9M_params", t, static_cast<double>(total) * 30.0, copy_gbps));
  }

  {  // FP8 quantization, bf16 [8192, 4096] to E4M3.
    constexpr std::int64_t kRows = 8192;
    constexpr std::int64_t kCols = 4096;
    const double elems = static_cast<double>(kRows) * kCols;
    Buffer x(elems * 2, stream, 30, true), dact(elems * 2, stream, 31, true), out16(elems * 2, stream, 32, true);
    Buffer q(elems, stream, 33), qt(elems, stream, 34), amax(256, stream, 35), scale(256, stream, 36);
    Buffer gamma(kCols * 2, stream, 37, true), beta(kCols * 2, stream, 38, true);
    Buffer mean(kRows * 4, stream, 39), rstd(kRows * 4, stream, 40);
    const float scale_value = 448.0f / 4.0f;
    SG_CUDA_CHECK(cudaMemcpyAsync(scale.get(), &scale_value, 4, cudaMemcpyHostToDevice, stream.get()));
    const kernels::Fp8Copies both{Fp8Format::kE4M3, scale.as<const float>(), q.as<std::uint8_t>(),
                                  qt.as<std::uint8_t>(), amax.as<float>()};
    const kernels::Fp8Copies amax_only{Fp8Format::kE4M3, nullptr, nullptr, nullptr, amax.as<float>()};
    auto time = [&](const std::function<void()>& launch) {
      return bench::time_launches(stream.get(), 5, repeats, launch);
    };
    // Bytes: 16-bit inputs read once, outputs written once (2 B per element
    // each), 1 B per FP8 copy.
    rows.push_back(row("quantize_e4m3_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_quantize({DType::kBFloat16, Fp8Format::kE4M3, kRows, kCols, true, true},
                                                  x.get(), both.scale, both.rowwise, both.columnwise, both.amax,
                                                  stream.get());
                       }),
                       elems * 4, copy_gbps));
    // What the quantize op runs for 16-bit inputs: the identity through the fused kernels' tile.
    rows.push_back(row("quantize_vectorized_e4m3_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_quantize_vectorized(DType::kBFloat16, kRows, kCols, x.get(), both,
                                                             stream.get());
                       }),
                       elems * 4, copy_gbps));
    // Block scaling: the same bytes plus a scale per block (1 x 128: a float per 128 elements a copy).
    Buffer row_scales(elems / 128 * 4, stream, 41), col_scales(elems / 128 * 4, stream, 42), flag(256, stream, 43);
    const kernels::BlockOutputs block_out{q.as<std::uint8_t>(), row_scales.as<float>(), qt.as<std::uint8_t>(),
                                          col_scales.as<float>()};
    rows.push_back(row("quantize_blocks_1x128_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_quantize_blocks({DType::kBFloat16, Fp8Format::kE4M3, kRows, kCols, true, true},
                                                         kernels::BlockShape::k1x128, true, x.get(), block_out,
                                                         flag.as<int>(), stream.get());
                       }),
                       elems * 4 + elems / 128 * 8, copy_gbps));
    rows.push_back(row("quantize_blocks_128x128_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_quantize_blocks({DType::kBFloat16, Fp8Format::kE4M3, kRows, kCols, true, true},
                                                         kernels::BlockShape::k128x128, true, x.get(), block_out,
                                                         flag.as<int>(), stream.get());
                       }),
                       elems * 4, copy_gbps));
    const kernels::NormDesc norm{kernels::NormKind::kLayerNorm, DType::kBFloat16, kRows, kCols, 1e-5f};
    const double stats_bytes = kRows * 8.0 + kCols * 4.0;
    rows.push_back(row("layernorm_fp8_y_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_norm_fp8(norm, x.get(), gamma.get(), beta.get(), out16.get(),
                                                  mean.as<float>(), rstd.as<float>(), both, stream.get());
                       }),
                       elems * 6 + stats_bytes, copy_gbps));
    rows.push_back(row("layernorm_fp8_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_norm_fp8(norm, x.get(), gamma.get(), beta.get(), nullptr, mean.as<float>(),
                                                  rstd.as<float>(), both, stream.get());
                       }),
                       elems * 4 + stats_bytes, copy_gbps));
    rows.push_back(row("gelu_fp8_act_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_gelu_fp8(DType::kBFloat16, kRows, kCols, x.get(), out16.get(), both,
                                                  stream.get());
                       }),
                       elems * 6, copy_gbps));
    rows.push_back(row("gelu_fp8_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_gelu_fp8(DType::kBFloat16, kRows, kCols, x.get(), nullptr, both,
                                                  stream.get());
                       }),
                       elems * 4, copy_gbps));
    rows.push_back(row("gelu_fp8_amax_only_bf16_8192x4096", time([&] {
                         kernels::launch_gelu_fp8(DType::kBFloat16, kRows, kCols, x.get(), nullptr, amax_only,
                                                  stream.get());
                       }),
                       elems * 2, copy_gbps));
    const kernels::Fp8Copies both_e5m2{Fp8Format::kE5M2, both.scale, both.rowwise, both.columnwise, both.amax};
    rows.push_back(row("dgelu_fp8_e5m2_rows_cols_bf16_8192x4096", time([&] {
                         kernels::launch_dgelu_fp8(DType::kBFloat16, kRows, kCols, dact.get(), x.get(), nullptr,
                                                   both_e5m2, stream.get());
                       }),
                       elems * 6, copy_gbps));
  }

  const nlohmann::json result = {{"benchmark", "memory_bound"},
                                 {"device", device.name},
                                 {"repeats", repeats},
                                 {"copy_gbps", copy_gbps},
                                 {"rows", rows}};
  bench::write_json(out_path, result);
  return EXIT_SUCCESS;
}

}  // namespace
}  // namespace stepgraph

int main(int argc, char** argv) {
  CLI::App app{"Memory-bound kernels against the device-to-device copy bandwidth"};
  int repeats = 50;
  std::string out;
  app.add_option("--repeats", repeats, "timed launches per kernel")->capture_default_str();
  app.add_option("--out", out, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  return stepgraph::bench::run_main("memory_bound_bench", [&] { return stepgraph::run(repeats, out); });
}
