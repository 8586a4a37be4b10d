// The fused FP8 kernels (kernels/fp8_fused.h). Host tests (run everywhere):
// each host reference equals its op's host reference followed by an FP8
// conversion written out here element by element (row-wise, column-wise,
// amax), the amax-only mode, empty tensors, NaN, and the argument errors.
// GPU tests (skip without a GPU): each CUDA kernel against the unfused
// sequence on the device (the op's kernel, then launch_quantize) bit for bit
// on the 16-bit output, the FP8 bytes and amax, and against quantize_host run
// on the device's 16-bit output, on random shapes (odd rows, rows off the
// 64-row tile, bf16/fp16, E4M3/E5M2, with and without the column-wise copy
// and the 16-bit output, amax alone).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/fp8.h"
#include "engine/stream.h"
#include "kernels/activation.h"
#include "kernels/fp8_fused.h"
#include "kernels/fp8_quantize.h"
#include "kernels/norm.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::HostArray;
using testing::random_array;
using testing::same_amax;
using testing::SeededRng;

constexpr DType kDtypes[] = {DType::kBFloat16, DType::kFloat16};
constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3, Fp8Format::kE5M2};

// The FP8 result of a [rows, cols] tensor, on the host.
struct Fp8Result {
  std::vector<std::uint8_t> rowwise;
  std::vector<std::uint8_t> columnwise;
  float amax = -1.0f;

  Fp8Result(std::int64_t rows, std::int64_t cols)
      : rowwise(static_cast<std::size_t>(rows * cols)), columnwise(static_cast<std::size_t>(rows * cols)) {}
  Fp8Copies copies(Fp8Format format, const float* scale, bool columnwise_copy) {
    return {format, scale, rowwise.data(), columnwise_copy ? columnwise.data() : nullptr, &amax};
  }
};

// What the contract says, written out: fp8(v * scale) element by element, its
// transpose, and max |v| with NaN winning.
Fp8Result by_hand(const HostArray& v, std::int64_t rows, std::int64_t cols, Fp8Format format, float scale) {
  Fp8Result out(rows, cols);
  out.amax = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const float value = v.get(r * cols + c);
      out.amax = (std::isnan(value) || std::isnan(out.amax)) ? NAN : std::max(out.amax, std::fabs(value));
      out.rowwise[r * cols + c] = float_to_fp8(format, value * scale);
      out.columnwise[c * rows + r] = out.rowwise[r * cols + c];
    }
  }
  return out;
}

void expect_same(const Fp8Result& got, const Fp8Result& want, bool columnwise) {
  EXPECT_TRUE(same_amax(got.amax, want.amax)) << got.amax << " vs " << want.amax;
  for (std::size_t i = 0; i < want.rowwise.size(); ++i) {
    ASSERT_EQ(got.rowwise[i], want.rowwise[i]) << "row-wise byte " << i;
    if (columnwise) { ASSERT_EQ(got.columnwise[i], want.columnwise[i]) << "column-wise byte " << i; }
  }
}

std::string describe(DType dtype, Fp8Format format, std::int64_t rows, std::int64_t cols, bool columnwise) {
  return std::string(dtype_name(dtype)) + " " + std::string(fp8_format_name(format)) + " [" + std::to_string(rows) +
         ", " + std::to_string(cols) + "]" + (columnwise ? " with q^T" : " row-wise only");
}

struct Shape {
  std::int64_t rows;
  std::int64_t cols;
};
// body(dtype, format, shape) for every 16-bit input type, FP8 format and
// shape of `shapes`, in that nesting.
template <std::size_t N, typename Body>
void for_each_case(const Shape (&shapes)[N], Body&& body) {
  for (const DType dtype : kDtypes) {
    for (const Fp8Format format : kFormats) {
      for (const Shape& shape : shapes) body(dtype, format, shape);
    }
  }
}

constexpr Shape kHostShapes[] = {{1, 16}, {3, 32}, {65, 48}, {130, 80}};

// ---------------------------------------------------------------------------
// Host references.

TEST(Fp8FusedHostTest, NormFp8EqualsNormThenQuantize_LayerNormRmsNorm_Bf16Fp16_E4m3E5m2) {
  SeededRng rng;
  for (const NormKind kind : {NormKind::kLayerNorm, NormKind::kRMSNorm}) {
    for_each_case(kHostShapes, [&](const DType dtype, const Fp8Format format, const Shape shape) {
      for (const bool columnwise : {false, true}) {
        SCOPED_TRACE(describe(dtype, format, shape.rows, shape.cols, columnwise));
        const NormDesc desc{kind, dtype, shape.rows, shape.cols, 1e-5f};
        const HostArray x = random_array(dtype, shape.rows * shape.cols, rng, -3.0f, 3.0f);
        const HostArray gamma = random_array(dtype, shape.cols, rng, 0.5f, 2.0f);
        const HostArray beta = random_array(dtype, shape.cols, rng, -1.0f, 1.0f);
        const float scale = fp8_max(format) / 4.0f;  // values past 4 saturate
        HostArray y(dtype, shape.rows * shape.cols), want_y(dtype, shape.rows * shape.cols);
        std::vector<float> mean(shape.rows), rstd(shape.rows), want_mean(shape.rows), want_rstd(shape.rows);
        Fp8Result got(shape.rows, shape.cols);
        host::norm_fp8(desc, x.data(), gamma.data(), beta.data(), y.data(), mean.data(), rstd.data(),
                       got.copies(format, &scale, columnwise));
        host::norm_forward(desc, x.data(), gamma.data(), beta.data(), want_y.data(), want_mean.data(),
                           want_rstd.data());
        EXPECT_EQ(y.bytes, want_y.bytes);
        EXPECT_EQ(rstd, want_rstd);
        if (kind == NormKind::kLayerNorm) {
          EXPECT_EQ(mean, want_mean);
        }
        expect_same(got, by_hand(want_y, shape.rows, shape.cols, format, scale), columnwise);
        // Without the 16-bit output: the same bytes.
        Fp8Result no_y(shape.rows, shape.cols);
        host::norm_fp8(desc, x.data(), gamma.data(), beta.data(), nullptr, mean.data(), rstd.data(),
                       no_y.copies(format, &scale, columnwise));
        expect_same(no_y, got, columnwise);
      }
    });
  }
}

// GeLU (one input) or its backward (two), as the host reference and as the
// op's host reference alone.
struct MapCase {
  const char* name;
  std::function<void(DType, std::int64_t, std::int64_t, const void*, const void*, void*, const Fp8Copies&)> fused;
  std::function<void(DType, const void*, const void*, void*, std::int64_t)> op;
};

std::vector<MapCase> host_map_cases() {
  return {{"gelu",
           [](DType d, std::int64_t r, std::int64_t c, const void*, const void* pre, void* out, const Fp8Copies& o) {
             host::gelu_fp8(d, r, c, pre, out, o);
           },
           [](DType d, const void*, const void* pre, void* out, std::int64_t n) { host::gelu_forward(d, pre, out, n); }},
          {"dgelu",
           [](DType d, std::int64_t r, std::int64_t c, const void* dact, const void* pre, void* out,
              const Fp8Copies& o) { host::dgelu_fp8(d, r, c, dact, pre, out, o); },
           [](DType d, const void* dact, const void* pre, void* out, std::int64_t n) {
             host::gelu_backward(d, dact, pre, out, n);
           }}};
}

TEST(Fp8FusedHostTest, GeluAndDgeluFp8EqualOpThenQuantize_Bf16Fp16_E4m3E5m2) {
  SeededRng rng;
  for (const MapCase& op : host_map_cases()) {
    for_each_case(kHostShapes, [&](const DType dtype, const Fp8Format format, const Shape shape) {
      for (const bool columnwise : {false, true}) {
        SCOPED_TRACE(std::string(op.name) + " " + describe(dtype, format, shape.rows, shape.cols, columnwise));
        const std::int64_t n = shape.rows * shape.cols;
        const HostArray pre = random_array(dtype, n, rng, -6.0f, 6.0f);
        const HostArray dact = random_array(dtype, n, rng, -3.0f, 3.0f);
        const float scale = fp8_max(format) / 2.0f;
        HostArray out16(dtype, n), want16(dtype, n);
        Fp8Result got(shape.rows, shape.cols);
        op.fused(dtype, shape.rows, shape.cols, dact.data(), pre.data(), out16.data(),
                 got.copies(format, &scale, columnwise));
        op.op(dtype, dact.data(), pre.data(), want16.data(), n);
        EXPECT_EQ(out16.bytes, want16.bytes);
        expect_same(got, by_hand(want16, shape.rows, shape.cols, format, scale), columnwise);
        // Amax alone: no scale, no copies.
        float amax = -1.0f;
        op.fused(dtype, shape.rows, shape.cols, dact.data(), pre.data(), nullptr,
                 {format, nullptr, nullptr, nullptr, &amax});
        EXPECT_TRUE(same_amax(amax, got.amax)) << amax << " vs " << got.amax;
      }
    });
  }
}

TEST(Fp8FusedHostTest, EmptyTensorsGiveZeroAmaxAndNanGivesNan) {
  const float scale = 1.0f;
  for (const MapCase& op : host_map_cases()) {
    SCOPED_TRACE(op.name);
    float amax = -1.0f;
    op.fused(DType::kBFloat16, 0, 64, nullptr, nullptr, nullptr, {Fp8Format::kE4M3, &scale, nullptr, nullptr, &amax});
    EXPECT_EQ(amax, 0.0f);
    HostArray pre(DType::kFloat16, 2 * 16), dact(DType::kFloat16, 2 * 16);
    for (std::int64_t i = 0; i < 32; ++i) {
      pre.set(i, 0.1f * static_cast<float>(i));
      dact.set(i, 1.0f);
    }
    pre.set(17, NAN);
    Fp8Result got(2, 16);
    op.fused(DType::kFloat16, 2, 16, dact.data(), pre.data(), nullptr, got.copies(Fp8Format::kE5M2, &scale, true));
    EXPECT_TRUE(std::isnan(got.amax)) << got.amax;
  }
  const NormDesc desc{NormKind::kLayerNorm, DType::kBFloat16, 0, 32, 1e-5f};
  float amax = -1.0f;
  host::norm_fp8(desc, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                 {Fp8Format::kE4M3, &scale, nullptr, nullptr, &amax});
  EXPECT_EQ(amax, 0.0f);
}

TEST(Fp8FusedHostTest, BadArgumentsRaiseErrorsNamingTheProblem) {
  float amax = 0.0f;
  const float scale = 1.0f;
  std::uint8_t byte = 0;
  const Fp8Copies ok{Fp8Format::kE4M3, &scale, &byte, nullptr, &amax};
  EXPECT_ERROR_CONTAINS(check_fp8_fused("gelu_fp8", DType::kFloat32, 2, 16, ok), "gelu_fp8", "fp32", "bf16 or fp16");
  EXPECT_ERROR_CONTAINS(check_fp8_fused("gelu_fp8", DType::kInt32, 2, 16, ok), "int32");
  EXPECT_ERROR_CONTAINS(check_fp8_fused("dgelu_fp8", DType::kBFloat16, -1, 16, ok), "dgelu_fp8", ">= 0", "[-1, 16]");
  EXPECT_ERROR_CONTAINS(check_fp8_fused("gelu_fp8", DType::kBFloat16, 3, 20, ok), "multiple of 16", "[3, 20]");
  EXPECT_ERROR_CONTAINS(check_fp8_fused("gelu_fp8", DType::kBFloat16, 3, 16, {Fp8Format::kE4M3, &scale}), "amax is null");
  EXPECT_ERROR_CONTAINS(
      check_fp8_fused("gelu_fp8", DType::kBFloat16, 3, 16, {Fp8Format::kE4M3, nullptr, &byte, nullptr, &amax}),
      "without a scale");
  // The norm: check_norm's errors, and q^T needs q.
  EXPECT_ERROR_CONTAINS(check_norm_fp8({NormKind::kRMSNorm, DType::kBFloat16, 4, 32, 0.0f}, ok), "eps");
  EXPECT_ERROR_CONTAINS(check_norm_fp8({NormKind::kRMSNorm, DType::kBFloat16, 4, 24, 1e-5f}, ok), "rmsnorm_fp8",
                        "multiple of 16");
  EXPECT_ERROR_CONTAINS(check_norm_fp8({NormKind::kLayerNorm, DType::kFloat16, 4, 32, 1e-5f},
                                       {Fp8Format::kE4M3, &scale, nullptr, &byte, &amax}),
                        "layernorm_fp8", "rowwise");
  // The launchers check before touching the device (these run without a GPU).
  EXPECT_ERROR_CONTAINS(launch_gelu_fp8(DType::kFloat32, 2, 16, &byte, nullptr, ok, nullptr), "gelu_fp8", "fp32");
  EXPECT_ERROR_CONTAINS(launch_dgelu_fp8(DType::kBFloat16, 2, 16, nullptr, &byte, nullptr, ok, nullptr), "dgelu_fp8",
                        "dact is null");
  EXPECT_ERROR_CONTAINS(launch_norm_fp8({NormKind::kLayerNorm, DType::kBFloat16, 2, 40, 1e-5f}, &byte, &byte, &byte,
                                        nullptr, &amax, &amax, ok, nullptr),
                        "layernorm_fp8", "[2, 40]");
  // Host references: null inputs.
  EXPECT_ERROR_CONTAINS(host::gelu_fp8(DType::kBFloat16, 2, 16, nullptr, nullptr, ok), "null");
}

// ---------------------------------------------------------------------------
// CUDA kernels against the unfused sequence on the device and quantize_host.

// The FP8 outputs of one launch, on the device; amax poisoned first.
struct DeviceFp8 {
  DeviceArray scale{sizeof(float)};
  DeviceArray rowwise;
  DeviceArray columnwise;
  DeviceArray amax{sizeof(float)};
  std::int64_t rows;
  std::int64_t cols;

  DeviceFp8(std::int64_t r, std::int64_t c, float scale_value)
      : rowwise(static_cast<std::size_t>(r * c)), columnwise(static_cast<std::size_t>(r * c)), rows(r), cols(c) {
    SG_CUDA_CHECK(cudaMemcpy(scale.get(), &scale_value, sizeof(float), cudaMemcpyHostToDevice));
    rowwise.poison();
    columnwise.poison();
    amax.poison();
  }
  Fp8Copies copies(Fp8Format format, bool columnwise_copy, bool amax_only = false) const {
    if (amax_only) return {format, nullptr, nullptr, nullptr, amax.as<float>()};
    return {format, scale.as<const float>(), rowwise.as<std::uint8_t>(),
            columnwise_copy ? columnwise.as<std::uint8_t>() : nullptr, amax.as<float>()};
  }
  Fp8Result download() const {
    SG_CUDA_CHECK(cudaDeviceSynchronize());
    Fp8Result out(rows, cols);
    SG_CUDA_CHECK(cudaMemcpy(out.rowwise.data(), rowwise.get(), out.rowwise.size(), cudaMemcpyDeviceToHost));
    SG_CUDA_CHECK(cudaMemcpy(out.columnwise.data(), columnwise.get(), out.columnwise.size(), cudaMemcpyDeviceToHost));
    SG_CUDA_CHECK(cudaMemcpy(&out.amax, amax.get(), sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  }
};

// One fused kernel: launch(out16 or null, copies) against unfused(out16) then
// launch_quantize, and against quantize_host on the unfused 16-bit output.
// compare_extra checks the norm's statistics.
using FusedLaunch = std::function<void(void* out16, const Fp8Copies& copies)>;
using UnfusedLaunch = std::function<void(void* out16)>;

void check_fused_on_device(DType dtype, Fp8Format format, std::int64_t rows, std::int64_t cols, float scale,
                           const FusedLaunch& fused, const UnfusedLaunch& unfused, cudaStream_t stream) {
  const std::int64_t n = rows * cols;
  // Unfused: the op's kernel, then the tensor-wise quantize with both copies.
  DeviceArray want16(static_cast<std::size_t>(n) * 2);
  DeviceFp8 want(rows, cols, scale);
  unfused(want16.get());
  launch_quantize({dtype, format, rows, cols, true, true}, want16.get(), want.scale.as<const float>(),
                  want.rowwise.as<std::uint8_t>(), want.columnwise.as<std::uint8_t>(), want.amax.as<float>(), stream);
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Fp8Result want_fp8 = want.download();
  const HostArray want16_host = want16.download(dtype, n);
  // The host reference of the quantize step on the device's 16-bit values.
  Fp8Result host_fp8(rows, cols);
  quantize_host({dtype, format, rows, cols, true, true}, want16_host.data(), scale, host_fp8.rowwise.data(),
                host_fp8.columnwise.data(), &host_fp8.amax);
  expect_same(want_fp8, host_fp8, true);

  for (const bool columnwise : {false, true}) {
    for (const bool write16 : {false, true}) {
      SCOPED_TRACE(describe(dtype, format, rows, cols, columnwise) + (write16 ? " with" : " without") +
                   " the 16-bit output");
      DeviceArray got16(static_cast<std::size_t>(n) * 2);
      got16.poison();
      DeviceFp8 got(rows, cols, scale);
      fused(write16 ? got16.get() : nullptr, got.copies(format, columnwise));
      SG_CUDA_CHECK(cudaStreamSynchronize(stream));
      expect_same(got.download(), host_fp8, columnwise);
      if (write16) { EXPECT_EQ(got16.download(dtype, n).bytes, want16_host.bytes); }
    }
  }
  // Amax alone (current scaling's first pass).
  DeviceFp8 alone(rows, cols, scale);
  fused(nullptr, alone.copies(format, false, /*amax_only=*/true));
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const float amax = alone.download().amax;
  EXPECT_TRUE(same_amax(amax, host_fp8.amax)) << "amax alone: " << amax << " vs " << host_fp8.amax;
}

// Odd rows, rows off the 64-row tile, cols off the 64-column tile, a GEMM-sized row.
constexpr Shape kDeviceShapes[] = {{1, 16}, {7, 48}, {64, 64}, {129, 208}, {333, 1040}, {70, 4096}};

TEST(Fp8FusedTest, GeluAndDgeluFp8EqualUnfusedBitForBit_Bf16Fp16_E4m3E5m2) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  Stream stream;
  for_each_case(kDeviceShapes, [&](const DType dtype, const Fp8Format format, const Shape shape) {
    const std::int64_t n = shape.rows * shape.cols;
    const HostArray pre = random_array(dtype, n, rng, -6.0f, 6.0f);
    const HostArray dact = random_array(dtype, n, rng, -3.0f, 3.0f);
    const DeviceArray pre_dev(pre), dact_dev(dact);
    const float scale = fp8_max(format) / 2.0f;
    {
      SCOPED_TRACE("gelu");
      check_fused_on_device(
          dtype, format, shape.rows, shape.cols, scale,
          [&](void* out16, const Fp8Copies& c) {
            launch_gelu_fp8(dtype, shape.rows, shape.cols, pre_dev.get(), out16, c, stream.get());
          },
          [&](void* out16) { launch_gelu_forward(dtype, pre_dev.get(), out16, n, stream.get()); }, stream.get());
    }
    {
      SCOPED_TRACE("dgelu");
      check_fused_on_device(
          dtype, format, shape.rows, shape.cols, scale,
          [&](void* out16, const Fp8Copies& c) {
            launch_dgelu_fp8(dtype, shape.rows, shape.cols, dact_dev.get(), pre_dev.get(), out16, c, stream.get());
          },
          [&](void* out16) { launch_gelu_backward(dtype, dact_dev.get(), pre_dev.get(), out16, n, stream.get()); },
          stream.get());
    }
  });
}

// The vectorised plain quantize (the identity through the tile kernel) against
// quantize_host on the same 16-bit input, with and without the column-wise
// copy, and amax alone; fp32 input and ragged columns are refused (false).
TEST(Fp8FusedTest, VectorizedQuantizeEqualsTheHostReferenceBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  Stream stream;
  for_each_case(kDeviceShapes, [&](const DType dtype, const Fp8Format format, const Shape shape) {
    SCOPED_TRACE(describe(dtype, format, shape.rows, shape.cols, true));
    const std::int64_t n = shape.rows * shape.cols;
    const HostArray x = random_array(dtype, n, rng, -6.0f, 6.0f);
    const DeviceArray x_dev(x);
    const float scale = fp8_max(format) / 8.0f;  // some values saturate
    Fp8Result want(shape.rows, shape.cols);
    quantize_host({dtype, format, shape.rows, shape.cols, true, true}, x.data(), scale, want.rowwise.data(),
                  want.columnwise.data(), &want.amax);
    for (const bool columnwise : {false, true}) {
      DeviceFp8 got(shape.rows, shape.cols, scale);
      ASSERT_TRUE(launch_quantize_vectorized(dtype, shape.rows, shape.cols, x_dev.get(), got.copies(format, columnwise),
                                             stream.get()));
      expect_same(got.download(), want, columnwise);
    }
    DeviceFp8 alone(shape.rows, shape.cols, scale);
    ASSERT_TRUE(launch_quantize_vectorized(dtype, shape.rows, shape.cols, x_dev.get(),
                                           alone.copies(format, false, /*amax_only=*/true), stream.get()));
    EXPECT_TRUE(same_amax(alone.download().amax, want.amax));
  });
  DeviceFp8 out(4, 24, 1.0f);
  EXPECT_FALSE(launch_quantize_vectorized(DType::kFloat32, 4, 16, out.rowwise.get(), out.copies(Fp8Format::kE4M3, false),
                                          stream.get()));
  EXPECT_FALSE(launch_quantize_vectorized(DType::kBFloat16, 4, 24, out.rowwise.get(),
                                          out.copies(Fp8Format::kE4M3, false), stream.get()));
}

TEST(Fp8FusedTest, NormFp8EqualsUnfusedBitForBit_LayerNormRmsNorm_Bf16Fp16_E4m3E5m2) {
  SG_SKIP_WITHOUT_GPU();
  SeededRng rng;
  Stream stream;
  for (const NormKind kind : {NormKind::kLayerNorm, NormKind::kRMSNorm}) {
    for_each_case(kDeviceShapes, [&](const DType dtype, const Fp8Format format, const Shape shape) {
      SCOPED_TRACE(kind == NormKind::kRMSNorm ? "rmsnorm" : "layernorm");
      const NormDesc desc{kind, dtype, shape.rows, shape.cols, 1e-5f};
      const DeviceArray x(random_array(dtype, shape.rows * shape.cols, rng, -3.0f, 3.0f));
      const DeviceArray gamma(random_array(dtype, shape.cols, rng, 0.5f, 2.0f));
      const DeviceArray beta(random_array(dtype, shape.cols, rng, -1.0f, 1.0f));
      DeviceArray mean(shape.rows * 4), rstd(shape.rows * 4), want_mean(shape.rows * 4), want_rstd(shape.rows * 4);
      const float scale = fp8_max(format) / 4.0f;
      auto stats = [&](const DeviceArray& d) { return d.download(DType::kFloat32, shape.rows).bytes; };
      check_fused_on_device(
          dtype, format, shape.rows, shape.cols, scale,
          [&](void* y, const Fp8Copies& c) {
            mean.poison();
            rstd.poison();
            launch_norm_fp8(desc, x.get(), gamma.get(), beta.get(), y, mean.as<float>(), rstd.as<float>(), c,
                            stream.get());
            SG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
            EXPECT_EQ(stats(rstd), stats(want_rstd)) << "rstd";
            if (kind == NormKind::kLayerNorm) {
              EXPECT_EQ(stats(mean), stats(want_mean)) << "mean";
            }
          },
          [&](void* y) {
            launch_norm_forward(desc, x.get(), gamma.get(), beta.get(), y, want_mean.as<float>(), want_rstd.as<float>(),
                                stream.get());
          },
          stream.get());
    });
  }
}

TEST(Fp8FusedTest, EmptyTensorsGiveZeroAmaxAndNanGivesNan) {
  SG_SKIP_WITHOUT_GPU();
  Stream stream;
  DeviceFp8 empty(0, 64, 1.0f);
  launch_gelu_fp8(DType::kBFloat16, 0, 64, nullptr, nullptr, empty.copies(Fp8Format::kE4M3, true), stream.get());
  EXPECT_EQ(empty.download().amax, 0.0f);
  DeviceFp8 empty_norm(0, 64, 1.0f);
  launch_norm_fp8({NormKind::kRMSNorm, DType::kBFloat16, 0, 64, 1e-5f}, nullptr, nullptr, nullptr, nullptr, nullptr,
                  nullptr, empty_norm.copies(Fp8Format::kE4M3, true), stream.get());
  EXPECT_EQ(empty_norm.download().amax, 0.0f);

  HostArray pre(DType::kBFloat16, 3 * 32);
  for (std::int64_t i = 0; i < pre.numel; ++i) pre.set(i, 0.05f * static_cast<float>(i));
  pre.set(40, NAN);
  const DeviceArray pre_dev(pre);
  DeviceFp8 got(3, 32, 1.0f);
  launch_dgelu_fp8(DType::kBFloat16, 3, 32, pre_dev.get(), pre_dev.get(), nullptr,
                   got.copies(Fp8Format::kE5M2, true), stream.get());
  EXPECT_TRUE(std::isnan(got.download().amax));
}

}  // namespace
}  // namespace stepgraph::kernels
