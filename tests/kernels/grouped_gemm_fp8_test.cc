// FP8 grouped GEMM (Note [FP8 grouped GEMM] in kernels/grouped_gemm_ws.cu):
// the host reference against a double-precision loop over the decoded
// logical matrices, which holds the reference to the contract's layouts
// (row-wise forward operands, w's column-wise copy for dgrad, the transposed
// copies of dy and x for wgrad); and the wgmma kernels against the host
// reference (GPU) for forward, dgrad and wgrad, E4M3 and E5M2 gradients, bf16
// and fp32 outputs, bias and accumulate, fast and split accumulation (whose
// error stays flat in the reduction's depth), on splits with empty groups, one
// group holding every token, ragged group ends (multiples of nothing, so a
// wgrad token box straddles two groups) and rows outside every group.
// Outputs start NaN-poisoned, so an element the kernels forget to write fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/fp8.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "kernels/grouped_gemm.h"
#include "tests/kernels/grouped_splits.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using stepgraph::testing::DeviceArray;
using stepgraph::testing::relative_error;

using stepgraph::testing::common_splits;
using stepgraph::testing::Split;

constexpr auto& kKinds = stepgraph::testing::kGroupedKinds;

// Random FP8 codes of values in [-2, 2) (finite, exactly representable).
std::vector<std::uint8_t> random_codes(Fp8Format format, std::int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(n));
  for (std::uint8_t& code : out) code = float_to_fp8(format, uniform(rng));
  return out;
}

// [rows, cols] bytes transposed to [cols, rows].
std::vector<std::uint8_t> transposed(const std::vector<std::uint8_t>& m, std::int64_t rows, std::int64_t cols) {
  std::vector<std::uint8_t> out(m.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) out[c * rows + r] = m[r * cols + c];
  }
  return out;
}

// One problem: the logical matrices X [T, K], W [E, N, K], DY [T, N] as FP8
// codes (row-major), and what each kind reads.
struct Fp8Case {
  GroupedGemmDesc desc;
  std::vector<std::int32_t> offsets;
  std::vector<std::uint8_t> x, w, dy;  // logical, row-major
  std::vector<float> bias;             // [E, N], bf16-rounded
  std::vector<float> initial_dw;       // accumulate's starting dw
  float x_scale_inv = 0.5f, w_scale_inv = 0.25f, dy_scale_inv = 2.0f;

  Fp8Format dy_format() const { return desc.dy_type == DType::kFloat8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; }
  // The kind's operands in the contract's layouts.
  std::vector<std::uint8_t> x_operand() const {
    return desc.kind == GroupedGemmKind::kWgrad ? transposed(x, desc.tokens, desc.k) : x;
  }
  std::vector<std::uint8_t> w_operand() const {
    return desc.kind == GroupedGemmKind::kDgrad ? transposed(w, desc.experts * desc.n, desc.k) : w;
  }
  std::vector<std::uint8_t> dy_operand() const {
    return desc.kind == GroupedGemmKind::kWgrad ? transposed(dy, desc.tokens, desc.n) : dy;
  }
  std::int64_t out_numel() const {
    switch (desc.kind) {
      case GroupedGemmKind::kForward: return desc.tokens * desc.n;
      case GroupedGemmKind::kDgrad: return desc.tokens * desc.k;
      case GroupedGemmKind::kWgrad: return desc.experts * desc.n * desc.k;
    }
    return 0;
  }
};

Fp8Case make_case(GroupedGemmKind kind, std::int64_t tokens, std::int64_t experts, std::int64_t n, std::int64_t k,
                  DType dy_type, DType out, bool flag, bool split, std::vector<std::int32_t> offsets,
                  std::mt19937& rng) {
  Fp8Case c;
  c.desc = {.kind = kind,
            .tokens = tokens,
            .experts = experts,
            .n = n,
            .k = k,
            .in_type = DType::kFloat8E4M3,
            .dy_type = dy_type,
            .out_type = kind == GroupedGemmKind::kWgrad ? DType::kFloat32 : out,
            .bias = kind == GroupedGemmKind::kForward && flag,
            .accumulate = kind == GroupedGemmKind::kWgrad && flag,
            .split_accumulation = split};
  c.offsets = std::move(offsets);
  c.x = random_codes(Fp8Format::kE4M3, tokens * k, rng);
  c.w = random_codes(Fp8Format::kE4M3, experts * n * k, rng);
  c.dy = random_codes(c.dy_format(), tokens * n, rng);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (std::int64_t i = 0; i < experts * n; ++i) c.bias.push_back(bf16_to_float(float_to_bf16(uniform(rng))));
  for (std::int64_t i = 0; i < experts * n * k; ++i) c.initial_dw.push_back(uniform(rng));
  return c;
}

// The contract on the logical matrices, in double.
std::vector<float> expected(const Fp8Case& c) {
  const GroupedGemmDesc& d = c.desc;
  auto X = [&](std::int64_t t, std::int64_t j) { return double{fp8_to_float(Fp8Format::kE4M3, c.x[t * d.k + j])}; };
  auto W = [&](std::int64_t e, std::int64_t i, std::int64_t j) {
    return double{fp8_to_float(Fp8Format::kE4M3, c.w[(e * d.n + i) * d.k + j])};
  };
  auto DY = [&](std::int64_t t, std::int64_t i) { return double{fp8_to_float(c.dy_format(), c.dy[t * d.n + i])}; };
  std::vector<std::int64_t> offs(c.offsets.begin(), c.offsets.end());
  std::vector<float> out(static_cast<std::size_t>(c.out_numel()), 0.0f);
  if (d.kind == GroupedGemmKind::kWgrad) {
    for (std::int64_t e = 0; e < d.experts; ++e) {
      for (std::int64_t i = 0; i < d.n; ++i) {
        for (std::int64_t j = 0; j < d.k; ++j) {
          double sum = 0;
          for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t) sum += DY(t, i) * X(t, j);
          const std::int64_t index = (e * d.n + i) * d.k + j;
          out[index] = static_cast<float>(sum * c.dy_scale_inv * c.x_scale_inv) + (d.accumulate ? c.initial_dw[index] : 0);
        }
      }
    }
    return out;
  }
  const bool forward = d.kind == GroupedGemmKind::kForward;
  const std::int64_t cols = forward ? d.n : d.k;
  for (std::int64_t e = 0; e < d.experts; ++e) {
    for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t) {
      for (std::int64_t col = 0; col < cols; ++col) {
        double sum = 0;
        if (forward) {
          for (std::int64_t j = 0; j < d.k; ++j) sum += X(t, j) * W(e, col, j);
          sum *= c.x_scale_inv * c.w_scale_inv;
          if (d.bias) sum += c.bias[e * d.n + col];
        } else {
          for (std::int64_t j = 0; j < d.n; ++j) sum += DY(t, j) * W(e, j, col);
          sum *= c.dy_scale_inv * c.w_scale_inv;
        }
        out[t * cols + col] = static_cast<float>(sum);
      }
    }
  }
  return out;
}

std::vector<float> as_floats(DType dtype, const std::vector<std::uint8_t>& bytes, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) out[i] = load_as_float(dtype, bytes.data(), i);
  return out;
}

std::vector<std::uint16_t> bf16_bias(const Fp8Case& c) {
  std::vector<std::uint16_t> out;
  for (float b : c.bias) out.push_back(float_to_bf16(b));
  return out;
}

std::vector<float> run_host(const Fp8Case& c) {
  const std::vector<std::uint8_t> x = c.x_operand(), w = c.w_operand(), dy = c.dy_operand();
  const std::vector<std::uint16_t> bias = bf16_bias(c);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(c.out_numel()) * dtype_size(c.desc.out_type));
  if (c.desc.accumulate) std::memcpy(out.data(), c.initial_dw.data(), out.size());
  host::grouped_gemm(c.desc, {.x = x.data(),
                              .w = w.data(),
                              .dy = dy.data(),
                              .bias = bias.data(),
                              .offsets = c.offsets.data(),
                              .out = out.data(),
                              .x_scale_inv = &c.x_scale_inv,
                              .w_scale_inv = &c.w_scale_inv,
                              .dy_scale_inv = &c.dy_scale_inv});
  return as_floats(c.desc.out_type, out, c.out_numel());
}

template <typename T>
std::unique_ptr<DeviceArray> upload(const std::vector<T>& host) {
  auto out = std::make_unique<DeviceArray>(host.size() * sizeof(T));
  SG_CUDA_CHECK(cudaMemcpy(out->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return out;
}

std::vector<float> run_cuda(const Fp8Case& c, cudaStream_t stream) {
  const auto x = upload(c.x_operand()), w = upload(c.w_operand()), dy = upload(c.dy_operand());
  const auto bias = upload(bf16_bias(c)), offsets = upload(c.offsets);
  const auto scales = upload(std::vector<float>{c.x_scale_inv, c.w_scale_inv, c.dy_scale_inv});
  DeviceArray out(static_cast<std::size_t>(c.out_numel()) * dtype_size(c.desc.out_type));
  if (c.desc.accumulate) {
    SG_CUDA_CHECK(cudaMemcpy(out.get(), c.initial_dw.data(), out.bytes(), cudaMemcpyHostToDevice));
  } else {
    out.poison();
  }
  SG_CUDA_CHECK(cudaDeviceSynchronize());
  const float* s = scales->as<float>();
  launch_grouped_gemm(c.desc,
                      {.x = x->get(),
                       .w = w->get(),
                       .dy = dy->get(),
                       .bias = bias->get(),
                       .offsets = offsets->as<std::int32_t>(),
                       .out = out.get(),
                       .x_scale_inv = s,
                       .w_scale_inv = s + 1,
                       .dy_scale_inv = s + 2},
                      stream);
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out.download(c.desc.out_type, c.out_numel()).to_floats();
}

// Every kind, gradient format, output dtype and flag on every split of one shape.
template <typename Check>
void for_each_case(std::int64_t tokens, std::int64_t experts, std::int64_t n, std::int64_t k, std::mt19937& rng,
                   Check&& check) {
  for (const Split& split : common_splits(static_cast<std::int32_t>(tokens), static_cast<std::int32_t>(experts), rng)) {
    for (GroupedGemmKind kind : kKinds) {
      for (DType dy_type : {DType::kFloat8E5M2, DType::kFloat8E4M3}) {
        if (kind == GroupedGemmKind::kForward && dy_type == DType::kFloat8E4M3) continue;  // reads no dy
        for (DType out : {DType::kBFloat16, DType::kFloat32}) {
          if (kind == GroupedGemmKind::kWgrad && out != DType::kFloat32) continue;
          for (bool flag : {false, true}) {
            if (kind == GroupedGemmKind::kDgrad && flag) continue;
            // Split accumulation where its precision shows: fp32 outputs, without the flags.
            for (bool split_sums : {false, true}) {
              if (split_sums && (flag || out != DType::kFloat32)) continue;
              const Fp8Case c =
                  make_case(kind, tokens, experts, n, k, dy_type, out, flag, split_sums, split.offsets, rng);
              SCOPED_TRACE(split.name + " " + c.desc.to_string());
              check(c);
            }
          }
        }
      }
    }
  }
}

double tolerance(const Fp8Case& c) { return c.desc.out_type == DType::kFloat32 ? 1e-5 : 1e-2; }

TEST(GroupedGemmFp8HostTest, ReferenceReadsTheContractLayouts) {
  testing::SeededRng rng;
  for_each_case(/*tokens=*/48, /*experts=*/3, /*n=*/32, /*k=*/16, rng, [&](const Fp8Case& c) {
    EXPECT_LE(relative_error(run_host(c), expected(c)), tolerance(c));
  });
}

TEST(GroupedGemmFp8HostTest, BadShapesAreClearErrors) {
  GroupedGemmDesc d{.kind = GroupedGemmKind::kForward,
                    .tokens = 32,
                    .experts = 2,
                    .n = 24,
                    .k = 32,
                    .in_type = DType::kFloat8E4M3,
                    .out_type = DType::kBFloat16};
  EXPECT_ERROR_CONTAINS(check_grouped_gemm(d), "multiples of 16", "N=24");
  d.n = 32;
  d.dy_type = DType::kBFloat16;
  EXPECT_ERROR_CONTAINS(check_grouped_gemm(d), "FP8 dy must be");
  d.dy_type = DType::kFloat8E5M2;
  d.kind = GroupedGemmKind::kWgrad;
  d.out_type = DType::kFloat32;
  d.tokens = 40;
  EXPECT_ERROR_CONTAINS(check_grouped_gemm(d), "T a multiple of 16", "T=40");
  d.in_type = DType::kFloat8E5M2;
  EXPECT_ERROR_CONTAINS(check_grouped_gemm(d), "x and w in e4m3");
  d = GroupedGemmDesc{.kind = GroupedGemmKind::kForward, .tokens = 32, .experts = 2, .n = 32, .k = 32,
                      .in_type = DType::kBFloat16, .out_type = DType::kBFloat16, .split_accumulation = true};
  EXPECT_ERROR_CONTAINS(check_grouped_gemm(d), "split_accumulation is for FP8");
}

// --- CUDA ---------------------------------------------------------------------

// The tensor cores sum FP8 products in an order and, with fast accumulation,
// at a precision of their own (Note [FP8 grouped GEMM]: fewer bits than
// fp32, 2e-4 of the norm measured on the H100 at a reduction of 304, 1.2e-3
// at 4224). Split accumulation keeps fp32 totals of 128-deep partial sums:
// 1.1e-4 at most from 304 to 4224 (the partial sums' own precision), flat in
// the depth.
double cuda_tolerance(const Fp8Case& c) {
  if (c.desc.out_type != DType::kFloat32) return 1e-2;
  if (c.desc.split_accumulation) return 2e-4;
  const double depth = c.desc.kind == GroupedGemmKind::kForward ? c.desc.k
                       : c.desc.kind == GroupedGemmKind::kDgrad ? c.desc.n
                                                                : c.desc.tokens;
  return 1e-3 * std::max(1.0, std::sqrt(depth / 1024.0));
}

TEST(GroupedGemmFp8CudaTest, MatchesHostReferenceOnEverySplit) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  Stream stream;
  // Partial last tiles everywhere: K = 304 (two 256-column tiles of dx and
  // dw), N = 48; then long groups (many 128-token stages a wgrad tile, more
  // than 16 m-tiles a forward group) and several N tiles.
  for (auto [tokens, experts, n, k] :
       {std::array<std::int64_t, 4>{272, 4, 48, 304}, {1040, 3, 272, 160}, {4224, 2, 144, 64}}) {
    for_each_case(tokens, experts, n, k, rng, [&](const Fp8Case& c) {
      EXPECT_LE(relative_error(run_cuda(c, stream.get()), run_host(c)), cuda_tolerance(c));
    });
  }
}

}  // namespace
}  // namespace stepgraph::kernels
