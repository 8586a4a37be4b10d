#include "kernels/elementwise.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "tests/support/gpu.h"

namespace stepgraph::kernels {
namespace {

TEST(ElementwiseTest, BadArgumentsAreErrorsBeforeAnyLaunch) {
  // Checked on the host, so these run without a GPU.
  EXPECT_THROW(launch_fill_f32(nullptr, 1.0f, -1, nullptr), Error);
  EXPECT_THROW(launch_fill_f32(nullptr, 1.0f, 8, nullptr), Error);
  EXPECT_THROW(launch_axpy_f32(nullptr, nullptr, 1.0f, 8, nullptr), Error);
  EXPECT_NO_THROW(launch_fill_f32(nullptr, 1.0f, 0, nullptr));  // empty is fine
}

class ElementwiseSizes : public ::testing::TestWithParam<std::int64_t> {};

// fill then axpy against the host, on sizes that are not multiples of the
// block size; the output is poisoned with NaN first so an unwritten element
// fails, and inputs are fresh random numbers each run.
TEST_P(ElementwiseSizes, FillAxpyF32MatchHost) {
  SG_SKIP_WITHOUT_GPU();
  const std::int64_t n = GetParam();
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  std::vector<float> x(n);
  for (float& v : x) v = uniform(rng);
  const float fill_value = uniform(rng);
  const float alpha = uniform(rng);

  float* d_x = nullptr;
  float* d_y = nullptr;
  SG_CUDA_CHECK(cudaMalloc(&d_x, n * sizeof(float)));
  SG_CUDA_CHECK(cudaMalloc(&d_y, n * sizeof(float)));
  Stream stream;
  const std::vector<float> poison(n, std::numeric_limits<float>::quiet_NaN());
  SG_CUDA_CHECK(cudaMemcpy(d_y, poison.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  SG_CUDA_CHECK(cudaMemcpy(d_x, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  launch_fill_f32(d_y, fill_value, n, stream.get());
  launch_axpy_f32(d_y, d_x, alpha, n, stream.get());
  stream.synchronize();
  std::vector<float> y(n);
  SG_CUDA_CHECK(cudaMemcpy(y.data(), d_y, n * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(d_x);
  cudaFree(d_y);

  std::int64_t mismatches = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    // fp32 fused multiply-add on the device, separate on the host: one rounding apart.
    const float expected = fill_value + alpha * x[i];
    mismatches += !(std::fabs(y[i] - expected) <= 1e-6f * (1.0f + std::fabs(expected)));
  }
  EXPECT_EQ(mismatches, 0) << "n = " << n;
}

INSTANTIATE_TEST_SUITE_P(RaggedSizes, ElementwiseSizes, ::testing::Values(1, 7, 255, 257, 100003, 4'000'037));

}  // namespace
}  // namespace stepgraph::kernels
