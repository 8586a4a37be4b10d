// Vocabulary-parallel cross-entropy kernels (Note [Vocabulary-parallel
// cross-entropy]): the host references of the three steps, run for N
// simulated ranks with the two all-reduces done here in rank order (as the
// host world does), against the plain formulas over the whole vocabulary in
// double; an all -inf slice, ignored and out-of-range labels, argument checks
// (all without a GPU). Then the device: one rank equals the fused
// cross-entropy bit for bit, and two simulated ranks match the host
// references.
//
// Tolerances: the references accumulate in double but hand fp32 values from
// step to step (what the all-reduces carry): the sum of exponentials is
// rounded to fp32 up to three times (stats, rescale, the rank sum), about
// 2e-7 relative, which moves log(sum) by about 2e-7 absolute and each
// softmax by about 2e-7 relative. We allow 1e-6 relative on the loss and
// on fp32 gradients; bf16 gradients are rounded once more to bf16 (2^-8
// relative), so 1/256 there. A lost rescale, a target counted twice or a
// missed slice is off by far more (1e-2 and up).
#include "kernels/parallel_cross_entropy.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "kernels/cross_entropy.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::DeviceArray;
using testing::expect_invalid_argument;
using testing::HostArray;
using testing::labels_of;
using testing::random_array;

constexpr std::int64_t kIgnore = -100;

// Columns [first, first + count) of a [tokens, vocab] array.
HostArray columns(const HostArray& m, std::int64_t tokens, std::int64_t vocab, std::int64_t first,
                  std::int64_t count) {
  HostArray out(m.dtype, tokens * count);
  const std::size_t size = dtype_size(m.dtype);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::memcpy(out.bytes.data() + static_cast<std::size_t>(t * count) * size,
                m.bytes.data() + static_cast<std::size_t>(t * vocab + first) * size,
                static_cast<std::size_t>(count) * size);
  }
  return out;
}

struct Problem {
  DType logits_type = DType::kFloat32;
  DType label_type = DType::kInt32;
  std::int64_t tokens = 0;
  std::int64_t vocab = 0;
  int ranks = 1;
  float loss_scale = 1.0f;

  ParallelCrossEntropyDesc desc(int rank) const {
    const std::int64_t local = vocab / ranks;
    return {.logits_type = logits_type,
            .label_type = label_type,
            .tokens = tokens,
            .vocab = vocab,
            .vocab_local = local,
            .vocab_offset = rank * local,
            .ignore_index = kIgnore,
            .loss_scale = loss_scale};
  }
};

struct RankResult {
  float loss = NAN;
  HostArray dlogits;  // [tokens, vocab / N]
  std::int32_t error_flag = 0;
};

// The two all-reduces as the host world makes them: every rank's buffer in
// rank order, fp32.
std::vector<float> reduce(const std::vector<std::vector<float>>& buffers, bool max) {
  std::vector<float> out = buffers[0];
  for (std::size_t r = 1; r < buffers.size(); ++r) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = max ? std::max(out[i], buffers[r][i]) : out[i] + buffers[r][i];
  }
  return out;
}

// The host references of every rank, with the collectives between them.
std::vector<RankResult> run_host_ranks(const Problem& p, const HostArray& logits,
                                       const std::vector<std::int64_t>& labels) {
  const HostArray label_array = labels_of(p.label_type, labels);
  const std::int64_t local = p.vocab / p.ranks;
  const auto t = static_cast<std::size_t>(p.tokens);
  std::vector<HostArray> slices;
  std::vector<std::vector<float>> local_max(p.ranks, std::vector<float>(t));
  std::vector<std::vector<float>> partial(p.ranks, std::vector<float>(2 * t));
  for (int r = 0; r < p.ranks; ++r) {
    slices.push_back(columns(logits, p.tokens, p.vocab, r * local, local));
    host::parallel_cross_entropy_stats(p.desc(r), slices[r].data(), label_array.data(), local_max[r].data(),
                                       partial[r].data());
  }
  const std::vector<float> global_max = reduce(local_max, /*max=*/true);
  std::vector<std::vector<float>> scaled(p.ranks, std::vector<float>(2 * t));
  for (int r = 0; r < p.ranks; ++r) {
    host::parallel_cross_entropy_rescale(p.tokens, local_max[r].data(), global_max.data(), partial[r].data(),
                                         scaled[r].data());
  }
  const std::vector<float> totals = reduce(scaled, /*max=*/false);
  std::vector<RankResult> out(p.ranks);
  for (int r = 0; r < p.ranks; ++r) {
    out[r].dlogits = HostArray(p.logits_type, p.tokens * local);
    host::parallel_cross_entropy_finish(p.desc(r), slices[r].data(), label_array.data(), global_max.data(),
                                        totals.data(), &out[r].loss, out[r].dlogits.data(), &out[r].error_flag);
  }
  return out;
}

// The textbook formulas over the whole vocabulary in double (no max shift:
// small logits only). Labels outside [0, vocab) count nowhere, as ignored ones.
struct Plain {
  double loss = 0.0;
  std::vector<double> dlogits;  // [tokens, vocab]
};

Plain plain_cross_entropy(const Problem& p, const HostArray& logits, const std::vector<std::int64_t>& labels) {
  Plain out;
  out.dlogits.assign(static_cast<std::size_t>(p.tokens * p.vocab), 0.0);
  const auto counts = [&](std::int64_t label) { return label >= 0 && label < p.vocab; };
  std::int64_t count = 0;
  for (std::int64_t label : labels) count += counts(label);
  for (std::int64_t t = 0; t < p.tokens; ++t) {
    if (!counts(labels[t])) continue;
    double z = 0.0;
    for (std::int64_t j = 0; j < p.vocab; ++j) z += std::exp(static_cast<double>(logits.get(t * p.vocab + j)));
    out.loss += (std::log(z) - logits.get(t * p.vocab + labels[t])) / static_cast<double>(count);
    for (std::int64_t j = 0; j < p.vocab; ++j) {
      const double softmax = std::exp(static_cast<double>(logits.get(t * p.vocab + j))) / z;
      out.dlogits[t * p.vocab + j] = (softmax - (j == labels[t] ? 1.0 : 0.0)) * p.loss_scale / count;
    }
  }
  return out;
}

// Labels in [0, vocab), every fifth token ignored (token 0 never).
std::vector<std::int64_t> random_labels(std::int64_t tokens, std::int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int64_t> label(0, vocab - 1);
  std::vector<std::int64_t> out(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) out[t] = t % 5 == 4 ? kIgnore : label(rng);
  return out;
}

double gradient_rounding(DType dtype) { return dtype == DType::kFloat32 ? 1e-6 : 1.0 / 256; }

void expect_matches_plain(const Problem& p, const std::vector<RankResult>& got, const Plain& want) {
  const std::int64_t local = p.vocab / p.ranks;
  for (int r = 0; r < p.ranks; ++r) {
    const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(p.ranks);
    EXPECT_NEAR(got[r].loss, want.loss, 1e-6 * std::fabs(want.loss)) << who;
    EXPECT_EQ(got[r].loss, got[0].loss) << who << ": every rank must hold the same loss";
    for (std::int64_t t = 0; t < p.tokens; ++t) {
      for (std::int64_t j = 0; j < local; ++j) {
        const double w = want.dlogits[t * p.vocab + r * local + j];
        ASSERT_NEAR(got[r].dlogits.get(t * local + j), w, gradient_rounding(p.logits_type) * std::fabs(w) + 1e-12)
            << who << ", token " << t << ", local column " << j;
      }
    }
  }
}

// ---------------------------------------------------------------- host (CPU)

struct HostCase {
  DType logits_type;
  DType label_type;
  int ranks;
};

class ParallelCrossEntropyHost : public ::testing::TestWithParam<HostCase> {};

TEST_P(ParallelCrossEntropyHost, MatchesThePlainFormulas_WithIgnoredTokens) {
  const HostCase c = GetParam();
  const Problem p{.logits_type = c.logits_type, .label_type = c.label_type, .tokens = 12, .vocab = 64,
                  .ranks = c.ranks, .loss_scale = 2.5f};
  testing::SeededRng rng;
  const HostArray logits = random_array(p.logits_type, p.tokens * p.vocab, rng, -4.0f, 4.0f);
  const std::vector<std::int64_t> labels = random_labels(p.tokens, p.vocab, rng);
  const std::vector<RankResult> got = run_host_ranks(p, logits, labels);
  expect_matches_plain(p, got, plain_cross_entropy(p, logits, labels));
  for (const RankResult& r : got) EXPECT_EQ(r.error_flag, 0);
}

INSTANTIATE_TEST_SUITE_P(DtypesAndRanks, ParallelCrossEntropyHost,
                         ::testing::Values(HostCase{DType::kFloat32, DType::kInt32, 1},
                                           HostCase{DType::kFloat32, DType::kInt32, 2},
                                           HostCase{DType::kFloat32, DType::kInt64, 4},
                                           HostCase{DType::kBFloat16, DType::kInt32, 2},
                                           HostCase{DType::kBFloat16, DType::kInt64, 8}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.logits_type)) + "_" +
                                  std::string(dtype_name(info.param.label_type)) + "_12x64_ranks" +
                                  std::to_string(info.param.ranks);
                         });

// Padding: rank 1's columns are all -inf; they add nothing to the sum and get
// zero gradients, and the loss is the plain loss over rank 0's columns.
TEST(ParallelCrossEntropyHostPadding, Fp32_2Ranks_AnAllNegativeInfinitySliceAddsNothing) {
  const Problem p{.tokens = 3, .vocab = 16, .ranks = 2};
  testing::SeededRng rng;
  HostArray logits = random_array(DType::kFloat32, p.tokens * p.vocab, rng, -2.0f, 2.0f);
  for (std::int64_t t = 0; t < p.tokens; ++t) {
    for (std::int64_t j = 8; j < 16; ++j) logits.set(t * p.vocab + j, -INFINITY);
  }
  const std::vector<std::int64_t> labels = {0, 7, 3};
  const std::vector<RankResult> got = run_host_ranks(p, logits, labels);
  const Problem half{.tokens = 3, .vocab = 8, .ranks = 1};
  const Plain want = plain_cross_entropy(half, columns(logits, 3, 16, 0, 8), labels);
  expect_matches_plain(half, {got[0]}, want);
  EXPECT_EQ(got[1].loss, got[0].loss);
  for (float g : got[1].dlogits.to_floats()) ASSERT_EQ(g, 0.0f);
}

// A label outside [0, vocab) sets the flag on every rank (the device's
// contract; the fused host reference throws instead), its row counts nowhere
// and its gradient rows are zero.
TEST(ParallelCrossEntropyHostLabels, Fp32Int64_2Ranks_OutOfRangeLabelsSetTheFlagAndCountNowhere) {
  const Problem p{.label_type = DType::kInt64, .tokens = 4, .vocab = 16, .ranks = 2};
  testing::SeededRng rng;
  const HostArray logits = random_array(DType::kFloat32, p.tokens * p.vocab, rng, -2.0f, 2.0f);
  const std::vector<std::int64_t> labels = {5, 16, kIgnore, -1};
  const std::vector<RankResult> got = run_host_ranks(p, logits, labels);
  expect_matches_plain(p, got, plain_cross_entropy(p, logits, labels));
  for (const RankResult& r : got) {
    EXPECT_EQ(r.error_flag, 1);
    for (std::int64_t t : {1, 2, 3}) {
      for (std::int64_t j = 0; j < 8; ++j) ASSERT_EQ(r.dlogits.get(t * 8 + j), 0.0f) << "token " << t;
    }
  }
}

TEST(ParallelCrossEntropyHostLabels, Bf16_4Ranks_AllTokensIgnored_LossZeroAndZeroGradients) {
  const Problem p{.logits_type = DType::kBFloat16, .tokens = 3, .vocab = 32, .ranks = 4};
  testing::SeededRng rng;
  const HostArray logits = random_array(DType::kBFloat16, p.tokens * p.vocab, rng);
  for (const RankResult& r : run_host_ranks(p, logits, std::vector<std::int64_t>(3, kIgnore))) {
    EXPECT_EQ(r.loss, 0.0f);
    EXPECT_EQ(r.error_flag, 0);
    for (float g : r.dlogits.to_floats()) ASSERT_EQ(g, 0.0f);
  }
}

TEST(ParallelCrossEntropyChecks, BadDescriptorsAreClearErrors) {
  const ParallelCrossEntropyDesc good = Problem{.tokens = 4, .vocab = 32, .ranks = 2}.desc(1);
  check_parallel_cross_entropy(good);
  ParallelCrossEntropyDesc bad = good;
  bad.vocab_offset = 24;  // [24, 40) is not inside [0, 32)
  expect_invalid_argument([&] { check_parallel_cross_entropy(bad); }, "must be a non-empty part of the vocabulary");
  bad = good;
  bad.vocab_local = 6;
  bad.vocab = 12;
  bad.vocab_offset = 6;
  expect_invalid_argument([&] { check_parallel_cross_entropy(bad); }, "must be a multiple of 4");
  bad = good;
  bad.logits_type = DType::kInt32;
  expect_invalid_argument([&] { check_parallel_cross_entropy(bad); }, "logits must be bf16, fp16 or fp32");
  bad = good;
  bad.loss_scale = INFINITY;
  expect_invalid_argument([&] { check_parallel_cross_entropy(bad); }, "loss_scale must be finite");
  bad = good;
  bad.tokens = 0;
  expect_invalid_argument([&] { check_parallel_cross_entropy(bad); }, "tokens must be in [1, 2^31)");
}

// ------------------------------------------------------------- device (GPU)

struct DeviceRank {
  std::unique_ptr<DeviceArray> logits, local_max, partial, scaled, dlogits, loss, workspace, flag;
};

// The device steps for N simulated ranks; the all-reduces are made on the
// host between them (reduce(), rank order), as the host world would.
std::vector<RankResult> run_device_ranks(const Problem& p, const HostArray& logits,
                                         const std::vector<std::int64_t>& labels) {
  const std::int64_t local = p.vocab / p.ranks;
  const std::size_t t = static_cast<std::size_t>(p.tokens);
  DeviceArray label_array(labels_of(p.label_type, labels));
  Stream stream;
  std::vector<DeviceRank> ranks(p.ranks);
  std::vector<std::vector<float>> local_max(p.ranks), scaled(p.ranks);
  const auto download = [](const DeviceArray& a, std::size_t n) {
    const std::vector<float> v = a.download(DType::kFloat32, static_cast<std::int64_t>(n)).to_floats();
    return v;
  };
  for (int r = 0; r < p.ranks; ++r) {
    DeviceRank& d = ranks[r];
    d.logits = std::make_unique<DeviceArray>(columns(logits, p.tokens, p.vocab, r * local, local));
    d.local_max = std::make_unique<DeviceArray>(t * 4);
    d.partial = std::make_unique<DeviceArray>(t * 8);
    d.scaled = std::make_unique<DeviceArray>(t * 8);
    d.dlogits = std::make_unique<DeviceArray>(static_cast<std::size_t>(p.tokens * local) * dtype_size(p.logits_type));
    d.loss = std::make_unique<DeviceArray>(4);
    d.workspace = std::make_unique<DeviceArray>(parallel_cross_entropy_workspace_bytes(p.desc(r)));
    d.flag = std::make_unique<DeviceArray>(HostArray(DType::kInt32, 1));
    for (DeviceArray* a : {d.local_max.get(), d.partial.get(), d.scaled.get(), d.dlogits.get(), d.loss.get(),
                           d.workspace.get()}) {
      a->poison();
    }
    launch_parallel_cross_entropy_stats(p.desc(r), d.logits->get(), label_array.get(), d.local_max->as<float>(),
                                        d.partial->as<float>(), stream.get());
    stream.synchronize();
    local_max[r] = download(*d.local_max, t);
  }
  DeviceArray global_max(testing::floats(reduce(local_max, /*max=*/true)));
  for (int r = 0; r < p.ranks; ++r) {
    DeviceRank& d = ranks[r];
    launch_parallel_cross_entropy_rescale(p.tokens, d.local_max->as<float>(), global_max.as<float>(),
                                          d.partial->as<float>(), d.scaled->as<float>(), stream.get());
    stream.synchronize();
    scaled[r] = download(*d.scaled, 2 * t);
  }
  DeviceArray totals(testing::floats(reduce(scaled, /*max=*/false)));
  std::vector<RankResult> out(p.ranks);
  for (int r = 0; r < p.ranks; ++r) {
    DeviceRank& d = ranks[r];
    launch_parallel_cross_entropy_finish(p.desc(r), d.logits->get(), label_array.get(), global_max.as<float>(),
                                         totals.as<float>(), d.loss->as<float>(), d.dlogits->get(), d.workspace->get(),
                                         d.flag->as<std::int32_t>(), stream.get());
    stream.synchronize();
    out[r].loss = d.loss->download(DType::kFloat32, 1).get(0);
    out[r].dlogits = d.dlogits->download(p.logits_type, p.tokens * local);
    std::memcpy(&out[r].error_flag, d.flag->download(DType::kInt32, 1).data(), sizeof(std::int32_t));
  }
  return out;
}

struct DeviceCase {
  DType logits_type;
  std::int64_t tokens;
  std::int64_t vocab;
  const char* shape_class;
};

class ParallelCrossEntropyDevice : public ::testing::TestWithParam<DeviceCase> {};

// One rank runs the fused kernel's instructions (softmax_row.cuh, the count
// and mean kernels): the same bits as launch_cross_entropy.
TEST_P(ParallelCrossEntropyDevice, OneRankEqualsTheFusedCrossEntropyBitForBit) {
  SG_SKIP_WITHOUT_GPU();
  const DeviceCase c = GetParam();
  const Problem p{.logits_type = c.logits_type, .tokens = c.tokens, .vocab = c.vocab, .ranks = 1, .loss_scale = 0.5f};
  testing::SeededRng rng;
  const HostArray logits = random_array(p.logits_type, p.tokens * p.vocab, rng, -5.0f, 5.0f);
  std::vector<std::int64_t> labels = random_labels(p.tokens, p.vocab, rng);
  const RankResult got = run_device_ranks(p, logits, labels)[0];

  const CrossEntropyDesc fused{.logits_type = p.logits_type, .label_type = p.label_type, .tokens = p.tokens,
                               .vocab = p.vocab, .ignore_index = kIgnore, .loss_scale = p.loss_scale};
  DeviceArray d_logits(logits), d_labels(labels_of(p.label_type, labels));
  DeviceArray d_dlogits(logits.bytes.size()), d_loss(4), d_workspace(cross_entropy_workspace_bytes(fused));
  DeviceArray d_flag(HostArray(DType::kInt32, 1));
  Stream stream;
  launch_cross_entropy(fused, d_logits.get(), d_labels.get(), d_loss.as<float>(), d_dlogits.get(), d_workspace.get(),
                       d_flag.as<std::int32_t>(), stream.get());
  stream.synchronize();
  const float want_loss = d_loss.download(DType::kFloat32, 1).get(0);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(got.loss), std::bit_cast<std::uint32_t>(want_loss))
      << got.loss << " vs fused " << want_loss;
  EXPECT_EQ(got.dlogits.bytes, d_dlogits.download(p.logits_type, p.tokens * p.vocab).bytes);
  EXPECT_EQ(got.error_flag, 0);
}

// Two and four simulated ranks against the host references of the same steps.
TEST_P(ParallelCrossEntropyDevice, SeveralRanksMatchTheHostReferences) {
  SG_SKIP_WITHOUT_GPU();
  const DeviceCase c = GetParam();
  for (int ranks : {2, 4}) {
    const Problem p{.logits_type = c.logits_type, .tokens = c.tokens, .vocab = c.vocab * ranks, .ranks = ranks};
    testing::SeededRng rng;
    const HostArray logits = random_array(p.logits_type, p.tokens * p.vocab, rng, -5.0f, 5.0f);
    std::vector<std::int64_t> labels = random_labels(p.tokens, p.vocab, rng);
    labels.back() = p.vocab;  // out of range: the flag on every rank
    const std::vector<RankResult> got = run_device_ranks(p, logits, labels);
    const std::vector<RankResult> want = run_host_ranks(p, logits, labels);
    for (int r = 0; r < ranks; ++r) {
      const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(ranks);
      // fp32 accumulation on the device, double within a step on the host.
      EXPECT_NEAR(got[r].loss, want[r].loss, 1e-5 * std::fabs(want[r].loss)) << who;
      EXPECT_EQ(got[r].loss, got[0].loss) << who;
      EXPECT_LE(testing::relative_error(got[r].dlogits.to_floats(), want[r].dlogits.to_floats()),
                testing::tolerance_for(p.logits_type))
          << who;
      EXPECT_EQ(got[r].error_flag, 1) << who;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ParallelCrossEntropyDevice,
                         ::testing::Values(DeviceCase{DType::kFloat32, 64, 256, "small"},
                                           DeviceCase{DType::kBFloat16, 64, 256, "small"},
                                           DeviceCase{DType::kBFloat16, 33, 4104, "ragged_tile"},
                                           DeviceCase{DType::kFloat16, 17, 8200, "ragged_tile"},
                                           DeviceCase{DType::kFloat32, 9, 32768, "two_tiles"},
                                           DeviceCase{DType::kBFloat16, 8, 32768, "one_tile_wide"}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.logits_type)) + "_" + info.param.shape_class +
                                  "_" + std::to_string(info.param.tokens) + "x" + std::to_string(info.param.vocab);
                         });

}  // namespace
}  // namespace stepgraph::kernels
