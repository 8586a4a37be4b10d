// FP8 GEMMs (Note [FP8 GEMMs] in kernels/gemm.h): the host reference against
// a naive double loop, the checks, and (on a GPU) cuBLASLt against the host
// reference, tensor-wise scales read on the device, with and without fast
// accumulation.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
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
  // One scalar each, or the block scales in the GEMM's layouts (padding 0).
  std::vector<float> a_scale_inv{0.5f}, b_scale_inv{0.25f};
};

// Random block scales in [1/4, 4] where `blocks` says, else the scalar kept.
void draw_block_scales(const std::optional<BlockShape>& blocks, std::int64_t outer, std::int64_t k,
                       std::vector<float>& scales, std::mt19937& rng) {
  if (!blocks) return;
  const BlockScaleLayout layout{*blocks, outer, k};
  scales.assign(static_cast<std::size_t>(layout.count()), 0.0f);
  std::uniform_real_distribution<float> exponent(-2.0f, 2.0f);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t kk = 0; kk < k; kk += kScaleBlock) scales[layout.index(o, kk)] = std::exp2(exponent(rng));
}

Fp8Problem make_problem(DType a_type, DType b_type, std::int64_t m, std::int64_t n, std::int64_t k, DType d_type,
                        bool bias, bool fast, std::mt19937& rng, std::optional<BlockShape> a_blocks = std::nullopt,
                        std::optional<BlockShape> b_blocks = std::nullopt) {
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
  p.desc.a_blocks = a_blocks;
  p.desc.b_blocks = b_blocks;
  draw_block_scales(a_blocks, m, k, p.a_scale_inv, rng);
  draw_block_scales(b_blocks, n, k, p.b_scale_inv, rng);
  p.a = random_fp8(a_type, m * k, rng);
  p.b = random_fp8(b_type, n * k, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Bias values bf16 can hold exactly, so both output dtypes read the same ones.
  for (std::int64_t j = 0; j < n; ++j) p.bias.push_back(bf16_to_float(float_to_bf16(normal(rng))));
  return p;
}

// An operand's scale_inv at (outer, k).
float scale_at(const std::vector<float>& scales, const std::optional<BlockShape>& blocks, std::int64_t outer_size,
               std::int64_t k_size, std::int64_t outer, std::int64_t k) {
  return blocks ? scales[BlockScaleLayout{*blocks, outer_size, k_size}.index(outer, k)] : scales[0];
}

// The same product in double from the decoded bytes.
std::vector<double> naive(const Fp8Problem& p) {
  const GemmDesc& d = p.desc;
  std::vector<double> out(static_cast<std::size_t>(d.m * d.n));
  for (std::int64_t i = 0; i < d.m; ++i)
    for (std::int64_t j = 0; j < d.n; ++j) {
      double sum = 0.0;
      for (std::int64_t q = 0; q < d.k; ++q) {
        sum += static_cast<double>(fp8_to_float(format_of(d.a_type), p.a[i * d.k + q])) *
               scale_at(p.a_scale_inv, d.a_blocks, d.m, d.k, i, q) *
               static_cast<double>(fp8_to_float(format_of(d.b_type), p.b[j * d.k + q])) *
               scale_at(p.b_scale_inv, d.b_blocks, d.n, d.k, j, q);
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
  ops.a_scale_inv = p.a_scale_inv.data();
  ops.b_scale_inv = p.b_scale_inv.data();
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

// The block-scaled pairs cuBLASLt has: x W^T and dy W (1 x 128 by 128 x 128),
// dy^T x (both 1 x 128), and the 128 x 128 operand first.
constexpr std::pair<BlockShape, BlockShape> kBlockPairs[] = {{BlockShape::k1x128, BlockShape::k128x128},
                                                             {BlockShape::k1x128, BlockShape::k1x128},
                                                             {BlockShape::k128x128, BlockShape::k1x128}};

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
  // Block scales: each block's own scale_inv, in the GEMM's layouts (k 384: three k blocks, padded to four).
  for (const auto& [a_blocks, b_blocks] : kBlockPairs) {
    const Fp8Problem p = make_problem(DType::kFloat8E4M3, DType::kFloat8E4M3, 128, 256, 384, DType::kFloat32, false,
                                      false, rng, a_blocks, b_blocks);
    EXPECT_LT(max_relative(host_result(p), naive(p)), 1e-5) << p.desc.to_string();
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
  GemmDesc blocks = good;
  blocks.k = 256;
  blocks.a_blocks = BlockShape::k1x128;
  EXPECT_ERROR_CONTAINS(check_gemm(blocks), "both operands block-scaled");
  blocks.b_blocks = BlockShape::k128x128;
  EXPECT_NO_THROW(check_gemm(blocks));
  GemmDesc two_tiles = blocks;
  two_tiles.a_blocks = BlockShape::k128x128;
  EXPECT_ERROR_CONTAINS(check_gemm(two_tiles), "two 128 x 128");
  GemmDesc short_k = blocks;
  short_k.k = 192;
  EXPECT_ERROR_CONTAINS(check_gemm(short_k), "k divisible by 128");
  GemmDesc fast_blocks = blocks;
  fast_blocks.fast_accumulation = true;
  EXPECT_ERROR_CONTAINS(check_gemm(fast_blocks), "no fast accumulation");
  EXPECT_NO_THROW(check_fp8_device(9, 0, "NVIDIA H100"));
  EXPECT_ERROR_CONTAINS(check_fp8_device(8, 0, "NVIDIA A100"), "Hopper", "NVIDIA A100 is 8.0", "no FP8 tensor cores");
  EXPECT_ERROR_CONTAINS(check_fp8_device(8, 9, "NVIDIA L4"), "NVIDIA L4 is 8.9", "sm_90a");
  GemmDesc fast_bf16;
  fast_bf16.m = fast_bf16.n = fast_bf16.k = 16;
  fast_bf16.fast_accumulation = true;
  EXPECT_ERROR_CONTAINS(check_gemm(fast_bf16), "fast_accumulation is for FP8");
}

// cuBLASLt against the host reference on one problem; a refused combination
// fails here with the desc in its trace, and the caller's other cases run.
void check_on_device(const Fp8Problem& p, Stream& stream) {
  SCOPED_TRACE(p.desc.to_string());
  const std::vector<float> want = host_result(p);
  const DType d_type = p.desc.d_type;
  const std::vector<std::uint8_t> bias_host = bias_bytes(p);
  auto upload = [](const void* data, std::size_t bytes) {
    void* pointer = nullptr;
    SG_CUDA_CHECK(cudaMalloc(&pointer, std::max<std::size_t>(bytes, 16)));  // separate allocations: 256-byte aligned
    SG_CUDA_CHECK(cudaMemcpy(pointer, data, bytes, cudaMemcpyHostToDevice));
    return pointer;
  };
  void* a = upload(p.a.data(), p.a.size());
  void* b = upload(p.b.data(), p.b.size());
  void* bias = upload(bias_host.data(), bias_host.size());
  void* a_scales = upload(p.a_scale_inv.data(), p.a_scale_inv.size() * sizeof(float));
  void* b_scales = upload(p.b_scale_inv.data(), p.b_scale_inv.size() * sizeof(float));
  void *d = nullptr, *workspace = nullptr;
  const std::size_t d_bytes = want.size() * dtype_size(d_type);
  SG_CUDA_CHECK(cudaMalloc(&d, d_bytes));
  SG_CUDA_CHECK(cudaMalloc(&workspace, gemm_workspace_bytes()));
  const GemmOperands ops{.a = a,
                         .b = b,
                         .d = d,
                         .bias = bias,
                         .workspace = workspace,
                         .a_scale_inv = static_cast<const float*>(a_scales),
                         .b_scale_inv = static_cast<const float*>(b_scales)};
  bool launched = false;
  EXPECT_NO_THROW({
    launch_gemm(p.desc, ops, stream.get());
    launched = true;
  });
  stream.synchronize();
  if (launched) {
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
    // Hopper's FP8 tensor cores accumulate in less than fp32 between
    // promotions even without fast accumulation: measured 2e-4 to 3e-4 at
    // k = 256 on an H200 (fp32 D).
    EXPECT_LT(max_relative(got, want_double), d_type == DType::kBFloat16 || p.desc.fast_accumulation ? 1e-2 : 1e-3);
  }
  for (void* pointer : {a, b, d, bias, a_scales, b_scales, workspace}) cudaFree(pointer);
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
        check_on_device(make_problem(a_type, b_type, 128, 96, 256, d_type, d_type == DType::kBFloat16, fast, rng),
                        stream);
      }
    }
  }
}

TEST(Fp8GemmTest, BlockScaledCublasLtMatchesTheHostReference) {
  SG_SKIP_WITHOUT_GPU();
  const testing::TestSeed seed;
  std::mt19937 rng(seed.value());
  Stream stream;
  for (const auto& [a_blocks, b_blocks] : kBlockPairs) {
    for (const DType d_type : {DType::kBFloat16, DType::kFloat32}) {
      // k 384: three k blocks, the 128 x 128 scales padded to four.
      check_on_device(make_problem(DType::kFloat8E4M3, DType::kFloat8E4M3, 256, 128, 384, d_type,
                                   d_type == DType::kBFloat16, false, rng, a_blocks, b_blocks),
                      stream);
    }
  }
  // A gradient in E5M2 against E4M3 blocks, as the hybrid recipe's backward has.
  check_on_device(make_problem(DType::kFloat8E5M2, DType::kFloat8E4M3, 128, 256, 256, DType::kBFloat16, false, false,
                               rng, BlockShape::k1x128, BlockShape::k128x128),
                  stream);
}

}  // namespace
}  // namespace stepgraph::kernels
