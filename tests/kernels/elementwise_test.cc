// Every elementwise kernel and the sum against its host reference, on sizes
// that are not multiples of the block size, with fresh random inputs and
// NaN-poisoned outputs (an unwritten element fails).
#include "kernels/elementwise.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "kernels/elementwise_host.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"
#include "tests/support/expect_error.h"

namespace stepgraph::kernels {
namespace {

TEST(ElementwiseTest, BadArgumentsAreErrorsBeforeAnyLaunch) {
  // Checked on the host, so these run without a GPU.
  EXPECT_ERROR_CONTAINS(launch_fill_f32(nullptr, 1.0f, -1, nullptr), "fill_f32: element count must be >= 0, got -1");
  EXPECT_ERROR_CONTAINS(launch_fill_f32(nullptr, 1.0f, 8, nullptr), "fill_f32: null pointer for 8 elements");
  EXPECT_ERROR_CONTAINS(launch_axpy_f32(nullptr, nullptr, 1.0f, 8, nullptr), "axpy_f32: null pointer");
  EXPECT_ERROR_CONTAINS(launch_add_f32(nullptr, nullptr, nullptr, 8, nullptr), "add_f32: null pointer");
  EXPECT_ERROR_CONTAINS(launch_sum_f32(nullptr, nullptr, 8, nullptr), "sum_f32: null pointer for 8 elements");
  EXPECT_NO_THROW(launch_fill_f32(nullptr, 1.0f, 0, nullptr));  // empty is fine
}

// Device buffers for one test, freed at the end.
class DeviceBuffers {
 public:
  float* make(std::int64_t n) {
    void* p = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&p, std::max<std::int64_t>(n, 1) * sizeof(float)));
    buffers_.push_back(p);
    return static_cast<float*>(p);
  }
  ~DeviceBuffers() {
    for (void* p : buffers_) cudaFree(p);
  }

 private:
  std::vector<void*> buffers_;
};

std::vector<float> random_floats(std::int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = uniform(rng);
  return out;
}

// cudaMemcpy from pageable memory may return before its DMA lands, and our
// non-blocking streams do not wait for the legacy stream: synchronize.
void upload(float* device, const std::vector<float>& host) {
  SG_CUDA_CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  SG_CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<float> download(const float* device, std::int64_t n) {
  std::vector<float> host(static_cast<std::size_t>(n));
  SG_CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

void poison(float* device, std::int64_t n) {
  upload(device, std::vector<float>(static_cast<std::size_t>(n), std::numeric_limits<float>::quiet_NaN()));
}

// fp32 elementwise results may differ from the host by one rounding (the
// device contracts y + a*x into one fused multiply-add).
std::int64_t mismatches(const std::vector<float>& got, const std::vector<float>& want) {
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    bad += !(std::fabs(got[i] - want[i]) <= 1e-6f * (1.0f + std::fabs(want[i])));
  }
  return bad;
}

class ElementwiseF32Ragged : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(ElementwiseF32Ragged, EveryKernelMatchesItsHostReference) {
  SG_SKIP_WITHOUT_GPU();
  const std::int64_t n = GetParam();
  testing::SeededRng rng;
  const std::vector<float> a = random_floats(n, rng);
  const std::vector<float> b = random_floats(n, rng);
  const float alpha = random_floats(1, rng)[0];
  DeviceBuffers buffers;
  float* d_a = buffers.make(n);
  float* d_b = buffers.make(n);
  float* d_out = buffers.make(n);
  upload(d_a, a);
  upload(d_b, b);
  Stream stream;
  std::vector<float> want(static_cast<std::size_t>(n));

  const auto check = [&](const char* what, auto&& launch, auto&& reference) {
    poison(d_out, n);
    launch();
    stream.synchronize();
    reference();
    EXPECT_EQ(mismatches(download(d_out, n), want), 0) << what << ", n = " << n;
  };
  check(
      "fill", [&] { launch_fill_f32(d_out, alpha, n, stream.get()); }, [&] { host::fill_f32(want.data(), alpha, n); });
  check(
      "copy", [&] { launch_copy_f32(d_out, d_a, n, stream.get()); }, [&] { host::copy_f32(want.data(), a.data(), n); });
  check(
      "axpy", [&] { launch_axpy_f32(d_out, d_a, d_b, alpha, n, stream.get()); },
      [&] { host::axpy_f32(want.data(), a.data(), b.data(), alpha, n); });
  check(
      "add", [&] { launch_add_f32(d_out, d_a, d_b, n, stream.get()); },
      [&] { host::add_f32(want.data(), a.data(), b.data(), n); });
  check(
      "mul", [&] { launch_mul_f32(d_out, d_a, d_b, n, stream.get()); },
      [&] { host::mul_f32(want.data(), a.data(), b.data(), n); });

  // In place: out starts as a copy of a, then out += alpha * b.
  upload(d_out, a);
  launch_axpy_f32(d_out, d_b, alpha, n, stream.get());
  stream.synchronize();
  host::axpy_f32(want.data(), a.data(), b.data(), alpha, n);
  EXPECT_EQ(mismatches(download(d_out, n), want), 0) << "axpy in place, n = " << n;
}

TEST_P(ElementwiseF32Ragged, SumMatchesTheDoubleReferenceAndIsDeterministic) {
  SG_SKIP_WITHOUT_GPU();
  const std::int64_t n = GetParam();
  testing::SeededRng rng;
  const std::vector<float> x = random_floats(n, rng);
  DeviceBuffers buffers;
  float* d_x = buffers.make(n);
  float* d_sum = buffers.make(2);
  upload(d_x, x);
  poison(d_sum, 2);
  Stream stream;
  launch_sum_f32(d_sum, d_x, n, stream.get());
  launch_sum_f32(d_sum + 1, d_x, n, stream.get());
  stream.synchronize();
  const std::vector<float> got = download(d_sum, 2);
  float want = 0.0f;
  host::sum_f32(&want, x.data(), n);
  double magnitude = 0.0;
  for (float v : x) magnitude += std::fabs(v);
  // fp32 partial sums of |x| <= 4: the error grows with the summed magnitude.
  EXPECT_LE(std::fabs(got[0] - want), 1e-6 * magnitude + 1e-6) << "n = " << n;
  EXPECT_EQ(std::memcmp(&got[0], &got[1], sizeof(float)), 0) << "two sums of the same input differ";
}

INSTANTIATE_TEST_SUITE_P(RaggedSizes, ElementwiseF32Ragged, ::testing::Values(1, 7, 255, 257, 1025, 100003, 4'000'037));

// The host reference's column sums against double (they are fp32 sums in a
// fixed order: close, not exact).
TEST(ColumnSumHostTest, CloseToDoubleSums) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t rows = 1000, cols = 37;
  std::vector<float> x(rows * cols);
  for (float& v : x) v = normal(rng);
  std::vector<float> got(cols);
  host::column_sum(DType::kFloat32, rows, cols, x.data(), got.data());
  for (std::int64_t c = 0; c < cols; ++c) {
    double want = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) want += x[r * cols + c];
    EXPECT_NEAR(got[c], want, 1e-3) << "column " << c;
  }
}

// The kernel equals the host reference bit for bit (the same order of additions).
TEST(ColumnSumTest, EqualsTheHostReferenceBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Stream stream;
  for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 33}, {4097, 96}, {64, 1000}}) {
    std::vector<float> x(rows * cols);
    for (float& v : x) v = normal(rng);
    std::vector<float> want(cols), got(cols);
    host::column_sum(DType::kFloat32, rows, cols, x.data(), want.data());
    float* x_dev = nullptr;
    float* out_dev = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&x_dev, x.size() * 4));
    SG_CUDA_CHECK(cudaMalloc(&out_dev, cols * 4));
    SG_CUDA_CHECK(cudaMemcpy(x_dev, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    launch_column_sum(DType::kFloat32, rows, cols, x_dev, out_dev, stream.get());
    stream.synchronize();
    SG_CUDA_CHECK(cudaMemcpy(got.data(), out_dev, cols * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(got.data(), want.data(), cols * 4), 0) << rows << " x " << cols;
    cudaFree(x_dev);
    cudaFree(out_dev);
  }
}

}  // namespace
}  // namespace stepgraph::kernels
