// The FP8 quantize kernels (kernels/fp8_quantize.cu) against their host
// references, bit for bit: tensor-wise (the row-wise and column-wise bytes
// and amax, fp32/bf16/fp16 inputs, both formats, shapes off the 64 x 64 tile
// grid, a NaN, values past the format's range) and block-scaled (1 x 128 and
// 128 x 128, the bytes and every scale_inv, an all-zero block, a non-finite
// block's flag).
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
using testing::same_amax;
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
  EXPECT_TRUE(same_amax(got_amax, want_amax)) << got_amax << " vs " << want_amax;
  // amax alone (current scaling's first pass) gives the same bits.
  launch_amax(desc.in_dtype, desc.rows, desc.cols, x_dev.get(), static_cast<float*>(amax_dev.get()), stream.get());
  stream.synchronize();
  float alone = 0.0f;
  SG_CUDA_CHECK(cudaMemcpy(&alone, amax_dev.get(), sizeof(float), cudaMemcpyDeviceToHost));
  const float want_alone = amax_host(desc.in_dtype, desc.rows, desc.cols, x.data());
  EXPECT_TRUE(same_amax(alone, want_alone)) << alone << " vs " << want_alone;
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

// Block quantize: bytes and scale_inv equal the host reference's, bit for bit.
void check_blocks_against_host(const QuantizeDesc& desc, BlockShape shape, bool power_of_two, const HostArray& x) {
  SCOPED_TRACE(::testing::Message() << dtype_name(desc.in_dtype) << " " << fp8_format_name(desc.format) << " ["
                                    << desc.rows << ", " << desc.cols << "] "
                                    << (shape == BlockShape::k1x128 ? "1x128" : "128x128")
                                    << (power_of_two ? " power-of-two" : ""));
  const auto count = static_cast<std::size_t>(desc.rows * desc.cols);
  const auto row_scales = static_cast<std::size_t>(BlockScaleLayout{shape, desc.rows, desc.cols}.count());
  const auto col_scales = static_cast<std::size_t>(BlockScaleLayout{shape, desc.cols, desc.rows}.count());
  std::vector<std::uint8_t> want_rows(count), want_cols(count);
  std::vector<float> want_row_scales(row_scales), want_col_scales(col_scales);
  ASSERT_TRUE(quantize_blocks_host(desc, shape, power_of_two, x.data(),
                                   {want_rows.data(), want_row_scales.data(), want_cols.data(), want_col_scales.data()}));
  Stream stream;
  DeviceArray x_dev(x), rows_dev(count), cols_dev(count), row_scales_dev(row_scales * 4), col_scales_dev(col_scales * 4),
      flag_dev(sizeof(int));
  rows_dev.poison();
  cols_dev.poison();
  launch_quantize_blocks(desc, shape, power_of_two, x_dev.get(),
                         {static_cast<std::uint8_t*>(rows_dev.get()), static_cast<float*>(row_scales_dev.get()),
                          static_cast<std::uint8_t*>(cols_dev.get()), static_cast<float*>(col_scales_dev.get())},
                         static_cast<int*>(flag_dev.get()), stream.get());
  stream.synchronize();
  std::vector<std::uint8_t> got_rows(count), got_cols(count);
  std::vector<float> got_row_scales(row_scales), got_col_scales(col_scales);
  int flag = -1;
  SG_CUDA_CHECK(cudaMemcpy(got_rows.data(), rows_dev.get(), count, cudaMemcpyDeviceToHost));
  SG_CUDA_CHECK(cudaMemcpy(got_cols.data(), cols_dev.get(), count, cudaMemcpyDeviceToHost));
  SG_CUDA_CHECK(cudaMemcpy(got_row_scales.data(), row_scales_dev.get(), row_scales * 4, cudaMemcpyDeviceToHost));
  SG_CUDA_CHECK(cudaMemcpy(got_col_scales.data(), col_scales_dev.get(), col_scales * 4, cudaMemcpyDeviceToHost));
  SG_CUDA_CHECK(cudaMemcpy(&flag, flag_dev.get(), sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(flag, 0);
  EXPECT_EQ(got_row_scales, want_row_scales);
  EXPECT_EQ(got_col_scales, want_col_scales);
  for (std::size_t i = 0; i < count; ++i) {  // the copies asked for
    if (desc.rowwise) {
      ASSERT_EQ(got_rows[i], want_rows[i]) << "row-wise byte " << i;
    }
    if (desc.columnwise) {
      ASSERT_EQ(got_cols[i], want_cols[i]) << "column-wise byte " << i;
    }
  }
}

TEST(Fp8QuantizeTest, BlockScalingEqualsTheHostReferenceBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  // A 1 x 128 row-wise copy of rows that end in a partial 128-row tile.
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const QuantizeDesc partial{dtype, Fp8Format::kE4M3, 200, 256, true, false};
    check_blocks_against_host(partial, BlockShape::k1x128, false,
                              random_array(dtype, partial.rows * partial.cols, rng, -3.0f, 3.0f));
  }
  for (const DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const QuantizeDesc desc{dtype, Fp8Format::kE4M3, 256, 384, true, true};
    HostArray x = random_array(dtype, desc.rows * desc.cols, rng, -2.0f, 2.0f);
    for (std::int64_t c = 0; c < 128; ++c) x.set(5 * desc.cols + c, 1000.0f * x.get(5 * desc.cols + c));
    for (std::int64_t c = 128; c < 256; ++c) x.set(7 * desc.cols + c, 0.0f);  // an all-zero block
    for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (const BlockShape shape : {BlockShape::k1x128, BlockShape::k128x128}) {
        for (const bool power_of_two : {true, false}) {
          QuantizeDesc d = desc;
          d.format = format;
          check_blocks_against_host(d, shape, power_of_two, x);
        }
      }
    }
  }
}

TEST(Fp8QuantizeTest, BlockWithANonFiniteValueSetsTheFlag) {
  SG_SKIP_WITHOUT_GPU();
  const QuantizeDesc desc{DType::kFloat32, Fp8Format::kE4M3, 2, 256, true, false};
  HostArray x(DType::kFloat32, desc.rows * desc.cols);
  for (std::int64_t i = 0; i < desc.rows * desc.cols; ++i) x.set(i, 1.0f);
  x.set(300, INFINITY);
  Stream stream;
  DeviceArray x_dev(x), q(512), scales(4 * 4), flag(sizeof(int));
  launch_quantize_blocks(desc, BlockShape::k1x128, true, x_dev.get(),
                         {static_cast<std::uint8_t*>(q.get()), static_cast<float*>(scales.get())},
                         static_cast<int*>(flag.get()), stream.get());
  stream.synchronize();
  int value = 0;
  SG_CUDA_CHECK(cudaMemcpy(&value, flag.get(), sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(value, 1);
}

// The scale updates on the device equal the host references bit for bit.
TEST(Fp8QuantizeTest, ScaleUpdatesEqualTheHostReferences) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  Stream stream;
  DeviceArray amax(4), scale(4), scale_inv(4), flag(4), history(4 * 1024);
  auto put = [](const DeviceArray& d, float v) { SG_CUDA_CHECK(cudaMemcpy(d.get(), &v, 4, cudaMemcpyHostToDevice)); };
  auto get = [](const DeviceArray& d) {
    float v = 0.0f;
    SG_CUDA_CHECK(cudaMemcpy(&v, d.get(), 4, cudaMemcpyDeviceToHost));
    return v;
  };
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  // Current scaling, every format and rounding, random amaxes and the edge cases.
  std::vector<float> amaxes{0.0f, 1e-40f, 448.0f, NAN, INFINITY};
  for (int i = 0; i < 50; ++i) amaxes.push_back(std::exp2(exponent(rng)));
  for (const Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const bool power_of_two : {false, true}) {
      for (const float a : amaxes) {
        put(amax, a);
        launch_scale_from_amax(static_cast<const float*>(amax.get()), format, power_of_two,
                               static_cast<float*>(scale.get()), static_cast<float*>(scale_inv.get()),
                               static_cast<int*>(flag.get()), stream.get());
        stream.synchronize();
        const bool ok = amax_is_usable(a);
        const float want = ok ? fp8_scale(a, format, 0, power_of_two) : 1.0f;
        EXPECT_EQ(get(scale), want) << a;
        EXPECT_EQ(get(scale_inv), 1.0f / want) << a;
      }
    }
  }
  // Delayed scaling: 200 steps of random amaxes (and a NaN) through a history of 1000.
  for (const AmaxReduction reduction : {AmaxReduction::kMax, AmaxReduction::kMostRecent}) {
    const Fp8Recipe recipe = Fp8Recipe::delayed(1000, reduction, 1);
    std::vector<float> want_history(1000, 0.0f);
    float want_scale = 1.0f, want_scale_inv = 1.0f;
    SG_CUDA_CHECK(cudaMemcpy(history.get(), want_history.data(), 4000, cudaMemcpyHostToDevice));
    put(scale, 1.0f);
    put(scale_inv, 1.0f);
    for (int step = 0; step < 200; ++step) {
      const float a = step == 77 ? NAN : std::exp2(exponent(rng) / 3.0f);
      put(amax, a);
      launch_delayed_scaling_update(recipe, Fp8Format::kE4M3, static_cast<const float*>(amax.get()),
                                    static_cast<float*>(history.get()), static_cast<float*>(scale.get()),
                                    static_cast<float*>(scale_inv.get()), static_cast<int*>(flag.get()),
                                    stream.get());
      stream.synchronize();
      delayed_scaling_update_host(recipe, Fp8Format::kE4M3, a, {want_history.data(), &want_scale, &want_scale_inv});
      ASSERT_EQ(get(scale), want_scale) << "step " << step;
      ASSERT_EQ(get(scale_inv), want_scale_inv) << "step " << step;
    }
    std::vector<float> got_history(1000);
    SG_CUDA_CHECK(cudaMemcpy(got_history.data(), history.get(), 4000, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got_history, want_history);
  }
}

}  // namespace
}  // namespace stepgraph::kernels
