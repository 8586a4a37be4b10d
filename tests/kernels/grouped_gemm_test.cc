// Grouped GEMM: the host reference against a naive double-precision loop (on
// the CPU, through the ops on a host Context); the CUDA kernels against the
// host reference (GPU) for forward, dgrad and wgrad, bf16 and fp32 inputs,
// bf16 and fp32 outputs, bias, accumulate, on splits with empty groups, one
// group holding every token, skewed and ragged groups (multiples of no tile),
// and rows outside every group; a captured launch replayed while the split
// changes; and bad input as clear errors. Outputs start NaN-poisoned, so an
// element the kernels forget to write fails.
#include "kernels/grouped_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/stream.h"
#include "ops/grouped_gemm_ops.h"
#include "tests/kernels/grouped_splits.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using stepgraph::testing::DeviceArray;
using stepgraph::testing::expect_invalid_argument;
using stepgraph::testing::HostArray;
using stepgraph::testing::random_array;
using stepgraph::testing::relative_error;
using stepgraph::testing::tolerance_for;

using stepgraph::testing::common_splits;
using stepgraph::testing::offsets_of;
using stepgraph::testing::Split;

constexpr auto& kKinds = stepgraph::testing::kGroupedKinds;

// common_splits, and for E >= 4 groups: most tokens in the first group and
// the rest in the last, and out-of-range offsets (clamped into [0, T] and made
// nondecreasing by the kernels).
std::vector<Split> splits(std::int32_t tokens, std::int32_t experts, std::mt19937& rng) {
  std::vector<Split> out = common_splits(tokens, experts, rng);
  std::vector<std::int32_t> counts(experts, 0);
  counts[0] = tokens * 9 / 10;
  counts[experts - 1] = tokens - counts[0];
  out.push_back({"skewed_with_empty", offsets_of(counts)});

  std::vector<std::int32_t> wild = out[2].offsets;  // ragged_with_empty
  wild[0] = -5;
  wild[1] = tokens + 100;
  wild[2] = 3;
  out.push_back({"clamped", wild});
  return out;
}

struct Case {
  GroupedGemmDesc desc;
  std::vector<std::int32_t> offsets;
  HostArray x, w, dy, bias, out;  // out: the initial dw (accumulate)
};

std::int64_t out_numel(const GroupedGemmDesc& d) {
  switch (d.kind) {
    case GroupedGemmKind::kForward: return d.tokens * d.n;
    case GroupedGemmKind::kDgrad: return d.tokens * d.k;
    case GroupedGemmKind::kWgrad: return d.experts * d.n * d.k;
  }
  return 0;
}

Case make_case(const GroupedGemmDesc& d, std::vector<std::int32_t> offsets, std::mt19937& rng) {
  Case c{d, std::move(offsets), {}, {}, {}, {}, {}};
  c.x = random_array(d.in_type, d.tokens * d.k, rng);
  c.w = random_array(d.in_type, d.experts * d.n * d.k, rng);
  c.dy = random_array(d.in_type, d.tokens * d.n, rng);
  c.bias = random_array(d.in_type, d.experts * d.n, rng);
  c.out = random_array(d.out_type, out_numel(d), rng);
  return c;
}

GroupedGemmOperands host_operands(Case& c, void* out) {
  return {.x = c.x.data(),
          .w = c.w.data(),
          .dy = c.dy.data(),
          .bias = c.desc.bias ? c.bias.data() : nullptr,
          .offsets = c.offsets.data(),
          .out = out};
}

std::vector<float> run_host(Case& c) {
  HostArray out = c.desc.accumulate ? c.out : HostArray(c.desc.out_type, out_numel(c.desc));
  host::grouped_gemm(c.desc, host_operands(c, out.data()));
  return out.to_floats();
}

std::vector<float> run_cuda(Case& c, cudaStream_t stream) {
  DeviceArray x(c.x), w(c.w), dy(c.dy), bias(c.bias);
  DeviceArray offsets(c.offsets.size() * sizeof(std::int32_t));
  SG_CUDA_CHECK(cudaMemcpy(offsets.get(), c.offsets.data(), offsets.bytes(), cudaMemcpyHostToDevice));
  DeviceArray out(c.out.bytes.size());
  if (c.desc.accumulate) {
    out.upload(c.out);
  } else {
    out.poison();
  }
  launch_grouped_gemm(c.desc,
                      {.x = x.get(),
                       .w = w.get(),
                       .dy = dy.get(),
                       .bias = c.desc.bias ? bias.get() : nullptr,
                       .offsets = offsets.as<std::int32_t>(),
                       .out = out.get()},
                      stream);
  SG_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out.download(c.desc.out_type, out_numel(c.desc)).to_floats();
}

// The naive double-precision reference, written from the contract.
std::vector<float> reference(const Case& c) {
  const GroupedGemmDesc& d = c.desc;
  std::vector<std::int64_t> offs(c.offsets.begin(), c.offsets.end());
  for (std::size_t e = 0; e < offs.size(); ++e) {
    offs[e] = std::clamp<std::int64_t>(offs[e], 0, d.tokens);
    if (e > 0) offs[e] = std::max(offs[e], offs[e - 1]);
  }
  const std::int64_t n = d.n;
  const std::int64_t k = d.k;
  std::vector<float> out = d.accumulate ? c.out.to_floats() : std::vector<float>(out_numel(d));
  auto group_of = [&](std::int64_t t) -> std::int64_t {
    for (std::int64_t e = 0; e < d.experts; ++e)
      if (t >= offs[e] && t < offs[e + 1]) return e;
    return -1;
  };
  if (d.kind == GroupedGemmKind::kWgrad) {
    for (std::int64_t e = 0; e < d.experts; ++e)
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < k; ++j) {
          double sum = d.accumulate ? out[(e * n + i) * k + j] : 0.0;
          for (std::int64_t t = offs[e]; t < offs[e + 1]; ++t)
            sum += static_cast<double>(c.dy.get(t * n + i)) * c.x.get(t * k + j);
          out[(e * n + i) * k + j] = static_cast<float>(sum);
        }
    return out;
  }
  const bool forward = d.kind == GroupedGemmKind::kForward;
  const std::int64_t cols = forward ? n : k;
  for (std::int64_t t = 0; t < d.tokens; ++t) {
    const std::int64_t e = group_of(t);
    for (std::int64_t col = 0; col < cols; ++col) {
      double sum = 0.0;
      if (e >= 0) {
        if (forward) {
          for (std::int64_t j = 0; j < k; ++j)
            sum += static_cast<double>(c.x.get(t * k + j)) * c.w.get((e * n + col) * k + j);
          if (d.bias) sum += c.bias.get(e * n + col);
        } else {
          for (std::int64_t j = 0; j < n; ++j)
            sum += static_cast<double>(c.dy.get(t * n + j)) * c.w.get((e * n + j) * k + col);
        }
      }
      out[t * cols + col] = static_cast<float>(sum);
    }
  }
  return out;
}

GroupedGemmDesc desc_of(GroupedGemmKind kind, std::int64_t tokens, std::int64_t experts, std::int64_t n, std::int64_t k,
                        DType in, DType out, bool bias, bool accumulate) {
  return {.kind = kind,
          .tokens = tokens,
          .experts = experts,
          .n = n,
          .k = k,
          .in_type = in,
          .out_type = kind == GroupedGemmKind::kWgrad && in != DType::kBFloat16 ? DType::kFloat32 : out,
          .bias = kind == GroupedGemmKind::kForward && bias,
          .accumulate = kind == GroupedGemmKind::kWgrad && accumulate};
}

// Every kind x dtypes x bias/accumulate x split, for one size.
template <typename Check>
void for_each_case(std::int64_t tokens, std::int64_t experts, std::int64_t n, std::int64_t k, std::mt19937& rng,
                   Check&& check) {
  const DType ins[] = {DType::kBFloat16, DType::kFloat32};
  const DType outs[] = {DType::kBFloat16, DType::kFloat32};
  for (const Split& split : splits(static_cast<std::int32_t>(tokens), static_cast<std::int32_t>(experts), rng)) {
    for (GroupedGemmKind kind : kKinds) {
      for (DType in : ins) {
        for (DType out : outs) {
          // dw is fp32, or bf16 from bf16 inputs.
          if (kind == GroupedGemmKind::kWgrad && out != DType::kFloat32 && in != DType::kBFloat16) continue;
          for (bool flag : {false, true}) {  // bias (forward) or accumulate (wgrad)
            if (kind == GroupedGemmKind::kDgrad && flag) continue;
            Case c = make_case(desc_of(kind, tokens, experts, n, k, in, out, flag, flag), split.offsets, rng);
            SCOPED_TRACE(c.desc.to_string() + " split=" + split.name);
            check(c);
          }
        }
      }
    }
  }
}

TEST(GroupedGemmHostTest, MatchesDoubleReferenceOnEverySplit) {
  testing::SeededRng rng;
  // Ragged: N and K are multiples of 8 but of no tile size.
  for_each_case(/*tokens=*/53, /*experts=*/5, /*n=*/24, /*k=*/40, rng, [](Case& c) {
    const std::vector<float> want = reference(c);
    // The host reference sums in fp32; storing rounds to the output dtype.
    EXPECT_LE(relative_error(run_host(c), want), c.desc.out_type == DType::kFloat32 ? 1e-5 : 1e-2);
  });
}

TEST(GroupedGemmHostTest, RowsOutsideGroupsAreZeroAndEmptyGroupsGiveZeroGradients) {
  std::mt19937 rng(1);
  Case fwd = make_case(desc_of(GroupedGemmKind::kForward, 10, 4, 8, 8, DType::kFloat32, DType::kFloat32, true, false),
                       {2, 2, 6, 6, 8}, rng);
  const std::vector<float> y = run_host(fwd);
  for (std::int64_t t : {0, 1, 8, 9})
    for (std::int64_t c = 0; c < 8; ++c) EXPECT_EQ(y[t * 8 + c], 0.0f) << "row " << t;
  Case wgrad = make_case(desc_of(GroupedGemmKind::kWgrad, 10, 4, 8, 8, DType::kFloat32, DType::kFloat32, false, false),
                         {2, 2, 6, 6, 8}, rng);
  const std::vector<float> dw = run_host(wgrad);
  for (std::int64_t e : {0, 2})
    for (std::int64_t i = 0; i < 64; ++i) EXPECT_EQ(dw[e * 64 + i], 0.0f) << "empty group " << e;
}

TEST(GroupedGemmHostTest, ChecksDescriptions) {
  GroupedGemmDesc d =
      desc_of(GroupedGemmKind::kForward, 16, 2, 12, 16, DType::kBFloat16, DType::kBFloat16, false, false);
  expect_invalid_argument([&] { check_grouped_gemm(d); }, "multiples of 8");
  d.n = 16;
  d.experts = 0;
  expect_invalid_argument([&] { check_grouped_gemm(d); }, "expert count");
  d.experts = 2;
  d.out_type = DType::kFloat16;
  expect_invalid_argument([&] { check_grouped_gemm(d); }, "output dtype");
  d.out_type = DType::kBFloat16;
  d.accumulate = true;
  expect_invalid_argument([&] { check_grouped_gemm(d); }, "accumulate is for wgrad");
  d = desc_of(GroupedGemmKind::kWgrad, 16, 2, 16, 16, DType::kBFloat16, DType::kFloat32, false, false);
  d.out_type = DType::kBFloat16;
  check_grouped_gemm(d);  // a bf16 dw from bf16 inputs
  d.in_type = DType::kFloat32;
  expect_invalid_argument([&] { check_grouped_gemm(d); }, "dw must be fp32");
  d.in_type = DType::kBFloat16;
  d.out_type = DType::kFloat16;
  expect_invalid_argument([&] { check_grouped_gemm(d); }, "dw must be fp32");
  d.out_type = DType::kFloat32;
  d.in_type = DType::kInt32;
  try {
    check_grouped_gemm(d);
    ADD_FAILURE() << "int32 inputs passed the check";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kUnsupported) << error.what();
    EXPECT_NE(error.message().find("grouped_gemm wgrad: input dtype int32 is not supported"), std::string::npos)
        << error.what();
  }
}

// --- The ops, on a host Context ---------------------------------------------

Tensor host_tensor(Context& ctx, const std::string& name, const Shape& shape, DType dtype, const void* data) {
  Tensor t = ctx.persistent(name, {shape, dtype});
  ctx.copy_from_host(t, data, static_cast<std::size_t>(t.bytes()));
  return t;
}

std::vector<float> floats_of(Context& ctx, const Tensor& t) {
  HostArray host(t.dtype(), t.numel());
  ctx.copy_to_host(t, host.data(), host.bytes.size());
  return host.to_floats();
}

TEST(GroupedGemmOpsTest, HostOpsMatchReferenceWithBiasAndAccumulate) {
  testing::SeededRng rng;
  Context ctx(Device::kHost);
  const std::int64_t tokens = 37, experts = 4, n = 16, k = 24;
  const std::vector<std::int32_t> offsets{0, 0, 30, 31, 37};  // empty, big, single, ragged
  const Tensor offs = host_tensor(ctx, "offsets", Shape{experts + 1}, DType::kInt32, offsets.data());

  Case fwd = make_case(
      desc_of(GroupedGemmKind::kForward, tokens, experts, n, k, DType::kBFloat16, DType::kFloat32, true, false),
      offsets, rng);
  const Tensor x = host_tensor(ctx, "x", Shape{tokens, k}, DType::kBFloat16, fwd.x.data());
  const Tensor w = host_tensor(ctx, "w", Shape{experts, n, k}, DType::kBFloat16, fwd.w.data());
  const Tensor b = host_tensor(ctx, "b", Shape{experts, n}, DType::kBFloat16, fwd.bias.data());
  const Tensor dy = host_tensor(ctx, "dy", Shape{tokens, n}, DType::kBFloat16, fwd.dy.data());
  EXPECT_LE(
      relative_error(floats_of(ctx, ops::grouped_linear_forward(ctx, x, w, offs, b, DType::kFloat32)), reference(fwd)),
      1e-5);

  Case dgrad = fwd;
  dgrad.desc = desc_of(GroupedGemmKind::kDgrad, tokens, experts, n, k, DType::kBFloat16, DType::kFloat32, false, false);
  EXPECT_LE(
      relative_error(floats_of(ctx, ops::grouped_linear_dgrad(ctx, dy, w, offs, DType::kFloat32)), reference(dgrad)),
      1e-5);

  Case wgrad = fwd;
  wgrad.desc = desc_of(GroupedGemmKind::kWgrad, tokens, experts, n, k, DType::kBFloat16, DType::kFloat32, false, true);
  wgrad.out = random_array(DType::kFloat32, experts * n * k, rng);
  const Tensor dw = host_tensor(ctx, "dw", Shape{experts, n, k}, DType::kFloat32, wgrad.out.data());
  ops::grouped_linear_wgrad_(ctx, dw, dy, x, offs, /*accumulate=*/true);
  EXPECT_LE(relative_error(floats_of(ctx, dw), reference(wgrad)), 1e-5);

  // Bias gradient: sums of dy's rows per group; accumulating adds to db.
  const HostArray db0 = random_array(DType::kFloat32, experts * n, rng);
  const Tensor db = host_tensor(ctx, "db", Shape{experts, n}, DType::kFloat32, db0.data());
  ops::grouped_bias_grad_(ctx, db, dy, offs, /*accumulate=*/true);
  std::vector<float> want = db0.to_floats();
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t t = offsets[e]; t < offsets[e + 1]; ++t)
      for (std::int64_t c = 0; c < n; ++c) want[e * n + c] += fwd.dy.get(t * n + c);
  EXPECT_LE(relative_error(floats_of(ctx, db), want), 1e-5);
  ops::grouped_bias_grad_(ctx, db, dy, offs, /*accumulate=*/false);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(floats_of(ctx, db)[i], 0.0f) << "empty group 0 gives zeros";
}

TEST(GroupedGemmOpsTest, BadInputIsAClearError) {
  Context ctx(Device::kHost);
  auto make = [&](const std::string& name, Shape shape, DType dtype) { return ctx.persistent(name, {shape, dtype}); };
  const Tensor x = make("x", Shape{8, 16}, DType::kBFloat16);
  const Tensor w = make("w", Shape{2, 24, 16}, DType::kBFloat16);
  const Tensor offs = make("offsets", Shape{3}, DType::kInt32);
  const Tensor dy = make("dy", Shape{8, 24}, DType::kBFloat16);
  const DType bf16 = DType::kBFloat16;

  expect_invalid_argument(
      [&] {
        ops::grouped_linear_forward(ctx, make("x_k", Shape{8, 8}, bf16), w, offs, {}, bf16);
      },
      "K of x and of w");
  expect_invalid_argument(
      [&] {
        ops::grouped_linear_forward(ctx, make("x_f", Shape{8, 16}, DType::kFloat32), w, offs, {}, bf16);
      },
      "w must be fp32");
  expect_invalid_argument(
      [&] { ops::grouped_linear_forward(ctx, x, w, make("off64", Shape{3}, DType::kInt64), {}, bf16); },
      "offsets must be int32");
  expect_invalid_argument(
      [&] { ops::grouped_linear_forward(ctx, x, w, make("off4", Shape{4}, DType::kInt32), {}, bf16); },
      "expert counts of w and offsets");
  expect_invalid_argument(
      [&] {
        ops::grouped_linear_forward(ctx, x, w, offs, make("b", Shape{2, 16}, bf16), bf16);
      },
      "bias must be");
  expect_invalid_argument([&] { ops::grouped_linear_forward(ctx, x, w, offs, {}, DType::kFloat16); }, "output dtype");
  expect_invalid_argument(
      [&] {
        ops::grouped_linear_dgrad(ctx, make("dy_n", Shape{8, 16}, bf16), w, offs, bf16);
      },
      "N of dy and of w");
  expect_invalid_argument(
      [&] {
        ops::grouped_linear_wgrad_(ctx, make("dw16", Shape{2, 24, 16}, bf16), dy, x, offs, false);
      },
      "dw must be fp32");
  expect_invalid_argument(
      [&] {
        ops::grouped_linear_wgrad_(ctx, make("dw", Shape{2, 24, 16}, DType::kFloat32), dy,
                                   make("x_t", Shape{9, 16}, bf16), offs, false);
      },
      "token counts of dy and x");
  expect_invalid_argument(
      [&] {
        ops::grouped_bias_grad_(ctx, make("db", Shape{3, 24}, DType::kFloat32), dy, offs, false);
      },
      "expert counts of db and offsets");
}

// --- CUDA ---------------------------------------------------------------------

// Tolerance against the fp32 host reference: accumulation order differs.
double cuda_tolerance(const GroupedGemmDesc& d) {
  return d.out_type == DType::kFloat32 ? 2e-5 : tolerance_for(d.out_type);
}

TEST(GroupedGemmCudaTest, MatchesHostReferenceOnEverySplit) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  Stream stream;
  // Ragged sizes (multiples of 8, of no tile): several m, n and k tiles with
  // partial last tiles in each, and a small one with groups below one tile.
  for_each_case(/*tokens=*/700, /*experts=*/6, /*n=*/200, /*k=*/264, rng, [&](Case& c) {
    EXPECT_LE(relative_error(run_cuda(c, stream.get()), run_host(c)), cuda_tolerance(c.desc));
  });
  for_each_case(/*tokens=*/1500, /*experts=*/4, /*n=*/520, /*k=*/72, rng, [&](Case& c) {
    if (c.desc.kind != GroupedGemmKind::kForward) return;  // more than one 256-column tile
    EXPECT_LE(relative_error(run_cuda(c, stream.get()), run_host(c)), cuda_tolerance(c.desc));
  });
  for_each_case(/*tokens=*/45, /*experts=*/4, /*n=*/16, /*k=*/8, rng, [&](Case& c) {
    EXPECT_LE(relative_error(run_cuda(c, stream.get()), run_host(c)), cuda_tolerance(c.desc));
  });
}

// The warp-specialised kernel (bf16 in) where its tile schedule has edges:
// a partial last 256-column tile, several n-tiles in dgrad and wgrad (K =
// 520) and m-tiles in wgrad (N = 520), and a group of more than 16 m-tiles
// (4200 rows: bands of 16, 16 and 1 m-tiles of the fixed raster band) next
// to empty ones; wgrad reduces over groups of many 64-token stages.
TEST(GroupedGemmCudaTest, WarpSpecialisedTileScheduleMatchesHostReference) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  Stream stream;
  for (auto [tokens, experts, n, k] :
       {std::array<std::int64_t, 4>{600, 4, 520, 72}, {300, 3, 136, 520}, {4200, 4, 264, 64}}) {
    for_each_case(tokens, experts, n, k, rng, [&](Case& c) {
      if (c.desc.in_type != DType::kBFloat16) return;
      EXPECT_LE(relative_error(run_cuda(c, stream.get()), run_host(c)), cuda_tolerance(c.desc));
    });
  }
}

TEST(GroupedGemmCudaTest, BiasGradMatchesHostReference) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  Stream stream;
  const std::int64_t tokens = 1000, experts = 5, n = 72;
  for (const Split& split : splits(tokens, experts, rng)) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(split.name + " " + std::string(dtype_name(dtype)) + (accumulate ? " accumulate" : ""));
        const GroupedBiasGradDesc d{tokens, experts, n, dtype, accumulate};
        const HostArray dy = random_array(dtype, tokens * n, rng);
        HostArray db = random_array(DType::kFloat32, experts * n, rng);
        DeviceArray ddy(dy), ddb(db), doffs(split.offsets.size() * 4);
        SG_CUDA_CHECK(cudaMemcpy(doffs.get(), split.offsets.data(), doffs.bytes(), cudaMemcpyHostToDevice));
        if (!accumulate) ddb.poison();
        launch_grouped_bias_grad(d, ddy.get(), doffs.as<std::int32_t>(), ddb.as<float>(), stream.get());
        host::grouped_bias_grad(d, dy.data(), split.offsets.data(), static_cast<float*>(db.data()));
        EXPECT_LE(relative_error(ddb.download(DType::kFloat32, experts * n).to_floats(), db.to_floats()), 1e-5);
      }
    }
  }
}

// One capture of each kind, replayed while the offsets in device memory
// change: the launch configuration must not depend on the split.
TEST(GroupedGemmCudaTest, CapturedLaunchFollowsChangingSplits) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  Stream stream;
  const std::int64_t tokens = 600, experts = 8, n = 136, k = 96;
  for (GroupedGemmKind kind : kKinds) {
    Case c = make_case(desc_of(kind, tokens, experts, n, k, DType::kBFloat16, DType::kFloat32, true, false),
                       std::vector<std::int32_t>(experts + 1, 0), rng);
    SCOPED_TRACE(c.desc.to_string());
    DeviceArray x(c.x), w(c.w), dy(c.dy), bias(c.bias), out(c.out.bytes.size()), offs((experts + 1) * 4);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    SG_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    launch_grouped_gemm(c.desc,
                        {.x = x.get(),
                         .w = w.get(),
                         .dy = dy.get(),
                         .bias = c.desc.bias ? bias.get() : nullptr,
                         .offsets = offs.as<std::int32_t>(),
                         .out = out.get()},
                        stream.get());
    SG_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
    SG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 4; ++replay) {
      for (const Split& split : splits(tokens, experts, rng)) {
        c.offsets = split.offsets;
        SG_CUDA_CHECK(cudaMemcpy(offs.get(), c.offsets.data(), offs.bytes(), cudaMemcpyHostToDevice));
        out.poison();
        SG_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
        SG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        EXPECT_LE(relative_error(out.download(DType::kFloat32, out_numel(c.desc)).to_floats(), run_host(c)), 2e-5)
            << "replay " << replay << " split " << split.name;
      }
    }
    SG_CUDA_CHECK(cudaGraphExecDestroy(exec));
    SG_CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

// The ops on an eager CUDA Context against the same ops on a host Context.
TEST(GroupedGemmCudaTest, CudaOpsMatchHostOps) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  const std::int64_t tokens = 333, experts = 3, n = 64, k = 136;
  const std::vector<std::int32_t> offsets{0, 200, 200, 333};
  const HostArray x = random_array(DType::kBFloat16, tokens * k, rng);
  const HostArray w = random_array(DType::kBFloat16, experts * n * k, rng);
  const HostArray dy = random_array(DType::kBFloat16, tokens * n, rng);
  std::vector<std::vector<float>> results[2];
  for (Device device : {Device::kHost, Device::kCuda}) {
    Context ctx(device);
    const Tensor tx = host_tensor(ctx, "x", Shape{tokens, k}, DType::kBFloat16, x.data());
    const Tensor tw = host_tensor(ctx, "w", Shape{experts, n, k}, DType::kBFloat16, w.data());
    const Tensor tdy = host_tensor(ctx, "dy", Shape{tokens, n}, DType::kBFloat16, dy.data());
    const Tensor to = host_tensor(ctx, "offsets", Shape{experts + 1}, DType::kInt32, offsets.data());
    const Tensor dw = ctx.persistent("dw", {Shape{experts, n, k}, DType::kFloat32});
    const Tensor db = ctx.persistent("db", {Shape{experts, n}, DType::kFloat32});
    ops::grouped_linear_wgrad_(ctx, dw, tdy, tx, to, false);
    ops::grouped_bias_grad_(ctx, db, tdy, to, false);
    auto& r = results[device == Device::kCuda ? 1 : 0];
    r.push_back(floats_of(ctx, ops::grouped_linear_forward(ctx, tx, tw, to, {}, DType::kFloat32)));
    r.push_back(floats_of(ctx, ops::grouped_linear_dgrad(ctx, tdy, tw, to, DType::kFloat32)));
    r.push_back(floats_of(ctx, dw));
    r.push_back(floats_of(ctx, db));
  }
  for (std::size_t i = 0; i < results[0].size(); ++i)
    EXPECT_LE(relative_error(results[1][i], results[0][i]), 2e-5) << i;
}

}  // namespace
}  // namespace stepgraph::kernels
