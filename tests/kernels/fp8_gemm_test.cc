// FP8 GEMMs (Note [FP8 GEMMs] in kernels/gemm.h): the host reference against
// a naive double loop, the checks, and (on a GPU) cuBLASLt against the host
// reference, tensor-wise scales read on the device, with and without fast
// accumulation.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/fp8.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "kernels/gemm.h"
#include "kernels/gemm_host.h"
#include "tests/support/expect_error.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

Fp8Format format_of(DType dtype) { return dtype == DType::kFloat8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3; }

// Random FP8 bytes of values in about [-8, 8] (quantized normals, never NaN).
std::vector<std::uint8_t> random_fp8(DType dtype, std::int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(count));
  for (auto& q : out) q = float_to_fp8(format_of(dtype), normal(rng));
  return out;
}

struct Fp8Problem {
  GemmDesc desc;
  std::vector<std::uint8_t> a, b;   // [m, k], [n, k]
  std::vector<float> bias;  // [n] (kBias), stored in D's dtype for the GEMM
  float a_scale_inv = 0.5f, b_scale_inv = 0.25f;
};

Fp8Problem make_problem(DType a_type, DType b_type, std::int64_t m, std::int64_t n, std::int64_t k, DType d_type,
                        bool bias, bool fast, std::mt19937& rng) {
  Fp8Problem p;
  p.desc.m = m;
  p.desc.n = n;
  p.desc.k = k;
  p.desc.trans_a = false;
  p.desc.trans_b = true;
  p.desc.a_type = a_type;
  p.desc.b_type = b_type;
  p.desc.d_type = d_type;
  p.desc.epilogue = bias ? GemmEpilogue::kBias : GemmEpilogue::kNone;
  p.desc.fast_accumulation = fast;
  p.a = random_fp8(a_type, m * k, rng);
  p.b = random_fp8(b_type, n * k, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Bias values bf16 can hold exactly, so both output dtypes read the same ones.
  for (std::int64_t j = 0; j < n; ++j) p.bias.push_back(bf16_to_float(float_to_bf16(normal(rng))));
  return p;
}

// The same product in double from the decoded bytes.
std::vector<double> naive(const Fp8Problem& p) {
  const GemmDesc& d = p.desc;
  std::vector<double> out(static_cast<std::size_t>(d.m * d.n));
  for (std::int64_t i = 0; i < d.m; ++i)
    for (std::int64_t j = 0; j < d.n; ++j) {
      double sum = 0.0;
      for (std::int64_t q = 0; q < d.k; ++q) {
        sum += static_cast<double>(fp8_to_float(format_of(d.a_type), p.a[i * d.k + q])) * p.a_scale_inv *
               static_cast<double>(fp8_to_float(format_of(d.b_type), p.b[j * d.k + q])) * p.b_scale_inv;
      }
      out[i * d.n + j] = d.alpha * sum + (d.epilogue == GemmEpilogue::kBias ? p.bias[j] : 0.0);
    }
  return out;
}

// The bias in D's dtype: fp32 as is, bf16 as raw bits.
std::vector<std::uint8_t> bias_bytes(const Fp8Problem& p) {
  std::vector<std::uint8_t> out(p.bias.size() * dtype_size(p.desc.d_type));
  for (std::size_t j = 0; j < p.bias.size(); ++j) {
    if (p.desc.d_type == DType::kFloat32) {
      std::memcpy(out.data() + 4 * j, &p.bias[j], 4);
    } else {
      const std::uint16_t bits = float_to_bf16(p.bias[j]);
      std::memcpy(out.data() + 2 * j, &bits, 2);
    }
  }
  return out;
}

std::vector<float> host_result(const Fp8Problem& p) {
  std::vector<float> d(static_cast<std::size_t>(p.desc.m * p.desc.n));
  std::vector<std::uint16_t> d16(d.size());
  const std::vector<std::uint8_t> bias = bias_bytes(p);
  GemmOperands ops;
  ops.a = p.a.data();
  ops.b = p.b.data();
  ops.bias = bias.data();
  ops.a_scale_inv = &p.a_scale_inv;
  ops.b_scale_inv = &p.b_scale_inv;
  ops.d = p.desc.d_type == DType::kFloat32 ? static_cast<void*>(d.data()) : static_cast<void*>(d16.data());
  host::gemm(p.desc, ops);
  if (p.desc.d_type != DType::kFloat32)
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = bf16_to_float(d16[i]);
  return d;
}

double max_relative(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

TEST(Fp8GemmHostTest, HostReferenceMatchesADoubleLoop) {
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  for (const auto& [a_type, b_type] : {std::pair{DType::kFloat8E4M3, DType::kFloat8E4M3},
                                       std::pair{DType::kFloat8E5M2, DType::kFloat8E4M3}}) {
    for (const bool bias : {false, true}) {
      const Fp8Problem p = make_problem(a_type, b_type, 32, 48, 64, DType::kFloat32, bias, false, rng);
      EXPECT_LT(max_relative(host_result(p), naive(p)), 1e-5) << p.desc.to_string();
    }
  }
}

TEST(Fp8GemmHostTest, ChecksNameWhatIsWrong) {
  GemmDesc good;
  good.m = good.n = good.k = 32;
  good.trans_b = true;
  good.a_type = good.b_type = DType::kFloat8E4M3;
  EXPECT_NO_THROW(check_gemm(good));
  GemmDesc nn = good;
  nn.trans_b = false;
  EXPECT_ERROR_CONTAINS(check_gemm(nn), "TN", "column-wise copy");
  GemmDesc e5 = good;
  e5.a_type = e5.b_type = DType::kFloat8E5M2;
  EXPECT_ERROR_CONTAINS(check_gemm(e5), "E5M2 x E5M2");
  GemmDesc mixed = good;
  mixed.b_type = DType::kBFloat16;
  EXPECT_ERROR_CONTAINS(check_gemm(mixed), "both A and B in FP8");
  GemmDesc odd = good;
  odd.k = 40;
  EXPECT_ERROR_CONTAINS(check_gemm(odd), "divisible by 16", "32x32x40");
  GemmDesc gelu = good;
  gelu.epilogue = GemmEpilogue::kGeluAuxBias;
  EXPECT_ERROR_CONTAINS(check_gemm(gelu), "none or bias", "gelu_aux_bias");
  GemmDesc fast_bf16;
  fast_bf16.m = fast_bf16.n = fast_bf16.k = 16;
  fast_bf16.fast_accumulation = true;
  EXPECT_ERROR_CONTAINS(check_gemm(fast_bf16), "fast_accumulation is for FP8");
}

TEST(Fp8GemmTest, CublasLtMatchesTheHostReference) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  Stream stream;
  for (const auto& [a_type, b_type] : {std::pair{DType::kFloat8E4M3, DType::kFloat8E4M3},
                                       std::pair{DType::kFloat8E5M2, DType::kFloat8E4M3},
                                       std::pair{DType::kFloat8E4M3, DType::kFloat8E5M2}}) {
    for (const DType d_type : {DType::kBFloat16, DType::kFloat32}) {
      for (const bool fast : {false, true}) {
        const Fp8Problem p = make_problem(a_type, b_type, 128, 96, 256, d_type, d_type == DType::kBFloat16, fast, rng);
        SCOPED_TRACE(p.desc.to_string());
        const std::vector<float> want = host_result(p);
        void *a = nullptr, *b = nullptr, *d = nullptr, *bias = nullptr, *scales = nullptr, *workspace = nullptr;
        const std::size_t d_bytes = want.size() * dtype_size(d_type);
        SG_CUDA_CHECK(cudaMalloc(&a, p.a.size()));
        SG_CUDA_CHECK(cudaMalloc(&b, p.b.size()));
        SG_CUDA_CHECK(cudaMalloc(&d, d_bytes));
        const std::vector<std::uint8_t> bias_host = bias_bytes(p);
        SG_CUDA_CHECK(cudaMalloc(&bias, bias_host.size()));
        SG_CUDA_CHECK(cudaMalloc(&scales, 2 * sizeof(float)));
        SG_CUDA_CHECK(cudaMalloc(&workspace, gemm_workspace_bytes()));
        const float scale_values[2] = {p.a_scale_inv, p.b_scale_inv};
        SG_CUDA_CHECK(cudaMemcpy(a, p.a.data(), p.a.size(), cudaMemcpyHostToDevice));
        SG_CUDA_CHECK(cudaMemcpy(b, p.b.data(), p.b.size(), cudaMemcpyHostToDevice));
        SG_CUDA_CHECK(cudaMemcpy(bias, bias_host.data(), bias_host.size(), cudaMemcpyHostToDevice));
        SG_CUDA_CHECK(cudaMemcpy(scales, scale_values, sizeof(scale_values), cudaMemcpyHostToDevice));
        GemmOperands ops;
        ops.a = a;
        ops.b = b;
        ops.d = d;
        ops.bias = bias;
        ops.workspace = workspace;
        ops.a_scale_inv = static_cast<const float*>(scales);
        ops.b_scale_inv = static_cast<const float*>(scales) + 1;
        bool launched = false;  // a refused combination fails this case (its trace names it) and the rest run
        EXPECT_NO_THROW({
          launch_gemm(p.desc, ops, stream.get());
          launched = true;
        });
        stream.synchronize();
        if (!launched) {
          for (void* pointer : {a, b, d, bias, scales, workspace}) cudaFree(pointer);
          continue;
        }
        std::vector<float> got(want.size());
        if (d_type == DType::kFloat32) {
          SG_CUDA_CHECK(cudaMemcpy(got.data(), d, d_bytes, cudaMemcpyDeviceToHost));
        } else {
          std::vector<std::uint16_t> raw(want.size());
          SG_CUDA_CHECK(cudaMemcpy(raw.data(), d, d_bytes, cudaMemcpyDeviceToHost));
          for (std::size_t i = 0; i < raw.size(); ++i) got[i] = bf16_to_float(raw[i]);
        }
        std::vector<double> want_double(want.begin(), want.end());
        // bf16 output rounding, and fast accumulation's fewer fp32 promotions.
        EXPECT_LT(max_relative(got, want_double), d_type == DType::kBFloat16 || fast ? 1e-2 : 1e-4);
        for (void* pointer : {a, b, d, bias, scales, workspace}) cudaFree(pointer);
      }
    }
  }
}

}  // namespace
}  // namespace stepgraph::kernels
