#include "benchmarks/bench_support.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <string_view>
#include <utility>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"

namespace stepgraph::bench {

nlohmann::json keep_multicast_off(const std::string& program) {
  static constexpr std::pair<const char*, const char*> kOff[] = {
      {"NCCL_NVLS_ENABLE", "0"}, {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"}, {"NVSHMEM_DISABLE_NVLS", "1"}};
  nlohmann::json env = nlohmann::json::object();
  for (const auto& [name, value] : kOff) {
    const char* had = std::getenv(name);
    if (had != nullptr && std::string_view(had) != value) {
      std::cerr << program << ": " << name << "=" << had << " replaced by " << value
                << ": NVLink multicast stays off (DESIGN.md)\n";
    }
    ::setenv(name, value, /*overwrite=*/1);
    env[name] = value;
  }
  return env;
}

Summary summarize(std::vector<double> samples_us) {
  SG_CHECK(!samples_us.empty(), "summarize: no samples");
  std::sort(samples_us.begin(), samples_us.end());
  const std::size_t n = samples_us.size();
  const double median = n % 2 ? samples_us[n / 2] : 0.5 * (samples_us[n / 2 - 1] + samples_us[n / 2]);
  return {median, samples_us.front(), samples_us.back()};
}

nlohmann::json to_json(const Summary& summary) {
  return {{"median_us", summary.median_us}, {"min_us", summary.min_us}, {"max_us", summary.max_us}};
}

Summary time_launches(cudaStream_t stream, int warmup, int repeats, const std::function<void()>& launch) {
  for (int i = 0; i < warmup; ++i) launch();
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  Event start(Event::Timing::kEnabled);
  Event stop(Event::Timing::kEnabled);
  std::vector<double> samples;
  samples.reserve(static_cast<std::size_t>(repeats));
  for (int i = 0; i < repeats; ++i) {
    start.record(stream);
    launch();
    stop.record(stream);
    stop.synchronize();
    samples.push_back(1000.0 * Event::elapsed_ms(start, stop));
  }
  return summarize(std::move(samples));
}

void RowTable::print_header() const {
  std::cout << std::left << std::setw(name_width) << "row" << std::right;
  for (std::size_t i = 0; i < columns.size(); ++i) std::cout << std::setw(i == 0 ? 12 : 10) << columns[i].second;
  std::cout << "\n";
}

void RowTable::print(const nlohmann::json& row) const {
  std::cout << std::left << std::setw(name_width) << row["name"].get<std::string>() << std::right << std::fixed
            << std::setprecision(1);
  for (std::size_t i = 0; i < columns.size(); ++i) {
    std::cout << std::setw(i == 0 ? 12 : 10) << row[columns[i].first].get<double>();
  }
  std::cout << "\n" << std::flush;
}

nlohmann::json rows_result(const std::string& benchmark, const std::string& device, int repeats, int warmup,
                           const nlohmann::json& rows) {
  return {{"benchmark", benchmark}, {"impl", "stepgraph"}, {"device", device},
          {"repeats", repeats},     {"warmup", warmup},    {"rows", rows}};
}

int run_main(const char* program, const std::function<int()>& run) {
  try {
    return run();
  } catch (const Error& error) {
    std::cerr << program << ": " << error.message() << "\n";
  } catch (const std::exception& error) {
    std::cerr << program << ": " << error.what() << "\n";
  }
  return EXIT_FAILURE;
}

void write_json(const std::string& path, const nlohmann::json& value) {
  if (path.empty()) return;
  std::ofstream file(path);
  SG_CHECK_CODE(file.good(), ErrorCode::kIo, "cannot write ", path);
  file << value.dump(2) << "\n";
  SG_CHECK_CODE(file.good(), ErrorCode::kIo, "writing ", path, " failed");
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) { SG_CUDA_CHECK(cudaMalloc(&data_, std::max<std::size_t>(bytes, 256))); }

DeviceBuffer::~DeviceBuffer() { cudaFree(data_); }

void fill_random_bf16(const DeviceBuffer& buffer, std::int64_t count, std::mt19937& rng) {
  const std::int64_t block = std::min<std::int64_t>(count, std::int64_t{1} << 22);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint16_t> host(static_cast<std::size_t>(block));
  for (std::uint16_t& value : host) value = float_to_bf16(uniform(rng));
  auto* base = static_cast<std::uint16_t*>(buffer.get());
  SG_CUDA_CHECK(cudaMemcpy(base, host.data(), block * sizeof(std::uint16_t), cudaMemcpyHostToDevice));
  for (std::int64_t done = block; done < count;) {
    const std::int64_t n = std::min(done, count - done);
    SG_CUDA_CHECK(cudaMemcpy(base + done, base, n * sizeof(std::uint16_t), cudaMemcpyDeviceToDevice));
    done += n;
  }
  SG_CUDA_CHECK(cudaDeviceSynchronize());
}

void fill_random_fp8(const DeviceBuffer& buffer, std::int64_t count, Fp8Format format, std::mt19937& rng) {
  const std::int64_t block = std::min<std::int64_t>(count, std::int64_t{1} << 22);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::uint8_t> host(static_cast<std::size_t>(block));
  for (std::uint8_t& code : host) code = float_to_fp8(format, uniform(rng));
  auto* base = static_cast<std::uint8_t*>(buffer.get());
  SG_CUDA_CHECK(cudaMemcpy(base, host.data(), static_cast<std::size_t>(block), cudaMemcpyHostToDevice));
  for (std::int64_t done = block; done < count;) {
    const std::int64_t n = std::min(done, count - done);
    SG_CUDA_CHECK(cudaMemcpy(base + done, base, static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice));
    done += n;
  }
  SG_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace stepgraph::bench
