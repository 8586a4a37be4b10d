// The FP8 quantize kernel (kernels/fp8_quantize.cu) against its host
// reference, bit for bit: the row-wise and column-wise bytes and amax, for
// fp32/bf16/fp16 inputs, both formats, shapes off the 64 x 64 tile grid, a
// NaN, and values past the format's range (saturation).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/stream.h"
#include "kernels/fp8_quantize.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::HostArray;
using testing::random_array;
using testing::SeededRng;

void check_against_host(const QuantizeDesc& desc, const HostArray& x, float scale) {
  SCOPED_TRACE(::testing::Message() << dtype_name(desc.in_dtype) << " " << fp8_format_name(desc.format) << " ["
                                    << desc.rows << ", " << desc.cols << "] scale " << scale);
  const auto count = static_cast<std::size_t>(desc.rows * desc.cols);
  std::vector<std::uint8_t> want_rows(count), want_cols(count);
  float want_amax = 0.0f;
  quantize_host(desc, x.data(), scale, want_rows.data(), want_cols.data(), &want_amax);

  Stream stream;
  DeviceArray x_dev(x), scale_dev(sizeof(float)), amax_dev(sizeof(float)), rows_dev(count + 1), cols_dev(count + 1);
  SG_CUDA_CHECK(cudaMemcpy(scale_dev.get(), &scale, sizeof(float), cudaMemcpyHostToDevice));
  rows_dev.poison();
  cols_dev.poison();
  amax_dev.poison();
  launch_quantize(desc, x_dev.get(), static_cast<const float*>(scale_dev.get()),
                  static_cast<std::uint8_t*>(rows_dev.get()), static_cast<std::uint8_t*>(cols_dev.get()),
                  static_cast<float*>(amax_dev.get()), stream.get());
  stream.synchronize();
  std::vector<std::uint8_t> got_rows(count), got_cols(count);
  float got_amax = 0.0f;
  SG_CUDA_CHECK(cudaMemcpy(got_rows.data(), rows_dev.get(), count, cudaMemcpyDeviceToHost));
  SG_CUDA_CHECK(cudaMemcpy(got_cols.data(), cols_dev.get(), count, cudaMemcpyDeviceToHost));
  SG_CUDA_CHECK(cudaMemcpy(&got_amax, amax_dev.get(), sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(&got_amax, &want_amax, sizeof(float)), 0) << got_amax << " vs " << want_amax;
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_EQ(got_rows[i], want_rows[i]) << "row-wise byte " << i;
    ASSERT_EQ(got_cols[i], want_cols[i]) << "column-wise byte " << i;
  }
}

TEST(Fp8QuantizeTest, EqualsTheHostReferenceBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {64, 64}, {65, 130}, {200, 37}}) {
        const QuantizeDesc desc{dtype, format, rows, cols, true, true};
        const HostArray x = random_array(dtype, rows * cols, rng, -4.0f, 4.0f);
        // A scale that pushes some values past the format's range: saturation too.
        check_against_host(desc, x, 2.0f * fp8_max(format) / 4.0f);
        check_against_host(desc, x, 0.37f);
      }
    }
  }
}

TEST(Fp8QuantizeTest, NanMakesAmaxNanAndEmptyTensorsGiveZero) {
  SG_SKIP_WITHOUT_GPU();
  const QuantizeDesc desc{DType::kFloat32, Fp8Format::kE4M3, 3, 70, true, true};
  HostArray x(DType::kFloat32, desc.rows * desc.cols);
  for (std::int64_t i = 0; i < desc.rows * desc.cols; ++i) x.set(i, 0.01f * static_cast<float>(i));
  x.set(100, NAN);
  check_against_host(desc, x, 1.0f);
  check_against_host({DType::kBFloat16, Fp8Format::kE5M2, 0, 16, true, true}, HostArray(DType::kBFloat16, 0), 1.0f);
}

}  // namespace
}  // namespace stepgraph::kernels
