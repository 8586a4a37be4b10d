// LayerNorm and RMSNorm. CPU: the host references against naive
// double-precision formulas and against central finite differences of the
// forward, and the argument checks (launchers reject before launching).
// GPU: every kernel against the host reference per dtype and shape class,
// with NaN-poisoned outputs, fresh random inputs, and bitwise-reproducible
// parameter gradients.
#include "kernels/norm.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::HostArray;
using testing::floats;
using testing::expect_invalid_argument;
using testing::random_array;
using testing::relative_error;
using testing::tolerance_for;

constexpr DType kBf16 = DType::kBFloat16;
constexpr DType kFp16 = DType::kFloat16;
constexpr DType kFp32 = DType::kFloat32;

NormDesc make_desc(NormKind kind, DType dtype, std::int64_t rows, std::int64_t hidden, float eps = 1e-5f) {
  return NormDesc{.kind = kind, .dtype = dtype, .rows = rows, .hidden = hidden, .eps = eps};
}

bool is_layer_norm(const NormDesc& desc) { return desc.kind == NormKind::kLayerNorm; }

// Random inputs of one norm problem, rounded to the dtype. x rows get a
// per-row offset so the mean matters.
struct NormInputs {
  HostArray x;
  HostArray gamma;
  HostArray beta;
  HostArray dy;
};

NormInputs random_inputs(const NormDesc& desc, std::mt19937& rng) {
  NormInputs in;
  const std::int64_t n = desc.rows * desc.hidden;
  in.x = random_array(desc.dtype, n, rng, -2.0f, 2.0f);
  std::uniform_real_distribution<float> offset(-1.0f, 1.0f);
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    const float shift = offset(rng);
    for (std::int64_t j = 0; j < desc.hidden; ++j) in.x.set(r * desc.hidden + j, in.x.get(r * desc.hidden + j) + shift);
  }
  in.gamma = random_array(desc.dtype, desc.hidden, rng, 0.5f, 1.5f);
  in.beta = random_array(desc.dtype, desc.hidden, rng, -0.5f, 0.5f);
  in.dy = random_array(desc.dtype, n, rng, -1.0f, 1.0f);
  return in;
}

// Host forward outputs.
struct ForwardResult {
  HostArray y;
  std::vector<float> mean;
  std::vector<float> rstd;
};

ForwardResult host_forward(const NormDesc& desc, const NormInputs& in) {
  ForwardResult out{HostArray(desc.dtype, desc.rows * desc.hidden), std::vector<float>(desc.rows),
                    std::vector<float>(desc.rows)};
  host::norm_forward(desc, in.x.data(), in.gamma.data(), in.beta.data(), out.y.data(), out.mean.data(),
                     out.rstd.data());
  return out;
}

// ---------------------------------------------------------------------------
// Argument checks (no GPU needed).

TEST(NormTest, CheckNormAcceptsSupportedShapes) {
  EXPECT_NO_THROW(check_norm(make_desc(NormKind::kLayerNorm, kBf16, 1, 8)));
  EXPECT_NO_THROW(check_norm(make_desc(NormKind::kRMSNorm, kFp16, 7, 4104)));
  EXPECT_NO_THROW(check_norm(make_desc(NormKind::kLayerNorm, kFp32, 3, 4)));
}

// Hidden sizes that are not a multiple of the 16-byte vector width take the
// element-wise path: valid for every dtype.
TEST(NormTest, CheckNormAcceptsAnyHidden) {
  for (DType dtype : {kBf16, kFp16, kFp32}) {
    for (std::int64_t hidden : {1, 4, 6, 13, 4097}) {
      EXPECT_NO_THROW(check_norm(make_desc(NormKind::kLayerNorm, dtype, 7, hidden)));
      EXPECT_NO_THROW(check_norm(make_desc(NormKind::kRMSNorm, dtype, 7, hidden)));
    }
  }
}

TEST(NormTest, CheckNormRejectsBadSizesEpsDTypeAndKind) {
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kLayerNorm, kBf16, 0, 8)); }, "rows");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kLayerNorm, kBf16, -3, 8)); }, "rows");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kLayerNorm, kBf16, 4, 0)); }, "hidden");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kLayerNorm, kBf16, 4, -8)); }, "hidden");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kLayerNorm, kBf16, 4, std::int64_t{1} << 31)); },
                          "too large");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kRMSNorm, kBf16, 4, 8, 0.0f)); }, "eps");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kRMSNorm, kBf16, 4, 8, -1e-5f)); }, "eps");
  expect_invalid_argument([] { check_norm(make_desc(NormKind::kRMSNorm, kBf16, 4, 8, std::nanf(""))); }, "eps");
  for (DType dtype : {DType::kInt32, DType::kInt64, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    expect_invalid_argument([&] { check_norm(make_desc(NormKind::kLayerNorm, dtype, 4, 64)); }, "not supported");
  }
  expect_invalid_argument([] { check_norm(make_desc(static_cast<NormKind>(7), kBf16, 4, 8)); }, "NormKind");
}

// Stand-in device addresses: the launchers must reject the arguments before
// any CUDA call, so these are never dereferenced.
void* fake_pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }
float* fake_floats(std::uintptr_t address) { return reinterpret_cast<float*>(address); }
constexpr std::uintptr_t kAligned = 0x10000;
// Not 16-byte aligned (fine for the data, which then takes the element-wise
// path, but not for the backward workspace), and an odd address: no whole
// elements of any dtype.
constexpr std::uintptr_t kMisaligned = 0x10008;
constexpr std::uintptr_t kOdd = 0x10001;

TEST(NormTest, ForwardLauncherRejectsBadArgumentsBeforeLaunching) {
  const NormDesc desc = make_desc(NormKind::kLayerNorm, kBf16, 4, 64);
  void* p = fake_pointer(kAligned);
  float* f = fake_floats(kAligned);
  expect_invalid_argument([&] { launch_norm_forward(desc, nullptr, p, p, p, f, f, nullptr); }, "x is null");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, nullptr, p, p, f, f, nullptr); }, "gamma is null");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, nullptr, p, f, f, nullptr); }, "beta is null");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, p, nullptr, f, f, nullptr); }, "y is null");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, p, p, nullptr, f, nullptr); }, "mean is null");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, p, p, f, nullptr, nullptr); }, "rstd is null");
  void* bad = fake_pointer(kOdd);
  float* bad_f = fake_floats(kOdd);
  expect_invalid_argument([&] { launch_norm_forward(desc, bad, p, p, p, f, f, nullptr); }, "2-byte aligned");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, bad, p, p, f, f, nullptr); }, "2-byte aligned");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, bad, p, f, f, nullptr); }, "2-byte aligned");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, p, bad, f, f, nullptr); }, "2-byte aligned");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, p, p, bad_f, f, nullptr); }, "4-byte aligned");
  expect_invalid_argument([&] { launch_norm_forward(desc, p, p, p, p, f, bad_f, nullptr); }, "4-byte aligned");
  // Shape errors come first, whatever the pointers.
  expect_invalid_argument(
      [&] { launch_norm_forward(make_desc(NormKind::kLayerNorm, kBf16, 4, 0), p, p, p, p, f, f, nullptr); },
      "hidden must be > 0");
  expect_invalid_argument(
      [&] { launch_norm_forward(make_desc(NormKind::kRMSNorm, DType::kInt32, 4, 64), p, p, p, p, f, f, nullptr); },
      "not supported");
  // RMSNorm: a null mean and beta are fine; its other pointers are still checked.
  const NormDesc rms = make_desc(NormKind::kRMSNorm, kFp16, 4, 64);
  expect_invalid_argument([&] { launch_norm_forward(rms, p, p, nullptr, bad, nullptr, f, nullptr); },
                          "2-byte aligned");
}

TEST(NormTest, BackwardLauncherRejectsBadArgumentsBeforeLaunching) {
  const NormDesc desc = make_desc(NormKind::kLayerNorm, kFp32, 4, 64);
  void* p = fake_pointer(kAligned);
  float* f = fake_floats(kAligned);
  void* bad = fake_pointer(kOdd);
  float* bad_f = fake_floats(kOdd);
  auto backward = [&](const void* dy, const void* x, const float* mean, const float* rstd, const void* gamma,
                      void* dx, float* dgamma, float* dbeta, void* workspace) {
    launch_norm_backward(desc, dy, x, mean, rstd, gamma, dx, dgamma, dbeta, workspace, nullptr);
  };
  expect_invalid_argument([&] { backward(nullptr, p, f, f, p, p, f, f, p); }, "dy is null");
  expect_invalid_argument([&] { backward(p, nullptr, f, f, p, p, f, f, p); }, "x is null");
  expect_invalid_argument([&] { backward(p, p, nullptr, f, p, p, f, f, p); }, "mean is null");
  expect_invalid_argument([&] { backward(p, p, f, nullptr, p, p, f, f, p); }, "rstd is null");
  expect_invalid_argument([&] { backward(p, p, f, f, nullptr, p, f, f, p); }, "gamma is null");
  expect_invalid_argument([&] { backward(p, p, f, f, p, nullptr, f, f, p); }, "dx is null");
  expect_invalid_argument([&] { backward(p, p, f, f, p, p, nullptr, f, p); }, "dgamma is null");
  expect_invalid_argument([&] { backward(p, p, f, f, p, p, f, nullptr, p); }, "dbeta is null");
  expect_invalid_argument([&] { backward(p, p, f, f, p, p, f, f, nullptr); }, "workspace");
  expect_invalid_argument([&] { backward(bad, p, f, f, p, p, f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, bad, f, f, p, p, f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, p, bad_f, f, p, p, f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, p, f, bad_f, p, p, f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, p, f, f, bad, p, f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, p, f, f, p, bad, f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, p, f, f, p, p, bad_f, f, p); }, "4-byte aligned");
  expect_invalid_argument([&] { backward(p, p, f, f, p, p, f, bad_f, p); }, "4-byte aligned");
  // Data may be 16-byte misaligned (element-wise path); the workspace may not.
  expect_invalid_argument([&] { backward(p, p, f, f, p, p, f, f, fake_pointer(kMisaligned)); }, "16-byte aligned");
  expect_invalid_argument(
      [&] {
        launch_norm_backward(make_desc(NormKind::kRMSNorm, kBf16, 0, 4097), p, p, nullptr, f, p, p, f, nullptr, p,
                             nullptr);
      },
      "rows must be > 0");
  // A register budget that does not hold the row (bf16 16384: only 4 does), or no budget at all.
  const NormDesc long_rows = make_desc(NormKind::kLayerNorm, kBf16, 4, 16384);
  for (int vecs : {2, 3}) {
    expect_invalid_argument(
        [&] { launch_norm_backward(long_rows, p, p, f, f, p, p, f, f, p, nullptr, {.vecs = vecs}); },
        "is not a plan for hidden 16384");
  }
}

TEST(NormTest, WorkspaceHoldsPartialRowsOfEachParameterGradient) {
  // One row: one partial row per parameter gradient.
  EXPECT_EQ(norm_backward_workspace_bytes(make_desc(NormKind::kLayerNorm, kBf16, 1, 8)), 2 * 8 * sizeof(float));
  EXPECT_EQ(norm_backward_workspace_bytes(make_desc(NormKind::kRMSNorm, kBf16, 1, 8)), 8 * sizeof(float));
  // Many rows: bounded by the persistent grid, not by the rows.
  const std::size_t many = norm_backward_workspace_bytes(make_desc(NormKind::kLayerNorm, kBf16, 1 << 20, 4096));
  EXPECT_GE(many, 2 * 4096 * sizeof(float));
  EXPECT_LE(many, std::size_t{2} * 1056 * 4096 * sizeof(float));
  EXPECT_EQ(many % (2 * 4096 * sizeof(float)), 0u);
  // Any hidden: partial rows of hidden floats.
  const std::size_t odd = norm_backward_workspace_bytes(make_desc(NormKind::kLayerNorm, kBf16, 1 << 20, 4097));
  EXPECT_GE(odd, 2 * 4097 * sizeof(float));
  EXPECT_LE(odd, std::size_t{2} * 1056 * 4097 * sizeof(float));
  EXPECT_EQ(odd % (2 * 4097 * sizeof(float)), 0u);
  EXPECT_EQ(norm_backward_workspace_bytes(make_desc(NormKind::kRMSNorm, kFp32, 1, 1)), sizeof(float));
  expect_invalid_argument([] { norm_backward_workspace_bytes(make_desc(NormKind::kLayerNorm, kBf16, 4, 0)); },
                          "hidden");
}

// ---------------------------------------------------------------------------
// Host references (no GPU needed).

// Naive double-precision forward of the dtype-rounded inputs.
void naive_forward(const NormDesc& desc, const NormInputs& in, std::vector<double>& y, std::vector<double>& mean,
                   std::vector<double>& rstd) {
  const std::int64_t h = desc.hidden;
  y.assign(desc.rows * h, 0.0);
  mean.assign(desc.rows, 0.0);
  rstd.assign(desc.rows, 0.0);
  for (std::int64_t r = 0; r < desc.rows; ++r) {
    double m = 0.0;
    if (is_layer_norm(desc)) {
      for (std::int64_t j = 0; j < h; ++j) m += in.x.get(r * h + j);
      m /= h;
    }
    double var = 0.0;
    for (std::int64_t j = 0; j < h; ++j) var += (in.x.get(r * h + j) - m) * (in.x.get(r * h + j) - m);
    var /= h;
    const double s = 1.0 / std::sqrt(var + desc.eps);
    for (std::int64_t j = 0; j < h; ++j) {
      y[r * h + j] = (in.x.get(r * h + j) - m) * s * in.gamma.get(j) + (is_layer_norm(desc) ? in.beta.get(j) : 0.0);
    }
    mean[r] = m;
    rstd[r] = s;
  }
}

std::vector<float> to_float_vector(const std::vector<double>& values) { return {values.begin(), values.end()}; }

void check_host_forward_against_formula(NormKind kind, DType dtype, std::int64_t rows, std::int64_t hidden) {
  const NormDesc desc = make_desc(kind, dtype, rows, hidden);
  testing::SeededRng rng;
  const NormInputs in = random_inputs(desc, rng);
  const ForwardResult got = host_forward(desc, in);
  std::vector<double> y, mean, rstd;
  naive_forward(desc, in, y, mean, rstd);
  // fp32 arithmetic against double: a few roundings of fp32, then the dtype's.
  const double tolerance = dtype == kFp32 ? 1e-6 : tolerance_for(dtype);
  EXPECT_LE(relative_error(got.y.to_floats(), to_float_vector(y)), tolerance);
  if (is_layer_norm(desc)) {
    EXPECT_LE(relative_error(got.mean, to_float_vector(mean)), 1e-6);
  }
  EXPECT_LE(relative_error(got.rstd, to_float_vector(rstd)), 1e-6);
}

TEST(NormTest, LayerNormFp32HostForwardMatchesFormula) {
  check_host_forward_against_formula(NormKind::kLayerNorm, kFp32, 5, 16);
  check_host_forward_against_formula(NormKind::kLayerNorm, kFp32, 3, 1000);
}

TEST(NormTest, RMSNormFp32HostForwardMatchesFormula) {
  check_host_forward_against_formula(NormKind::kRMSNorm, kFp32, 5, 16);
  check_host_forward_against_formula(NormKind::kRMSNorm, kFp32, 3, 1000);
}

TEST(NormTest, HostForwardMatchesFormulaForAnyHidden) {
  for (NormKind kind : {NormKind::kLayerNorm, NormKind::kRMSNorm}) {
    for (DType dtype : {kBf16, kFp16, kFp32}) {
      check_host_forward_against_formula(kind, dtype, 7, 13);
      check_host_forward_against_formula(kind, dtype, 7, 1);
      check_host_forward_against_formula(kind, dtype, 2, 4097);
    }
  }
}

TEST(NormTest, LayerNormBf16HostForwardMatchesFormula) {
  check_host_forward_against_formula(NormKind::kLayerNorm, kBf16, 3, 1024);
}

TEST(NormTest, RMSNormFp16HostForwardMatchesFormula) {
  check_host_forward_against_formula(NormKind::kRMSNorm, kFp16, 3, 1024);
}

TEST(NormTest, LayerNormFp32HostForwardIsSoundForLargeMeans) {
  // Rows of 1000 + u(-1, 1): E[x^2] - E[x]^2 in fp32 would lose every digit.
  const NormDesc desc = make_desc(NormKind::kLayerNorm, kFp32, 4, 512);
  testing::SeededRng rng;
  NormInputs in = random_inputs(desc, rng);
  for (std::int64_t i = 0; i < in.x.numel; ++i) in.x.set(i, in.x.get(i) + 1000.0f);
  const ForwardResult got = host_forward(desc, in);
  std::vector<double> y, mean, rstd;
  naive_forward(desc, in, y, mean, rstd);
  EXPECT_LE(relative_error(got.y.to_floats(), to_float_vector(y)), 1e-4);
  EXPECT_LE(relative_error(got.rstd, to_float_vector(rstd)), 1e-5);
}

// Central finite differences of L = sum(dy * y), y = host forward in fp32,
// against the host backward (fp32) at the same point.
void check_host_backward_against_finite_differences(NormKind kind, std::int64_t rows, std::int64_t hidden) {
  const NormDesc desc = make_desc(kind, kFp32, rows, hidden);
  testing::SeededRng rng;
  const NormInputs in = random_inputs(desc, rng);
  const std::int64_t n = rows * hidden;

  const ForwardResult fwd = host_forward(desc, in);
  HostArray dx(kFp32, n);
  std::vector<float> dgamma(hidden), dbeta(hidden);
  host::norm_backward(desc, in.dy.data(), in.x.data(), fwd.mean.data(), fwd.rstd.data(), in.gamma.data(), dx.data(),
                      dgamma.data(), is_layer_norm(desc) ? dbeta.data() : nullptr);

  auto loss = [&](const NormInputs& at) {
    const ForwardResult out = host_forward(desc, at);
    double sum = 0.0;
    for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(in.dy.get(i)) * out.y.get(i);
    return sum;
  };
  // h balances truncation (h^2) against fp32 rounding of y (eps / h).
  constexpr float kStep = 1e-2f;
  auto derivative = [&](HostArray NormInputs::*field, std::int64_t i) {
    NormInputs at = in;
    const float value = (in.*field).get(i);
    const float above = value + kStep;  // the fp32 points actually evaluated
    const float below = value - kStep;
    (at.*field).set(i, above);
    const double up = loss(at);
    (at.*field).set(i, below);
    const double down = loss(at);
    return static_cast<float>((up - down) / (static_cast<double>(above) - below));
  };

  std::vector<float> fd_dx(n), fd_dgamma(hidden), fd_dbeta(hidden);
  for (std::int64_t i = 0; i < n; ++i) fd_dx[i] = derivative(&NormInputs::x, i);
  for (std::int64_t j = 0; j < hidden; ++j) {
    fd_dgamma[j] = derivative(&NormInputs::gamma, j);
    if (is_layer_norm(desc)) fd_dbeta[j] = derivative(&NormInputs::beta, j);
  }
  EXPECT_LT(relative_error(dx.to_floats(), fd_dx), 1e-3);
  EXPECT_LT(relative_error(dgamma, fd_dgamma), 1e-3);
  if (is_layer_norm(desc)) {
    EXPECT_LT(relative_error(dbeta, fd_dbeta), 1e-3);
  }
}

TEST(NormTest, LayerNormFp32HostBackwardMatchesFiniteDifferences) {
  check_host_backward_against_finite_differences(NormKind::kLayerNorm, 3, 8);
  check_host_backward_against_finite_differences(NormKind::kLayerNorm, 5, 16);
  check_host_backward_against_finite_differences(NormKind::kLayerNorm, 7, 13);
}

TEST(NormTest, RMSNormFp32HostBackwardMatchesFiniteDifferences) {
  check_host_backward_against_finite_differences(NormKind::kRMSNorm, 3, 8);
  check_host_backward_against_finite_differences(NormKind::kRMSNorm, 5, 16);
  check_host_backward_against_finite_differences(NormKind::kRMSNorm, 7, 13);
}

// ---------------------------------------------------------------------------
// Device against host (GPU).

// Statistics and parameter gradients are fp32 whatever the dtype: held to the
// fp32 tolerance (they differ from the host only in summation order).
const double kStatTolerance = tolerance_for(kFp32);
const double kColumnSumTolerance = 4 * kStatTolerance;  // sums over every row (the backward's dgamma, dbeta)

// Data arrays (x, y, dy, dx, gamma, beta) on the device `offset` elements
// past the allocation's 256-byte aligned start: offset 1 sends them down the
// element-wise path whatever hidden is.
class ShiftedArray {
 public:
  ShiftedArray(DType dtype, std::int64_t n, std::int64_t offset)
      : dtype_(dtype), n_(n), offset_(offset), array_(static_cast<std::size_t>(n + offset) * dtype_size(dtype)) {}
  ShiftedArray(const HostArray& host, std::int64_t offset) : ShiftedArray(host.dtype, host.numel, offset) {
    HostArray padded(host.dtype, host.numel + offset_);
    std::memcpy(padded.bytes.data() + offset_ * dtype_size(dtype_), host.data(), host.bytes.size());
    array_.upload(padded);
  }
  void* get() const { return static_cast<std::uint8_t*>(array_.get()) + offset_ * dtype_size(dtype_); }
  void poison() { array_.poison(); }
  HostArray download() const {
    const HostArray padded = array_.download(dtype_, n_ + offset_);
    HostArray out(dtype_, n_);
    std::memcpy(out.data(), padded.bytes.data() + offset_ * dtype_size(dtype_), out.bytes.size());
    return out;
  }

 private:
  DType dtype_;
  std::int64_t n_;
  std::int64_t offset_;
  DeviceArray array_;
};

void check_forward_on_device(NormKind kind, DType dtype, std::int64_t rows, std::int64_t hidden,
                             std::int64_t offset = 0) {
  const NormDesc desc = make_desc(kind, dtype, rows, hidden);
  testing::SeededRng rng;
  const NormInputs in = random_inputs(desc, rng);
  const ForwardResult want = host_forward(desc, in);
  const bool layer_norm = is_layer_norm(desc);

  ShiftedArray x(in.x, offset), gamma(in.gamma, offset), beta(in.beta, offset), y(dtype, rows * hidden, offset);
  DeviceArray mean(rows * sizeof(float)), rstd(rows * sizeof(float));
  y.poison();
  mean.poison();
  rstd.poison();
  Stream stream;
  // RMSNorm gets null beta and mean, as the contract allows.
  launch_norm_forward(desc, x.get(), gamma.get(), layer_norm ? beta.get() : nullptr, y.get(),
                      layer_norm ? mean.as<float>() : nullptr, rstd.as<float>(), stream.get());
  stream.synchronize();

  EXPECT_LE(relative_error(y.download().to_floats(), want.y.to_floats()), tolerance_for(dtype));
  if (layer_norm) {
    EXPECT_LE(relative_error(mean.download(kFp32, rows).to_floats(), want.mean), kStatTolerance);
  }
  EXPECT_LE(relative_error(rstd.download(kFp32, rows).to_floats(), want.rstd), kStatTolerance);
}

// With `residual`, a random dx_residual is added to dx in the same pass.
void check_backward_on_device(NormKind kind, DType dtype, std::int64_t rows, std::int64_t hidden,
                              std::int64_t offset = 0, const NormBackwardTuning& tuning = {}, bool residual = false) {
  const NormDesc desc = make_desc(kind, dtype, rows, hidden);
  testing::SeededRng rng;
  const NormInputs in = random_inputs(desc, rng);
  const HostArray residual_in = random_inputs(desc, rng).dy;
  const bool layer_norm = is_layer_norm(desc);
  // Both sides get the host forward's statistics: this checks the backward alone.
  const ForwardResult fwd = host_forward(desc, in);
  HostArray dx_want(dtype, rows * hidden);
  std::vector<float> dgamma_want(hidden), dbeta_want(hidden);
  host::norm_backward(desc, in.dy.data(), in.x.data(), fwd.mean.data(), fwd.rstd.data(), in.gamma.data(),
                      dx_want.data(), dgamma_want.data(), layer_norm ? dbeta_want.data() : nullptr,
                      residual ? residual_in.data() : nullptr);

  ShiftedArray x(in.x, offset), gamma(in.gamma, offset), dy(in.dy, offset), dx(dtype, rows * hidden, offset);
  ShiftedArray dx_residual(residual_in, offset);
  DeviceArray mean(floats(fwd.mean)), rstd(floats(fwd.rstd));
  DeviceArray dgamma(hidden * sizeof(float)), dbeta(hidden * sizeof(float));
  DeviceArray workspace(norm_backward_workspace_bytes(desc));
  Stream stream;
  auto run = [&] {
    dx.poison();
    dgamma.poison();
    dbeta.poison();
    workspace.poison();
    launch_norm_backward(desc, dy.get(), x.get(), layer_norm ? mean.as<float>() : nullptr, rstd.as<float>(),
                         gamma.get(), dx.get(), dgamma.as<float>(), layer_norm ? dbeta.as<float>() : nullptr,
                         workspace.get(), stream.get(), tuning, residual ? dx_residual.get() : nullptr);
    stream.synchronize();
    return std::vector<HostArray>{dx.download(), dgamma.download(kFp32, hidden), dbeta.download(kFp32, hidden)};
  };
  const std::vector<HostArray> first = run();
  // dx is a difference of terms of size |rstd * gamma * dy|; where they cancel
  // (hidden 1: LayerNorm's dx is exactly 0, RMSNorm's nearly) rounding error
  // is measured against them, not against the tiny result.
  std::vector<float> dx_scale(static_cast<std::size_t>(rows * hidden));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < hidden; ++j) {
      dx_scale[r * hidden + j] = std::fabs(fwd.rstd[r] * in.gamma.get(j) * in.dy.get(r * hidden + j)) +
                                 (residual ? std::fabs(residual_in.get(r * hidden + j)) : 0.0f);
    }
  }
  EXPECT_LE(relative_error(first[0].to_floats(), dx_want.to_floats(), dx_scale), tolerance_for(dtype));
  // dgamma and dbeta sum over every row, in another order than the host's:
  // seed 4004152981 (ManyRows) measured dbeta 1.09e-5 off. Their rounding
  // error grows with the sums of |terms|, not with the sums, which cancel
  // (RMSNorm at hidden 1 over 1000 rows: dgamma is a sum of +-dy).
  std::vector<float> dgamma_scale(hidden, 0.0f), dbeta_scale(hidden, 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < hidden; ++j) {
      const float centred = in.x.get(r * hidden + j) - (layer_norm ? fwd.mean[r] : 0.0f);
      dgamma_scale[j] += std::fabs(in.dy.get(r * hidden + j) * centred * fwd.rstd[r]);
      dbeta_scale[j] += std::fabs(in.dy.get(r * hidden + j));
    }
  }
  EXPECT_LE(relative_error(first[1].to_floats(), dgamma_want, dgamma_scale), kColumnSumTolerance);
  if (layer_norm) {
    EXPECT_LE(relative_error(first[2].to_floats(), dbeta_want, dbeta_scale), kColumnSumTolerance);
  }

  // Deterministic: a second run is bitwise equal.
  const std::vector<HostArray> second = run();
  EXPECT_EQ(first[0].bytes, second[0].bytes) << "dx differs between two runs";
  EXPECT_EQ(first[1].bytes, second[1].bytes) << "dgamma differs between two runs";
  if (layer_norm) {
    EXPECT_EQ(first[2].bytes, second[2].bytes) << "dbeta differs between two runs";
  }
}

// The residual stream's gradient added in the backward's own pass (the
// ResidualStack's dh), on the vector path with resident rows, the
// element-wise path, and rows too long to stay resident.
TEST(NormTest, BackwardAddsTheResidualGradientOnDevice) {
  SG_SKIP_WITHOUT_GPU();
  check_backward_on_device(NormKind::kLayerNorm, kBf16, 300, 1024, 0, {}, true);
  check_backward_on_device(NormKind::kRMSNorm, kFp32, 7, 4097, 0, {}, true);
  check_backward_on_device(NormKind::kLayerNorm, kBf16, 3, 40000, 0, {}, true);
  check_backward_on_device(NormKind::kLayerNorm, kFp16, 7, 1024, 1, {}, true);  // unaligned: element-wise
}

// On the host, in fp32, dx + r is the plain backward's dx plus r, exactly.
TEST(NormTest, HostBackwardAddsTheResidualGradientExactly) {
  for (NormKind kind : {NormKind::kLayerNorm, NormKind::kRMSNorm}) {
    const NormDesc desc = make_desc(kind, kFp32, 5, 96);
    testing::SeededRng rng;
    const NormInputs in = random_inputs(desc, rng);
    const HostArray residual = random_inputs(desc, rng).dy;
    const ForwardResult fwd = host_forward(desc, in);
    HostArray plain(kFp32, 5 * 96), fused(kFp32, 5 * 96);
    std::vector<float> dgamma(96), dbeta(96);
    host::norm_backward(desc, in.dy.data(), in.x.data(), fwd.mean.data(), fwd.rstd.data(), in.gamma.data(),
                        plain.data(), dgamma.data(), dbeta.data());
    host::norm_backward(desc, in.dy.data(), in.x.data(), fwd.mean.data(), fwd.rstd.data(), in.gamma.data(),
                        fused.data(), dgamma.data(), dbeta.data(), residual.data());
    for (std::int64_t i = 0; i < plain.numel; ++i) {
      ASSERT_EQ(fused.get(i), plain.get(i) + residual.get(i)) << "element " << i;
    }
  }
}

// Rows per block (Note [Norm backward rows per block]): the automatic plan
// (one row a block at 256 rows), the old 8 and an odd 3 all match the host.
TEST(NormTest, BackwardRowsPerBlockPlansMatchTheHost) {
  SG_SKIP_WITHOUT_GPU();
  for (int rows_per_block : {0, 8, 3}) {
    SCOPED_TRACE("rows_per_block " + std::to_string(rows_per_block));
    check_backward_on_device(NormKind::kLayerNorm, kBf16, 256, 512, 0, {.rows_per_block = rows_per_block});
    check_backward_on_device(NormKind::kRMSNorm, kFp32, 100, 96, 0, {.rows_per_block = rows_per_block});
  }
}

// NormTest.<Kind><DType><Direction><Shape>, e.g. NormTest.LayerNormBf16ForwardRagged.
#define SG_NORM_DEVICE_TESTS(Kind, Type, Shape, rows, hidden)                 \
  TEST(NormTest, Kind##Type##Forward##Shape) {                                \
    SG_SKIP_WITHOUT_GPU();                                                    \
    check_forward_on_device(NormKind::k##Kind, k##Type, rows, hidden);        \
  }                                                                           \
  TEST(NormTest, Kind##Type##Backward##Shape) {                               \
    SG_SKIP_WITHOUT_GPU();                                                    \
    check_backward_on_device(NormKind::k##Kind, k##Type, rows, hidden);       \
  }

// Shape classes: Single (one 16-byte vector), Ragged (rows not a multiple of
// the rows per block), Square, Wide (hidden 4096 + 8), Long (the longest
// register-resident backward row in bf16/fp16), Huge (rows beyond the
// register-resident tiles). Hidden not a multiple of the vector width (the
// element-wise path): Odd (4096 + 1), Thin (13), Unit (1), each with few and
// many rows, and HugeOdd (beyond the element-wise path's resident tiles).
#define SG_NORM_DEVICE_SHAPES(Kind, Type)                   \
  SG_NORM_DEVICE_TESTS(Kind, Type, Single, 1, 8)            \
  SG_NORM_DEVICE_TESTS(Kind, Type, Ragged, 7, 1024)         \
  SG_NORM_DEVICE_TESTS(Kind, Type, Square, 1000, 1000)      \
  SG_NORM_DEVICE_TESTS(Kind, Type, Wide, 5, 4104)           \
  SG_NORM_DEVICE_TESTS(Kind, Type, Long, 3, 16384)          \
  SG_NORM_DEVICE_TESTS(Kind, Type, Huge, 3, 40000)          \
  SG_NORM_DEVICE_TESTS(Kind, Type, Odd, 7, 4097)            \
  SG_NORM_DEVICE_TESTS(Kind, Type, OddManyRows, 1000, 4097) \
  SG_NORM_DEVICE_TESTS(Kind, Type, Thin, 7, 13)             \
  SG_NORM_DEVICE_TESTS(Kind, Type, ThinManyRows, 1000, 13)  \
  SG_NORM_DEVICE_TESTS(Kind, Type, Unit, 1, 1)              \
  SG_NORM_DEVICE_TESTS(Kind, Type, UnitManyRows, 1000, 1)   \
  SG_NORM_DEVICE_TESTS(Kind, Type, HugeOdd, 3, 40001)

SG_NORM_DEVICE_SHAPES(LayerNorm, Bf16)
SG_NORM_DEVICE_SHAPES(LayerNorm, Fp16)
SG_NORM_DEVICE_SHAPES(LayerNorm, Fp32)
SG_NORM_DEVICE_SHAPES(RMSNorm, Bf16)
SG_NORM_DEVICE_SHAPES(RMSNorm, Fp16)
SG_NORM_DEVICE_SHAPES(RMSNorm, Fp32)

// The production shape class (hidden 4096), with many rows per persistent
// block: partial rows summed over dozens of rows each.
TEST(NormTest, LayerNormBf16BackwardManyRows) {
  SG_SKIP_WITHOUT_GPU();
  check_backward_on_device(NormKind::kLayerNorm, kBf16, 2048, 4096);
}

TEST(NormTest, RMSNormBf16BackwardManyRows) {
  SG_SKIP_WITHOUT_GPU();
  check_backward_on_device(NormKind::kRMSNorm, kBf16, 2048, 4096);
}

// The same rows on the 4-vector register budget (memory_bound_bench times it
// against the default 2-vector one).
TEST(NormTest, LayerNormBf16BackwardManyRowsFourVectors) {
  SG_SKIP_WITHOUT_GPU();
  check_backward_on_device(NormKind::kLayerNorm, kBf16, 2048, 4096, 0, {.vecs = 4});
}

TEST(NormTest, LayerNormBf16ForwardManyRows) {
  SG_SKIP_WITHOUT_GPU();
  check_forward_on_device(NormKind::kLayerNorm, kBf16, 2048, 4096);
}

// Pointers one element past a 16-byte boundary, with hidden a multiple of the
// vector width: the element-wise path, every row misaligned.
TEST(NormTest, MisalignedPointersMatchHost) {
  SG_SKIP_WITHOUT_GPU();
  for (NormKind kind : {NormKind::kLayerNorm, NormKind::kRMSNorm}) {
    for (DType dtype : {kBf16, kFp16, kFp32}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (kind == NormKind::kLayerNorm ? " layernorm" : " rmsnorm"));
      check_forward_on_device(kind, dtype, 64, 4096, 1);
      check_backward_on_device(kind, dtype, 64, 4096, 1);
      check_backward_on_device(kind, dtype, 7, 1024, 1);
    }
  }
}

TEST(NormTest, LayerNormFp32ForwardIsSoundForLargeMeans) {
  SG_SKIP_WITHOUT_GPU();
  const NormDesc desc = make_desc(NormKind::kLayerNorm, kFp32, 64, 4096);
  testing::SeededRng rng;
  NormInputs in = random_inputs(desc, rng);
  for (std::int64_t i = 0; i < in.x.numel; ++i) in.x.set(i, in.x.get(i) + 1000.0f);
  std::vector<double> y_naive, mean_naive, rstd_naive;
  naive_forward(desc, in, y_naive, mean_naive, rstd_naive);

  DeviceArray x(in.x), gamma(in.gamma), beta(in.beta);
  DeviceArray y(in.x.bytes.size()), mean(64 * sizeof(float)), rstd(64 * sizeof(float));
  y.poison();
  Stream stream;
  launch_norm_forward(desc, x.get(), gamma.get(), beta.get(), y.get(), mean.as<float>(), rstd.as<float>(),
                      stream.get());
  stream.synchronize();
  // fp32 inputs near 1000 carry ~6e-5 absolute error: 1e-3 is the scale of
  // the input rounding, E[x^2] - E[x]^2 would be off by 100%.
  EXPECT_LE(relative_error(y.download(kFp32, in.x.numel).to_floats(), to_float_vector(y_naive)), 1e-3);
  EXPECT_LE(relative_error(rstd.download(kFp32, 64).to_floats(), to_float_vector(rstd_naive)), 1e-3);
}

}  // namespace
}  // namespace stepgraph::kernels
