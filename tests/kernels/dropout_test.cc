// Dropout from Philox on device state (kernels/dropout.h): the generator
// against Random123's known answers, the keep rate within binomial bounds,
// masks that repeat for the same state and offset (the backward) and change
// with either, kept elements scaled by 1 / (1 - p), and the CUDA kernel
// equal to the host reference bit for bit.
#include "kernels/dropout.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/half_precision.h"
#include "kernels/philox.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  const Philox4 zero = philox4x32_10(0, 0, 0);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  const Philox4 ones = philox4x32_10(~0ull, ~0ull, ~0ull);
  EXPECT_EQ(ones.v[0], 0x408f276du);
  EXPECT_EQ(ones.v[1], 0x41c83b0eu);
  EXPECT_EQ(ones.v[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.v[3], 0x6d5451fdu);
  const Philox4 pi = philox4x32_10(0x85a308d3243f6a88ull, 0x0370734413198a2eull, 0x299f31d0a4093822ull);
  EXPECT_EQ(pi.v[0], 0xd16cfe09u);
  EXPECT_EQ(pi.v[1], 0x94fdccebu);
  EXPECT_EQ(pi.v[2], 0x5001e420u);
  EXPECT_EQ(pi.v[3], 0x24126ea1u);
}

std::vector<float> run_host(const DropoutDesc& desc, const std::vector<float>& x, std::int64_t seed,
                            std::int64_t counter) {
  std::vector<float> y(x.size());
  const std::int64_t state[2] = {seed, counter};
  host::dropout(desc, x.data(), y.data(), state);
  return y;
}

TEST(DropoutHostTest, KeepRateIsBinomialAndKeptValuesAreScaled) {
  const testing::TestSeed seed;
  constexpr std::int64_t kCount = 1 << 20;
  const std::vector<float> x(kCount, 1.5f);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    const DropoutDesc desc{.count = kCount, .p = p, .dtype = DType::kFloat32};
    const std::vector<float> y = run_host(desc, x, seed.value(), 0);
    std::int64_t kept = 0;
    for (float v : y) {
      if (v != 0.0f) {
        ++kept;
        ASSERT_EQ(v, 1.5f * (1.0f / (1.0f - p))) << "p " << p;
      }
    }
    // Within 5 standard deviations of the binomial mean n (1 - p).
    const double mean = kCount * (1.0 - p);
    const double sigma = std::sqrt(kCount * p * (1.0 - p));
    EXPECT_NEAR(static_cast<double>(kept), mean, 5 * sigma) << "p " << p;
  }
}

TEST(DropoutHostTest, MasksRepeatForTheSameStateAndOffsetAndChangeWithEither) {
  const testing::TestSeed seed;
  constexpr std::int64_t kCount = 4099;  // not a multiple of four
  const std::vector<float> x(kCount, 1.0f);
  const DropoutDesc desc{.count = kCount, .p = 0.5f, .dtype = DType::kFloat32, .offset = 7};
  const std::vector<float> a = run_host(desc, x, seed.value(), 3);
  EXPECT_EQ(a, run_host(desc, x, seed.value(), 3));
  EXPECT_NE(a, run_host(desc, x, seed.value(), 4));
  EXPECT_NE(a, run_host(desc, x, seed.value() + 1, 3));
  DropoutDesc other = desc;
  other.offset = 8;
  EXPECT_NE(a, run_host(other, x, seed.value(), 3));
  // Offset and counter add: offset 8 at counter 3 is offset 7 at counter 4.
  EXPECT_EQ(run_host(other, x, seed.value(), 3), run_host(desc, x, seed.value(), 4));
}

TEST(DropoutHostTest, BadArgumentsAreErrors) {
  EXPECT_ERROR_CONTAINS(check_dropout({.count = 4, .p = 1.0f}), "p must be in [0, 1)");
  EXPECT_ERROR_CONTAINS(check_dropout({.count = 4, .p = -0.1f}), "p must be in [0, 1)");
  EXPECT_ERROR_CONTAINS(check_dropout({.count = 4, .p = 0.1f, .dtype = DType::kInt32}), "dtype");
  EXPECT_ERROR_CONTAINS(check_dropout({.count = 4, .p = 0.1f, .offset = -1}), "offset");
}

TEST(DropoutCudaTest, KernelEqualsHostReferenceBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    constexpr std::int64_t kCount = 300001;
    const DropoutDesc desc{.count = kCount, .p = 0.3f, .dtype = dtype, .offset = 12345};
    const testing::HostArray x = testing::random_array(dtype, kCount, rng);
    testing::HostArray want(dtype, kCount);
    const std::int64_t state[2] = {static_cast<std::int64_t>(rng()), 77};
    host::dropout(desc, x.data(), want.data(), state);
    testing::DeviceArray dx(x), dy(x.bytes.size()), dstate(sizeof(state));
    SG_CUDA_CHECK(cudaMemcpy(dstate.get(), state, sizeof(state), cudaMemcpyHostToDevice));
    launch_dropout(desc, dx.get(), dy.get(), dstate.as<std::int64_t>(), nullptr);
    SG_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(dy.download(dtype, kCount).bytes, want.bytes) << dtype_name(dtype);
    launch_rng_advance(dstate.as<std::int64_t>(), 5, nullptr);
    std::int64_t after[2] = {0, 0};
    SG_CUDA_CHECK(cudaMemcpy(after, dstate.get(), sizeof(after), cudaMemcpyDeviceToHost));
    EXPECT_EQ(after[0], state[0]);
    EXPECT_EQ(after[1], 82);
  }
}

}  // namespace
}  // namespace stepgraph::kernels
