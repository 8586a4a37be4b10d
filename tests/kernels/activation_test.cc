// GeLU (tanh) forward/backward and the residual add. CPU: the host references
// against double-precision formulas and finite differences, and the argument
// checks (launchers reject before launching). GPU: every kernel against the
// host reference per dtype and size class (sizes that leave a scalar tail,
// sizes beyond one grid-stride pass), NaN-poisoned outputs, fresh random
// inputs, and the residual add in place.
#include "kernels/activation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::expect_invalid_argument;
using testing::floats;
using testing::gelu_double;
using testing::gelu_grad_double;
using testing::HostArray;
using testing::random_array;
using testing::relative_error;
using testing::tolerance_for;

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;
constexpr DType kFp32 = DType::kFloat32;

// ---------------------------------------------------------------------------
// Host references (no GPU needed).

TEST(ActivationTest, GeluFp32HostForwardMatchesFormula) {
  testing::SeededRng rng;
  HostArray x = random_array(kFp32, 4096, rng, -6.0f, 6.0f);
  x.set(0, 0.0f);
  x.set(1, 20.0f);
  x.set(2, -20.0f);
  HostArray y(kFp32, x.numel);
  host::gelu_forward(kFp32, x.data(), y.data(), x.numel);
  std::vector<float> want(x.numel);
  for (std::int64_t i = 0; i < x.numel; ++i) want[i] = static_cast<float>(gelu_double(x.get(i)));
  const std::vector<float> got = y.to_floats();
  EXPECT_LE(relative_error(got, want), 1e-6);
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 3), (std::vector<float>{0.0f, 20.0f, 0.0f}));
}

TEST(ActivationTest, GeluBf16HostForwardRoundsLikeTheDType) {
  testing::SeededRng rng;
  const HostArray x = random_array(kBf16, 1000, rng, -4.0f, 4.0f);
  HostArray y(kBf16, x.numel);
  host::gelu_forward(kBf16, x.data(), y.data(), x.numel);
  HostArray want(kBf16, x.numel);
  for (std::int64_t i = 0; i < x.numel; ++i) want.set(i, static_cast<float>(gelu_double(x.get(i))));
  EXPECT_LE(relative_error(y.to_floats(), want.to_floats()), tolerance_for(kBf16));
}

TEST(ActivationTest, GeluFp32HostBackwardMatchesFormulaAndFiniteDifferences) {
  testing::SeededRng rng;
  const std::int64_t n = 257;
  const HostArray x = random_array(kFp32, n, rng, -4.0f, 4.0f);
  const HostArray dy = random_array(kFp32, n, rng, -1.0f, 1.0f);
  HostArray dx(kFp32, n);
  host::gelu_backward(kFp32, dy.data(), x.data(), dx.data(), n);

  std::vector<float> formula(n), finite(n);
  constexpr float kStep = 1e-2f;
  for (std::int64_t i = 0; i < n; ++i) {
    formula[i] = static_cast<float>(dy.get(i) * gelu_grad_double(x.get(i)));
    // Central difference of the fp32 host forward at the fp32 points evaluated.
    HostArray points(kFp32, 2);
    points.set(0, x.get(i) + kStep);
    points.set(1, x.get(i) - kStep);
    HostArray values(kFp32, 2);
    host::gelu_forward(kFp32, points.data(), values.data(), 2);
    finite[i] = static_cast<float>(dy.get(i) * (static_cast<double>(values.get(0)) - values.get(1)) /
                                   (static_cast<double>(points.get(0)) - points.get(1)));
  }
  EXPECT_LE(relative_error(dx.to_floats(), formula), 1e-5);
  EXPECT_LT(relative_error(dx.to_floats(), finite), 1e-3);
}

TEST(ActivationTest, GeluFp32HostBackwardIsFiniteForHugeInputs) {
  const HostArray x = floats({1e30f, -1e30f, 30.0f, -30.0f});
  const HostArray dy = floats({2.0f, 2.0f, 2.0f, 2.0f});
  HostArray dx(kFp32, 4);
  host::gelu_backward(kFp32, dy.data(), x.data(), dx.data(), 4);
  EXPECT_EQ(dx.to_floats(), (std::vector<float>{2.0f, 0.0f, 2.0f, 0.0f}));
}

TEST(ActivationTest, ResidualAddFp16HostRoundsTheSum) {
  testing::SeededRng rng;
  const HostArray a = random_array(kFp16, 999, rng, -100.0f, 100.0f);
  const HostArray b = random_array(kFp16, 999, rng, -100.0f, 100.0f);
  HostArray out(kFp16, 999);
  host::residual_add(kFp16, a.data(), b.data(), out.data(), 999);
  for (std::int64_t i = 0; i < 999; ++i) {
    HostArray one(kFp16, 1);
    one.set(0, static_cast<float>(static_cast<double>(a.get(i)) + b.get(i)));
    ASSERT_EQ(out.get(i), one.get(0)) << "element " << i;
  }
}

// ---------------------------------------------------------------------------
// Argument checks (no GPU needed): stand-in addresses, never dereferenced.

TEST(ActivationTest, LaunchersRejectBadArgumentsBeforeLaunching) {
  void* p = reinterpret_cast<void*>(std::uintptr_t{0x10000});
  void* bad = reinterpret_cast<void*>(std::uintptr_t{0x10004});
  expect_invalid_argument([&] { launch_gelu_forward(kBf16, nullptr, p, 8, nullptr); }, "x is null");
  expect_invalid_argument([&] { launch_gelu_forward(kBf16, p, nullptr, 8, nullptr); }, "y is null");
  expect_invalid_argument([&] { launch_gelu_forward(kBf16, bad, p, 8, nullptr); }, "16-byte aligned");
  expect_invalid_argument([&] { launch_gelu_forward(kFp32, p, bad, 3, nullptr); }, "16-byte aligned");
  expect_invalid_argument([&] { launch_gelu_backward(kFp16, nullptr, p, p, 8, nullptr); }, "dy is null");
  expect_invalid_argument([&] { launch_gelu_backward(kFp16, p, nullptr, p, 8, nullptr); }, "x is null");
  expect_invalid_argument([&] { launch_gelu_backward(kFp16, p, p, nullptr, 8, nullptr); }, "dx is null");
  expect_invalid_argument([&] { launch_gelu_backward(kFp16, p, bad, p, 8, nullptr); }, "16-byte aligned");
  expect_invalid_argument([&] { launch_residual_add(kFp32, nullptr, p, p, 8, nullptr); }, "a is null");
  expect_invalid_argument([&] { launch_residual_add(kFp32, p, nullptr, p, 8, nullptr); }, "b is null");
  expect_invalid_argument([&] { launch_residual_add(kFp32, p, p, nullptr, 8, nullptr); }, "out is null");
  expect_invalid_argument([&] { launch_residual_add(kFp32, p, p, bad, 8, nullptr); }, "16-byte aligned");
  expect_invalid_argument([&] { launch_residual_add(kFp32, p, p, p, -1, nullptr); }, ">= 0");
  for (DType dtype : {DType::kInt32, DType::kInt64, DType::kFloat8E4M3}) {
    expect_invalid_argument([&] { launch_gelu_forward(dtype, p, p, 8, nullptr); }, "not supported");
    expect_invalid_argument([&] { launch_residual_add(dtype, p, p, p, 0, nullptr); }, "not supported");
  }
  // Nothing to do: no pointer is touched, so null ones are fine.
  EXPECT_NO_THROW(launch_gelu_forward(kBf16, nullptr, nullptr, 0, nullptr));
  EXPECT_NO_THROW(launch_residual_add(kFp16, nullptr, nullptr, nullptr, 0, nullptr));
}

TEST(ActivationTest, HostReferencesRejectBadArguments) {
  expect_invalid_argument([] { host::gelu_forward(DType::kInt32, nullptr, nullptr, 0); }, "not supported");
  expect_invalid_argument([] { host::gelu_backward(kFp32, nullptr, nullptr, nullptr, 4); }, "null");
  expect_invalid_argument([] { host::residual_add(kFp32, nullptr, nullptr, nullptr, -2); }, ">= 0");
}

// ---------------------------------------------------------------------------
// Device against host (GPU).

enum class Op { kGeluForward, kGeluBackward, kResidualAdd };

HostArray run_on_host(Op op, DType dtype, const HostArray& a, const HostArray& b) {
  HostArray out(dtype, a.numel);
  switch (op) {
    case Op::kGeluForward: host::gelu_forward(dtype, a.data(), out.data(), a.numel); break;
    case Op::kGeluBackward: host::gelu_backward(dtype, a.data(), b.data(), out.data(), a.numel); break;
    case Op::kResidualAdd: host::residual_add(dtype, a.data(), b.data(), out.data(), a.numel); break;
  }
  return out;
}

void launch_on_device(Op op, DType dtype, const void* a, const void* b, void* out, std::int64_t n,
                      cudaStream_t stream) {
  switch (op) {
    case Op::kGeluForward: launch_gelu_forward(dtype, a, out, n, stream); break;
    case Op::kGeluBackward: launch_gelu_backward(dtype, a, b, out, n, stream); break;
    case Op::kResidualAdd: launch_residual_add(dtype, a, b, out, n, stream); break;
  }
}

// What the rounding error of each element grows with: the sizes of the terms
// the formula adds, not the result. GELU's derivative is
// 0.5 (1 + t) + 0.5 x (1 - t^2) u'; for x below about -3, t is -1 to within a
// few ulps, so 1 + t and 1 - t^2 are rounding noise of size 1 and the tiny
// result has no correct digits on either side (seed 3474425500 drew three such
// elements). Empty: the result itself.
std::vector<float> error_scale(Op op, const HostArray& a, const HostArray& b) {
  if (op != Op::kGeluBackward) return {};
  const double k = std::sqrt(2.0 / 3.14159265358979323846);
  std::vector<float> scale(static_cast<std::size_t>(a.numel));
  for (std::int64_t i = 0; i < a.numel; ++i) {
    const double x = b.get(i);
    const double t = std::tanh(k * (x + 0.044715 * x * x * x));
    const double du = k * (1.0 + 3 * 0.044715 * x * x);
    scale[i] = static_cast<float>(std::fabs(a.get(i)) * (0.5 * (1 + std::fabs(t)) + 0.5 * std::fabs(x) * (1 + t * t) * du));
  }
  return scale;
}

// a = x (forward) or dy (backward) or the first addend; b = x (backward) or
// the second addend.
void check_on_device(Op op, DType dtype, std::int64_t n) {
  testing::SeededRng rng;
  SCOPED_TRACE("n " + std::to_string(n));
  const HostArray a = random_array(dtype, n, rng, -5.0f, 5.0f);
  const HostArray b = random_array(dtype, n, rng, -5.0f, 5.0f);
  const HostArray want = run_on_host(op, dtype, a, b);

  DeviceArray da(a), db(b), out(a.bytes.size());
  out.poison();
  Stream stream;
  launch_on_device(op, dtype, da.get(), db.get(), out.get(), n, stream.get());
  stream.synchronize();
  EXPECT_LE(relative_error(out.download(dtype, n).to_floats(), want.to_floats(), error_scale(op, a, b)),
            tolerance_for(dtype));
}

// Size classes: Tiny (under one 16-byte vector: tail only), Ragged (vectors
// and a tail), Large (more vectors than one pass of the bounded grid covers).
constexpr std::int64_t kTiny = 3;
constexpr std::int64_t kRagged = 1027;
constexpr std::int64_t kLarge = 3'000'001;

// ActivationTest.<Op><DType><Size>, e.g. ActivationTest.GeluForwardBf16Ragged.
#define SG_ACTIVATION_DEVICE_TESTS(Name, Type)      \
  TEST(ActivationTest, Name##Type##Tiny) {          \
    SG_SKIP_WITHOUT_GPU();                          \
    check_on_device(Op::k##Name, k##Type, kTiny);   \
  }                                                 \
  TEST(ActivationTest, Name##Type##Ragged) {        \
    SG_SKIP_WITHOUT_GPU();                          \
    check_on_device(Op::k##Name, k##Type, kRagged); \
  }                                                 \
  TEST(ActivationTest, Name##Type##Large) {         \
    SG_SKIP_WITHOUT_GPU();                          \
    check_on_device(Op::k##Name, k##Type, kLarge);  \
  }

SG_ACTIVATION_DEVICE_TESTS(GeluForward, Bf16)
SG_ACTIVATION_DEVICE_TESTS(GeluForward, Fp16)
SG_ACTIVATION_DEVICE_TESTS(GeluForward, Fp32)
SG_ACTIVATION_DEVICE_TESTS(GeluBackward, Bf16)
SG_ACTIVATION_DEVICE_TESTS(GeluBackward, Fp16)
SG_ACTIVATION_DEVICE_TESTS(GeluBackward, Fp32)
SG_ACTIVATION_DEVICE_TESTS(ResidualAdd, Bf16)
SG_ACTIVATION_DEVICE_TESTS(ResidualAdd, Fp16)
SG_ACTIVATION_DEVICE_TESTS(ResidualAdd, Fp32)

// out aliasing either input: each element is read before it is written.
void check_residual_add_in_place(DType dtype) {
  const std::int64_t n = kRagged;
  testing::SeededRng rng;
  const HostArray a = random_array(dtype, n, rng, -5.0f, 5.0f);
  const HostArray b = random_array(dtype, n, rng, -5.0f, 5.0f);
  const HostArray want = run_on_host(Op::kResidualAdd, dtype, a, b);
  Stream stream;
  {
    DeviceArray da(a), db(b);
    launch_residual_add(dtype, da.get(), db.get(), da.get(), n, stream.get());  // out = a
    stream.synchronize();
    EXPECT_LE(relative_error(da.download(dtype, n).to_floats(), want.to_floats()), tolerance_for(dtype));
  }
  {
    DeviceArray da(a), db(b);
    launch_residual_add(dtype, da.get(), db.get(), db.get(), n, stream.get());  // out = b
    stream.synchronize();
    EXPECT_LE(relative_error(db.download(dtype, n).to_floats(), want.to_floats()), tolerance_for(dtype));
  }
}

TEST(ActivationTest, ResidualAddBf16InPlace) {
  SG_SKIP_WITHOUT_GPU();
  check_residual_add_in_place(kBf16);
}

TEST(ActivationTest, ResidualAddFp16InPlace) {
  SG_SKIP_WITHOUT_GPU();
  check_residual_add_in_place(kFp16);
}

TEST(ActivationTest, ResidualAddFp32InPlace) {
  SG_SKIP_WITHOUT_GPU();
  check_residual_add_in_place(kFp32);
}

TEST(ActivationTest, GeluBackwardFp32IsFiniteForHugeInputsOnDevice) {
  SG_SKIP_WITHOUT_GPU();
  const HostArray x = floats({1e30f, -1e30f, 30.0f, -30.0f, 1e30f, -1e30f});  // 4 vectorized, 2 in the tail
  const HostArray dy = floats({2.0f, 2.0f, 2.0f, 2.0f, 2.0f, 2.0f});
  DeviceArray dx_(x), ddy(dy), out(x.bytes.size());
  out.poison();
  Stream stream;
  launch_gelu_backward(kFp32, ddy.get(), dx_.get(), out.get(), x.numel, stream.get());
  stream.synchronize();
  const std::vector<float> got = out.download(kFp32, x.numel).to_floats();
  EXPECT_EQ(got, (std::vector<float>{2.0f, 0.0f, 2.0f, 0.0f, 2.0f, 0.0f}));
}

}  // namespace
}  // namespace stepgraph::kernels
