// GEMM: check_gemm and the operand checks; the host reference against a naive
// double-precision loop (every layout and epilogue, on the CPU); and the
// cuBLASLt launch against the host reference (GPU), with fresh random inputs,
// NaN-poisoned outputs (an unwritten element fails), ragged shapes that are
// multiples of no tile, every dtype pair, layout and epilogue.
//
// Layout letters are opA then opB: N as stored, T transposed (Nt: A [m, k],
// B stored [n, k], the forward of a linear layer).
#include "kernels/gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/stream.h"
#include "kernels/gemm_algorithm_record.h"
#include "kernels/gemm_host.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using stepgraph::testing::DeviceArray;
using stepgraph::testing::gelu_double;
using stepgraph::testing::gelu_grad_double;
using stepgraph::testing::HostArray;
using stepgraph::testing::random_array;
using stepgraph::testing::relative_error;
using stepgraph::testing::tolerance_for;

struct Shape {
  std::int64_t m, n, k;
};

struct DTypes {
  DType in;
  DType out;
};

constexpr DTypes kDTypePairs[] = {
    {DType::kBFloat16, DType::kBFloat16}, {DType::kBFloat16, DType::kFloat32}, {DType::kFloat16, DType::kFloat16},
    {DType::kFloat16, DType::kFloat32},   {DType::kFloat32, DType::kFloat32},
};

constexpr GemmEpilogue kEpilogues[] = {GemmEpilogue::kNone, GemmEpilogue::kBias, GemmEpilogue::kGeluAuxBias,
                                       GemmEpilogue::kDGeluBGrad, GemmEpilogue::kBiasGradOfA};

bool uses_aux(GemmEpilogue e) { return e == GemmEpilogue::kGeluAuxBias || e == GemmEpilogue::kDGeluBGrad; }
bool writes_bias_grad(GemmEpilogue e) { return e == GemmEpilogue::kDGeluBGrad || e == GemmEpilogue::kBiasGradOfA; }
bool can_accumulate(GemmEpilogue e) { return e == GemmEpilogue::kNone || e == GemmEpilogue::kBiasGradOfA; }

std::int64_t bias_grad_length(const GemmDesc& desc) {
  return desc.epilogue == GemmEpilogue::kBiasGradOfA ? desc.m : desc.n;
}

// The aux epilogues need n % 8 == 0: the ragged shapes, with n rounded up.
Shape for_epilogue(Shape shape, GemmEpilogue epilogue) {
  if (uses_aux(epilogue)) shape.n = (shape.n + 7) / 8 * 8;
  return shape;
}

GemmDesc make_desc(DTypes types, bool trans_a, bool trans_b, GemmEpilogue epilogue, Shape shape) {
  GemmDesc desc;
  desc.m = shape.m;
  desc.n = shape.n;
  desc.k = shape.k;
  desc.trans_a = trans_a;
  desc.trans_b = trans_b;
  desc.a_type = types.in;
  desc.b_type = types.in;
  desc.d_type = types.out;
  desc.epilogue = epilogue;
  return desc;
}

std::string dtype_word(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "Fp32";
    case DType::kBFloat16: return "Bf16";
    case DType::kFloat16: return "Fp16";
    default: return "Other";
  }
}

std::string epilogue_word(GemmEpilogue epilogue) {
  switch (epilogue) {
    case GemmEpilogue::kNone: return "None";
    case GemmEpilogue::kBias: return "Bias";
    case GemmEpilogue::kGeluAuxBias: return "GeluAuxBias";
    case GemmEpilogue::kDGeluBGrad: return "DGeluBGrad";
    case GemmEpilogue::kBiasGradOfA: return "BiasGradOfA";
  }
  return "Unknown";
}

// Operands on the host, random; aux in [-3, 3) to span GeLU's curve.
struct HostOperands {
  HostArray a, b, d, bias, aux, bias_grad;

  HostOperands(const GemmDesc& desc, std::mt19937& rng)
      : a(random_array(desc.a_type, desc.m * desc.k, rng)),
        b(random_array(desc.b_type, desc.k * desc.n, rng)),
        d(random_array(desc.d_type, desc.m * desc.n, rng)),
        bias(random_array(desc.d_type, desc.n, rng)),
        aux(random_array(desc.d_type, desc.m * desc.n, rng, -3.0f, 3.0f)),
        bias_grad(desc.d_type, bias_grad_length(desc)) {}

  GemmOperands pointers() {
    return {.a = a.data(),
            .b = b.data(),
            .d = d.data(),
            .bias = bias.data(),
            .aux = aux.data(),
            .bias_grad = bias_grad.data()};
  }
};

// Outputs the reference computes, in fp32.
struct Outputs {
  std::vector<float> d, aux, bias_grad;
  // The naive reference only: per element of D, the sum of the magnitudes of
  // its terms (|alpha| sum |a b| + |bias| + |beta d|). Rounding errors scale
  // with it, not with |D|, which cancellation can make arbitrarily small.
  std::vector<float> d_scale;
};

Outputs host_reference(const GemmDesc& desc, HostOperands operands) {
  host::gemm(desc, operands.pointers());
  return {operands.d.to_floats(), operands.aux.to_floats(), operands.bias_grad.to_floats()};
}

// The definition in gemm.h, term by term in double precision, no rounding.
Outputs naive_gemm(const GemmDesc& desc, const HostOperands& in) {
  const std::int64_t m = desc.m, n = desc.n, k = desc.k;
  const auto op_a = [&](std::int64_t i, std::int64_t p) -> double {
    return in.a.get(desc.trans_a ? p * m + i : i * k + p);
  };
  const auto op_b = [&](std::int64_t p, std::int64_t j) -> double {
    return in.b.get(desc.trans_b ? j * k + p : p * n + j);
  };
  Outputs out{std::vector<float>(m * n), in.aux.to_floats(), {}, std::vector<float>(m * n)};
  std::vector<double> bias_grad(bias_grad_length(desc), 0.0);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double ab = 0.0;
      double magnitude = 0.0;
      for (std::int64_t p = 0; p < k; ++p) {
        ab += op_a(i, p) * op_b(p, j);
        magnitude += std::fabs(op_a(i, p) * op_b(p, j));
      }
      ab *= desc.alpha;
      magnitude *= std::fabs(desc.alpha);
      double value = ab + desc.beta * static_cast<double>(in.d.get(i * n + j));
      magnitude += std::fabs(desc.beta * static_cast<double>(in.d.get(i * n + j)));
      if (desc.epilogue == GemmEpilogue::kBias) {
        value = ab + in.bias.get(j);
        magnitude += std::fabs(in.bias.get(j));
      }
      out.d_scale[i * n + j] = static_cast<float>(magnitude);
      if (desc.epilogue == GemmEpilogue::kGeluAuxBias) {
        out.aux[i * n + j] = static_cast<float>(ab + in.bias.get(j));
        value = gelu_double(ab + in.bias.get(j));
      }
      if (desc.epilogue == GemmEpilogue::kDGeluBGrad) {
        value = ab * gelu_grad_double(in.aux.get(i * n + j));
        bias_grad[j] += value;
      }
      out.d[i * n + j] = static_cast<float>(value);
    }
    if (desc.epilogue == GemmEpilogue::kBiasGradOfA) {
      for (std::int64_t p = 0; p < k; ++p) bias_grad[i] += op_a(i, p);
    }
  }
  out.bias_grad.assign(bias_grad.begin(), bias_grad.end());
  return out;
}

// Compares what the epilogue writes. `loose` bounds the outputs that went
// through GeLU, D's tolerance the others.
void expect_close(const GemmDesc& desc, const Outputs& got, const Outputs& want, double loose) {
  const double tight = tolerance_for(desc.d_type);
  const double d_tolerance = uses_aux(desc.epilogue) ? loose : tight;
  // Through GeLU, D is no longer a sum of the terms d_scale measures.
  const std::vector<float> no_scale;
  const std::vector<float>& d_scale = uses_aux(desc.epilogue) ? no_scale : want.d_scale;
  EXPECT_LE(relative_error(got.d, want.d, d_scale), d_tolerance) << desc.to_string() << ": D";
  if (desc.epilogue == GemmEpilogue::kGeluAuxBias) {
    EXPECT_LE(relative_error(got.aux, want.aux), tight) << desc.to_string() << ": aux";
  }
  if (writes_bias_grad(desc.epilogue)) {
    EXPECT_LE(relative_error(got.bias_grad, want.bias_grad), d_tolerance) << desc.to_string() << ": bias_grad";
  }
}

using stepgraph::testing::expect_error_code;

GemmDesc valid_desc() {
  return make_desc({DType::kBFloat16, DType::kBFloat16}, false, true, GemmEpilogue::kNone, {8, 16, 32});
}

// ---------------------------------------------------------------- CPU cases

TEST(GemmTest, CheckGemmRejectsEachBadDescriptor) {
  const auto expect_bad = [](const std::function<void(GemmDesc&)>& change, ErrorCode code,
                             const std::string& mentions) {
    GemmDesc desc = valid_desc();
    change(desc);
    expect_error_code([&] { check_gemm(desc); }, code, mentions);
  };
  const ErrorCode invalid = ErrorCode::kInvalidArgument;
  const ErrorCode unsupported = ErrorCode::kUnsupported;
  expect_bad([](GemmDesc& d) { d.m = 0; }, invalid, "m, n and k must be > 0");
  expect_bad([](GemmDesc& d) { d.n = -3; }, invalid, "m, n and k must be > 0");
  expect_bad([](GemmDesc& d) { d.k = 0; }, invalid, "m, n and k must be > 0");
  expect_bad([](GemmDesc& d) { d.alpha = std::numeric_limits<float>::quiet_NaN(); }, invalid, "finite");
  expect_bad([](GemmDesc& d) { d.beta = std::numeric_limits<float>::infinity(); }, invalid, "finite");
  expect_bad([](GemmDesc& d) { d.epilogue = static_cast<GemmEpilogue>(42); }, invalid, "unknown epilogue 42");
  expect_bad([](GemmDesc& d) { d.b_type = DType::kFloat16; }, unsupported, "share a dtype");
  expect_bad([](GemmDesc& d) { d.a_type = d.b_type = DType::kInt32; }, unsupported,
             "A and B must be bf16, fp16 or fp32");
  // FP8 has its own rules (fp8_gemm_test): this 8 x 16 x 32 NN desc breaks them.
  expect_bad([](GemmDesc& d) { d.a_type = d.b_type = DType::kFloat8E4M3; }, unsupported, "FP8");
  expect_bad([](GemmDesc& d) { d.a_type = DType::kFloat8E4M3; }, unsupported, "FP8 needs both A and B in FP8");
  expect_bad([](GemmDesc& d) { d.d_type = DType::kInt64; }, unsupported, "D must be bf16, fp16 or fp32");
  expect_bad([](GemmDesc& d) { d.a_type = d.b_type = DType::kFloat32; }, unsupported, "fp32 inputs need an fp32 D");
  for (const GemmEpilogue epilogue : {GemmEpilogue::kBias, GemmEpilogue::kGeluAuxBias, GemmEpilogue::kDGeluBGrad}) {
    expect_bad(
        [&](GemmDesc& d) {
          d.epilogue = epilogue;
          d.beta = 1.0f;
        },
        unsupported, "beta=1 needs epilogue none");
  }
  for (const GemmEpilogue epilogue : {GemmEpilogue::kGeluAuxBias, GemmEpilogue::kDGeluBGrad}) {
    expect_bad(
        [&](GemmDesc& d) {
          d.epilogue = epilogue;
          d.n = 13;
        },
        unsupported, "needs n divisible by 8");
  }
  expect_bad([](GemmDesc& d) { d.epilogue = GemmEpilogue::kBiasGradOfA; }, unsupported, "bias_grad_of_a needs trans_a");
}

TEST(GemmTest, CheckGemmAcceptsEverySupportedCombination) {
  for (const DTypes types : kDTypePairs) {
    for (const GemmEpilogue epilogue : kEpilogues) {
      for (const bool trans_a : {false, true}) {
        for (const bool trans_b : {false, true}) {
          if (epilogue == GemmEpilogue::kBiasGradOfA && !trans_a) continue;
          GemmDesc desc = make_desc(types, trans_a, trans_b, epilogue, {1, 8, 1});
          desc.beta = can_accumulate(epilogue) ? 1.0f : 0.0f;
          EXPECT_NO_THROW(check_gemm(desc)) << desc.to_string();
        }
      }
    }
  }
}

TEST(GemmTest, DescriptionNamesEveryField) {
  GemmDesc desc = make_desc({DType::kBFloat16, DType::kFloat32}, false, true, GemmEpilogue::kBias, {128, 256, 64});
  EXPECT_EQ(desc.to_string(), "gemm 128x256x64 A=bf16 B=bf16^T D=fp32 epilogue=bias alpha=1 beta=0");
  desc.trans_a = true;
  desc.trans_b = false;
  desc.epilogue = GemmEpilogue::kBiasGradOfA;
  desc.alpha = 0.5f;
  desc.beta = 1.0f;
  EXPECT_EQ(desc.to_string(), "gemm 128x256x64 A=bf16^T B=bf16 D=fp32 epilogue=bias_grad_of_a alpha=0.5 beta=1");
  EXPECT_EQ(gemm_epilogue_name(GemmEpilogue::kNone), "none");
  EXPECT_EQ(gemm_epilogue_name(GemmEpilogue::kGeluAuxBias), "gelu_aux_bias");
  EXPECT_EQ(gemm_epilogue_name(GemmEpilogue::kDGeluBGrad), "dgelu_bgrad");
  EXPECT_EQ(gemm_workspace_bytes() % 256, 0u);
}

TEST(GemmTest, LaunchRejectsBadOperandsBeforeTouchingTheDevice) {
  // Checked on the host, so this runs without a GPU; the pointers are never
  // dereferenced.
  const auto fake = [](std::uintptr_t address) { return reinterpret_cast<void*>(address); };
  const GemmOperands good{.a = fake(0x1000),
                          .b = fake(0x2000),
                          .d = fake(0x3000),
                          .bias = fake(0x4000),
                          .aux = fake(0x5000),
                          .bias_grad = fake(0x6000),
                          .workspace = fake(0x7000)};
  const auto expect_bad = [&](GemmEpilogue epilogue, const std::function<void(GemmOperands&)>& change,
                              const std::string& mentions) {
    GemmDesc desc = valid_desc();
    desc.epilogue = epilogue;
    desc.trans_a = epilogue == GemmEpilogue::kBiasGradOfA;
    GemmOperands operands = good;
    change(operands);
    expect_error_code([&] { launch_gemm(desc, operands, nullptr); }, ErrorCode::kInvalidArgument, mentions);
  };
  expect_bad(
      GemmEpilogue::kNone, [](GemmOperands& o) { o.a = nullptr; }, "operand 'a' is null");
  expect_bad(
      GemmEpilogue::kNone, [](GemmOperands& o) { o.b = nullptr; }, "operand 'b' is null");
  expect_bad(
      GemmEpilogue::kNone, [](GemmOperands& o) { o.d = nullptr; }, "operand 'd' is null");
  expect_bad(
      GemmEpilogue::kNone, [](GemmOperands& o) { o.workspace = nullptr; }, "operand 'workspace' is null");
  expect_bad(
      GemmEpilogue::kBias, [](GemmOperands& o) { o.bias = nullptr; }, "operand 'bias' is null");
  expect_bad(
      GemmEpilogue::kGeluAuxBias, [](GemmOperands& o) { o.aux = nullptr; }, "operand 'aux' is null");
  expect_bad(
      GemmEpilogue::kDGeluBGrad, [](GemmOperands& o) { o.bias_grad = nullptr; }, "operand 'bias_grad'");
  expect_bad(
      GemmEpilogue::kBiasGradOfA, [](GemmOperands& o) { o.bias_grad = nullptr; }, "operand 'bias_grad'");
  expect_bad(
      GemmEpilogue::kNone, [&](GemmOperands& o) { o.a = fake(0x1002); }, "not 16-byte aligned");
  expect_bad(
      GemmEpilogue::kNone, [&](GemmOperands& o) { o.d = fake(0x3008); }, "not 16-byte aligned");
  expect_bad(
      GemmEpilogue::kBias, [&](GemmOperands& o) { o.bias = fake(0x4004); }, "not 16-byte aligned");
  expect_bad(
      GemmEpilogue::kNone, [&](GemmOperands& o) { o.workspace = fake(0x7010); }, "not 256-byte aligned");
  GemmDesc bad = valid_desc();
  bad.k = 0;
  expect_error_code([&] { launch_gemm(bad, good, nullptr); }, ErrorCode::kInvalidArgument, "must be > 0");
  expect_error_code([&] { gemm_prepare(bad); }, ErrorCode::kInvalidArgument, "must be > 0");
}

TEST(GemmTest, HostReferenceRejectsMissingOperands) {
  testing::SeededRng rng;
  GemmDesc desc = valid_desc();
  desc.epilogue = GemmEpilogue::kBias;
  HostOperands operands(desc, rng);
  GemmOperands pointers = operands.pointers();
  pointers.bias = nullptr;
  expect_error_code([&] { host::gemm(desc, pointers); }, ErrorCode::kInvalidArgument, "operand 'bias' is null");
  desc.a_type = DType::kFloat16;
  expect_error_code([&] { host::gemm(desc, operands.pointers()); }, ErrorCode::kUnsupported, "share a dtype");
}

TEST(GemmTest, HostGeluMatchesKnownValuesAndItsGradientTheFiniteDifference) {
  EXPECT_EQ(host::gelu_tanh(0.0f), 0.0f);
  EXPECT_NEAR(host::gelu_tanh(1.0f), gelu_double(1.0), 1e-6);
  EXPECT_NEAR(host::gelu_tanh(-1.0f), gelu_double(-1.0), 1e-6);
  EXPECT_NEAR(host::gelu_tanh(1.0f), 0.8411920, 1e-6);  // tanh form, not erf (0.8413447)
  EXPECT_NEAR(host::gelu_tanh_grad(0.0f), 0.5, 1e-7);
  const float h = 1e-2f;
  for (float x = -6.0f; x <= 6.0f; x += 0.0625f) {
    const double difference = (static_cast<double>(host::gelu_tanh(x + h)) - host::gelu_tanh(x - h)) / (2.0 * h);
    EXPECT_NEAR(host::gelu_tanh_grad(x), difference, 2e-4) << "x = " << x;
    EXPECT_NEAR(host::gelu_tanh_grad(x), gelu_grad_double(x), 1e-6) << "x = " << x;
  }
}

// One dtype pair, layout and epilogue; each runs on every ragged shape.
struct GemmCase {
  DTypes types;
  bool trans_a;
  bool trans_b;
  GemmEpilogue epilogue;
};

std::vector<GemmCase> every_case() {
  std::vector<GemmCase> cases;
  for (const DTypes types : kDTypePairs) {
    for (const GemmEpilogue epilogue : kEpilogues) {
      for (const bool trans_a : {false, true}) {
        if (epilogue == GemmEpilogue::kBiasGradOfA && !trans_a) continue;
        for (const bool trans_b : {false, true}) cases.push_back({types, trans_a, trans_b, epilogue});
      }
    }
  }
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<GemmCase>& info) {
  const GemmCase& c = info.param;
  return dtype_word(c.types.in) + "In" + dtype_word(c.types.out) + "Out_" + (c.trans_a ? "T" : "N") +
         (c.trans_b ? "t" : "n") + "_" + epilogue_word(c.epilogue);
}

class GemmHostReferenceTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmHostReferenceTest, MatchesNaiveDoubleLoopOnRaggedShapes) {
  const GemmCase& c = GetParam();
  testing::SeededRng rng;
  for (const Shape ragged : {Shape{7, 13, 5}, Shape{1, 1, 1}}) {
    GemmDesc desc = make_desc(c.types, c.trans_a, c.trans_b, c.epilogue, for_epilogue(ragged, c.epilogue));
    desc.alpha = 0.75f;
    desc.beta = can_accumulate(c.epilogue) ? 0.5f : 0.0f;
    const HostOperands operands(desc, rng);
    expect_close(desc, host_reference(desc, operands), naive_gemm(desc, operands), tolerance_for(desc.d_type));
  }
}

INSTANTIATE_TEST_SUITE_P(EveryLayoutAndEpilogue, GemmHostReferenceTest, ::testing::ValuesIn(every_case()), case_name);

// ---------------------------------------------------------------- GPU cases

// cuBLASLt's fp32 GeLU uses an approximate tanh (about 2^-11 relative), so
// outputs that pass through GeLU get at least this bound.
double gelu_tolerance(DType d_type) { return std::max(tolerance_for(d_type), 1e-3); }

// Device copies of the operands and a workspace.
struct DeviceOperands {
  DeviceArray a, b, d, bias, aux, bias_grad, workspace;

  explicit DeviceOperands(const HostOperands& host)
      : a(host.a),
        b(host.b),
        d(host.d),
        bias(host.bias),
        aux(host.aux),
        bias_grad(host.bias_grad),
        workspace(gemm_workspace_bytes()) {}

  GemmOperands pointers() const {
    return {.a = a.get(),
            .b = b.get(),
            .d = d.get(),
            .bias = bias.get(),
            .aux = aux.get(),
            .bias_grad = bias_grad.get(),
            .workspace = workspace.get()};
  }
  // Every output the epilogue writes becomes NaN, D unless beta reads it.
  void poison_outputs(const GemmDesc& desc) {
    if (desc.beta == 0.0f) d.poison();
    if (desc.epilogue == GemmEpilogue::kGeluAuxBias) aux.poison();
    bias_grad.poison();
  }
  Outputs download(const GemmDesc& desc) const {
    return {d.download(desc.d_type, desc.m * desc.n).to_floats(),
            aux.download(desc.d_type, desc.m * desc.n).to_floats(),
            bias_grad.download(desc.d_type, bias_grad_length(desc)).to_floats()};
  }
};

Outputs run_on_device(const GemmDesc& desc, const HostOperands& host) {
  DeviceOperands device(host);
  device.poison_outputs(desc);
  Stream stream;
  launch_gemm(desc, device.pointers(), stream.get());
  stream.synchronize();
  return device.download(desc);
}

void expect_device_matches_host(const GemmDesc& desc, std::mt19937& rng) {
  const HostOperands operands(desc, rng);
  expect_close(desc, run_on_device(desc, operands), host_reference(desc, operands), gelu_tolerance(desc.d_type));
}

class GemmDeviceTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmDeviceTest, MatchesHostReferenceOnRaggedShapes) {
  SG_SKIP_WITHOUT_GPU();
  const GemmCase& c = GetParam();
  testing::SeededRng rng;
  for (const Shape ragged : {Shape{7, 13, 257}, Shape{1, 1, 1}, Shape{33, 4097, 64}}) {
    GemmDesc desc = make_desc(c.types, c.trans_a, c.trans_b, c.epilogue, for_epilogue(ragged, c.epilogue));
    desc.alpha = 0.5f;  // shows which outputs cuBLASLt scales
    expect_device_matches_host(desc, rng);
  }
}

INSTANTIATE_TEST_SUITE_P(EveryLayoutAndEpilogue, GemmDeviceTest, ::testing::ValuesIn(every_case()), case_name);

TEST(GemmTest, Bf16NtFp32OutBias1000Cubed) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  expect_device_matches_host(
      make_desc({DType::kBFloat16, DType::kFloat32}, false, true, GemmEpilogue::kBias, {1000, 1000, 1000}), rng);
}

TEST(GemmTest, Bf16TnFp32OutBetaOneAccumulatesIntoD) {
  // The weight gradient: dW[out, in] += dy[T, out]^T x[T, in], with and
  // without the bias gradient; D holds the previous gradient, not NaN.
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  for (const GemmEpilogue epilogue : {GemmEpilogue::kNone, GemmEpilogue::kBiasGradOfA}) {
    GemmDesc desc = make_desc({DType::kBFloat16, DType::kFloat32}, true, false, epilogue, {96, 200, 333});
    desc.beta = 1.0f;
    expect_device_matches_host(desc, rng);
  }
}

bool bitwise_equal(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

TEST(GemmTest, Bf16SameDescTwiceIsBitwiseEqual) {
  // Small m and n with a long k invite split-k; the cached algorithm must
  // still give the same bits every time.
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  for (const GemmEpilogue epilogue : {GemmEpilogue::kNone, GemmEpilogue::kDGeluBGrad}) {
    const GemmDesc desc = make_desc({DType::kBFloat16, DType::kBFloat16}, false, false, epilogue, {64, 64, 8192});
    const HostOperands operands(desc, rng);
    const Outputs first = run_on_device(desc, operands);
    const Outputs second = run_on_device(desc, operands);
    EXPECT_TRUE(bitwise_equal(first.d, second.d)) << desc.to_string();
    if (writes_bias_grad(epilogue)) {
      EXPECT_TRUE(bitwise_equal(first.bias_grad, second.bias_grad)) << desc.to_string();
    }
  }
}

TEST(GemmTest, Bf16MisalignedDeviceOperandIsAnError) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const GemmDesc desc = valid_desc();
  const HostOperands host(desc, rng);
  const DeviceOperands device(host);
  GemmOperands operands = device.pointers();
  operands.b = static_cast<const char*>(operands.b) + 2;  // one bf16 element in
  Stream stream;
  expect_error_code([&] { launch_gemm(desc, operands, stream.get()); }, ErrorCode::kInvalidArgument, "operand 'b' at");
}

// Note [Deterministic algorithm choice]: a timed desc's pick leaves the
// process as a record and comes back unchanged; a record of another library
// or GPU, or one that contradicts this process's pick, is refused.
TEST(GemmTest, Bf16TimedPicksExportAndAdoptBack) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  GemmDesc desc = make_desc({DType::kBFloat16, DType::kBFloat16}, false, false, GemmEpilogue::kNone, {64, 64, 8192});
  desc.algorithm = AlgorithmChoice::kTimed;
  const HostOperands operands(desc, rng);
  const Outputs first = run_on_device(desc, operands);
  const std::string exported = export_timed_gemm_algorithms();
  const GemmAlgorithmRecord record = parse_gemm_algorithm_record(exported);
  EXPECT_EQ(record.identity, gemm_library_identity());
  const auto pick = std::find_if(record.picks.begin(), record.picks.end(),
                                 [&](const GemmAlgorithmPick& p) { return p.desc == desc; });
  ASSERT_NE(pick, record.picks.end()) << exported;
  EXPECT_NO_THROW(adopt_timed_gemm_algorithms(exported));
  EXPECT_TRUE(bitwise_equal(first.d, run_on_device(desc, operands).d));

  GemmAlgorithmRecord elsewhere = record;
  elsewhere.identity = "cuBLASLt 1, another GPU (1 SMs)";
  expect_error_code([&] { adopt_timed_gemm_algorithms(format_gemm_algorithm_record(elsewhere)); },
                    ErrorCode::kInvalidArgument, "were timed with 'cuBLASLt 1, another GPU");
  // Another algorithm for a desc this process already chose: refused, by
  // cuBLASLt's check of the altered words or by the cache, naming the desc.
  GemmAlgorithmRecord contradicting = record;
  for (GemmAlgorithmPick& p : contradicting.picks) p.algo[0] ^= 1;
  EXPECT_ERROR_CONTAINS(adopt_timed_gemm_algorithms(format_gemm_algorithm_record(contradicting)),
                        "gemm 64x64x8192");
}

TEST(GemmTest, HeuristicDescsAreNotRecorded) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const GemmDesc desc = make_desc({DType::kBFloat16, DType::kBFloat16}, false, true, GemmEpilogue::kNone, {48, 80, 96});
  (void)run_on_device(desc, HostOperands(desc, rng));
  for (const GemmAlgorithmPick& p : parse_gemm_algorithm_record(export_timed_gemm_algorithms()).picks) {
    EXPECT_EQ(p.desc.algorithm, AlgorithmChoice::kTimed) << p.desc.to_string();
  }
}

}  // namespace
}  // namespace stepgraph::kernels
