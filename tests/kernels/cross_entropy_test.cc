// Fused softmax cross-entropy: the host reference against naive double
// formulas and central finite differences, its errors, the launcher's argument
// checks (all without a GPU); then the device against the host reference for
// every logits/labels dtype on tiny, mid-size, ragged-tile and 32768-wide
// rows, with ignored tokens, all tokens ignored, out-of-range labels, bitwise
// determinism and graph capture. Bandwidth: benchmarks/memory_bound_bench.
#include "kernels/cross_entropy.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/dtype.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
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
using testing::relative_error;
using testing::tolerance_for;

constexpr std::int64_t kIgnore = -100;
// Descs below that name no ignore_index rely on this default.
static_assert(CrossEntropyDesc{}.ignore_index == kIgnore);

// Random labels in [0, vocab); each token ignored with probability
// `ignored_fraction`, token 0 never (so something counts).
std::vector<std::int64_t> random_labels(std::int64_t tokens, std::int64_t vocab, double ignored_fraction,
                                        std::mt19937& rng) {
  std::uniform_int_distribution<std::int64_t> label(0, vocab - 1);
  std::bernoulli_distribution ignored(ignored_fraction);
  std::vector<std::int64_t> out(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) out[t] = t > 0 && ignored(rng) ? kIgnore : label(rng);
  return out;
}

// The textbook formulas in double, no max shift (small logits only).
struct Naive {
  double loss = 0.0;
  std::vector<double> dlogits;
};

Naive naive_cross_entropy(const CrossEntropyDesc& desc, const HostArray& logits,
                          const std::vector<std::int64_t>& labels) {
  Naive out;
  out.dlogits.assign(static_cast<std::size_t>(desc.tokens * desc.vocab), 0.0);
  std::int64_t count = 0;
  for (std::int64_t label : labels) count += label != desc.ignore_index;
  for (std::int64_t t = 0; t < desc.tokens; ++t) {
    if (labels[t] == desc.ignore_index) continue;
    double z = 0.0;
    for (std::int64_t j = 0; j < desc.vocab; ++j) z += std::exp(static_cast<double>(logits.get(t * desc.vocab + j)));
    out.loss += -std::log(std::exp(static_cast<double>(logits.get(t * desc.vocab + labels[t]))) / z) / count;
    for (std::int64_t j = 0; j < desc.vocab; ++j) {
      const double softmax = std::exp(static_cast<double>(logits.get(t * desc.vocab + j))) / z;
      out.dlogits[t * desc.vocab + j] = (softmax - (j == labels[t] ? 1.0 : 0.0)) * desc.loss_scale / count;
    }
  }
  return out;
}

// ---------------------------------------------------------------- host (CPU)

class CrossEntropyHostTiny : public ::testing::TestWithParam<std::pair<DType, DType>> {};

TEST_P(CrossEntropyHostTiny, MatchesNaiveDoubleFormulas_WithAnIgnoredToken) {
  const auto [logits_type, label_type] = GetParam();
  const CrossEntropyDesc desc{.logits_type = logits_type,
                              .label_type = label_type,
                              .tokens = 4,
                              .vocab = 16,
                              .ignore_index = kIgnore,
                              .loss_scale = 2.5f};
  testing::SeededRng rng;
  const HostArray logits = random_array(logits_type, desc.tokens * desc.vocab, rng, -3.0f, 3.0f);
  const std::vector<std::int64_t> labels = {3, kIgnore, 15, 0};
  HostArray dlogits(logits_type, desc.tokens * desc.vocab);
  float loss = NAN;
  host::cross_entropy(desc, logits.data(), labels_of(label_type, labels).data(), &loss, dlogits.data());

  const Naive want = naive_cross_entropy(desc, logits, labels);
  EXPECT_NEAR(loss, want.loss, 1e-6 * want.loss);
  // The reference rounds each gradient once to the logits' dtype (through
  // fp32): within two units of roundoff.
  const double rounding = logits_type == DType::kFloat32    ? 1e-7
                          : logits_type == DType::kBFloat16 ? 1.0 / 256
                                                            : 1.0 / 1024;
  for (std::size_t i = 0; i < want.dlogits.size(); ++i) {
    EXPECT_NEAR(dlogits.get(static_cast<std::int64_t>(i)), want.dlogits[i],
                rounding * std::fabs(want.dlogits[i]) + 1e-12)
        << "element " << i;
  }
  for (std::int64_t j = 0; j < desc.vocab; ++j) EXPECT_EQ(dlogits.get(desc.vocab + j), 0.0f) << "ignored row, " << j;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CrossEntropyHostTiny,
                         ::testing::Values(std::pair{DType::kFloat32, DType::kInt32},
                                           std::pair{DType::kBFloat16, DType::kInt64},
                                           std::pair{DType::kFloat16, DType::kInt32}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.first)) + "_" +
                                  std::string(dtype_name(info.param.second)) + "_4x16";
                         });

TEST(CrossEntropyHost, Fp32Int32_3x8_GradientMatchesCentralDifferences) {
  const CrossEntropyDesc desc{.logits_type = DType::kFloat32, .label_type = DType::kInt32, .tokens = 3, .vocab = 8};
  testing::SeededRng rng;
  HostArray logits = random_array(DType::kFloat32, 24, rng, -2.0f, 2.0f);
  const HostArray labels = labels_of(DType::kInt32, {2, kIgnore, 7});
  HostArray dlogits(DType::kFloat32, 24);
  HostArray scratch(DType::kFloat32, 24);
  float loss = NAN;
  host::cross_entropy(desc, logits.data(), labels.data(), &loss, dlogits.data());

  const auto loss_at = [&](std::int64_t i, float value) {
    HostArray moved = logits;
    moved.set(i, value);
    float l = NAN;
    host::cross_entropy(desc, moved.data(), labels.data(), &l, scratch.data());
    return static_cast<double>(l);
  };
  constexpr float kStep = 1e-2f;
  for (std::int64_t i = 0; i < 24; ++i) {
    const float x = logits.get(i);
    const float up = x + kStep;
    const float down = x - kStep;
    const double central = (loss_at(i, up) - loss_at(i, down)) / (static_cast<double>(up) - down);
    if (i / 8 == 1) {  // the ignored token: no effect on the loss, zero gradient
      EXPECT_EQ(central, 0.0) << "element " << i;
      EXPECT_EQ(dlogits.get(i), 0.0f) << "element " << i;
    } else {
      EXPECT_NEAR(dlogits.get(i), central, 1e-4) << "element " << i;
    }
  }
}

TEST(CrossEntropyHost, Bf16Int64_7x64_AllTokensIgnored_LossZeroAndZeroGradients) {
  const CrossEntropyDesc desc{.logits_type = DType::kBFloat16, .label_type = DType::kInt64, .tokens = 7, .vocab = 64};
  testing::SeededRng rng;
  const HostArray logits = random_array(DType::kBFloat16, 7 * 64, rng);
  HostArray dlogits = random_array(DType::kBFloat16, 7 * 64, rng, 1.0f, 2.0f);  // must all become 0
  float loss = NAN;
  host::cross_entropy(desc, logits.data(), labels_of(DType::kInt64, std::vector<std::int64_t>(7, kIgnore)).data(),
                      &loss, dlogits.data());
  EXPECT_EQ(loss, 0.0f);
  for (float g : dlogits.to_floats()) ASSERT_EQ(g, 0.0f);
}

TEST(CrossEntropyHost, OutOfRangeLabel_IsErrorBeforeAnyOutput_Int32AndInt64) {
  for (DType label_type : {DType::kInt32, DType::kInt64}) {
    for (std::int64_t bad : {std::int64_t{8}, std::int64_t{-1}, std::int64_t{1} << 33}) {
      if (label_type == DType::kInt32 && bad > INT32_MAX) continue;
      const CrossEntropyDesc desc{.logits_type = DType::kFloat32, .label_type = label_type, .tokens = 3, .vocab = 8};
      const HostArray logits(DType::kFloat32, 24);
      HostArray dlogits(DType::kFloat32, 24);
      dlogits.set(0, 42.0f);
      float loss = 42.0f;
      expect_invalid_argument(
          [&] {
            host::cross_entropy(desc, logits.data(), labels_of(label_type, {1, bad, kIgnore}).data(), &loss,
                                dlogits.data());
          },
          "label " + std::to_string(bad) + " of token 1");
      EXPECT_EQ(loss, 42.0f);
      EXPECT_EQ(dlogits.get(0), 42.0f);
    }
  }
}

// ------------------------------------------------------- argument checks (CPU)

TEST(CrossEntropyCheck, RejectsBadDtypesShapesAndScale) {
  const CrossEntropyDesc good{.logits_type = DType::kBFloat16, .label_type = DType::kInt32, .tokens = 4, .vocab = 64};
  EXPECT_NO_THROW(check_cross_entropy(good));
  const auto with = [&](auto&& edit) {
    CrossEntropyDesc d = good;
    edit(d);
    return d;
  };
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.logits_type = DType::kFloat8E4M3; })); },
                          "logits must be bf16, fp16 or fp32");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.logits_type = DType::kInt32; })); },
                          "logits must be bf16, fp16 or fp32");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.label_type = DType::kFloat32; })); },
                          "labels must be int32 or int64");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.tokens = 0; })); }, "tokens");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.vocab = 0; })); }, "vocab");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.vocab = 12; })); }, "multiple of 8");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.tokens = std::int64_t{1} << 31; })); },
                          "tokens");
  expect_invalid_argument([&] { check_cross_entropy(with([](auto& d) { d.loss_scale = INFINITY; })); }, "loss_scale");
  // fp32 vectors hold 4 values: vocab 12 is fine there.
  EXPECT_NO_THROW(check_cross_entropy(with([](auto& d) {
    d.logits_type = DType::kFloat32;
    d.vocab = 12;
  })));
  EXPECT_LT(cross_entropy_workspace_bytes(good), cross_entropy_workspace_bytes(with([](auto& d) { d.tokens = 5; })));
}

TEST(CrossEntropyLaunch, BadArgumentsAreErrorsBeforeAnyLaunch) {
  // Host buffers stand in for device ones: every case fails its checks first.
  const CrossEntropyDesc desc{.logits_type = DType::kBFloat16, .label_type = DType::kInt64, .tokens = 4, .vocab = 64};
  alignas(16) static std::byte logits[4 * 64 * 2 + 16];
  alignas(16) static std::byte dlogits[4 * 64 * 2 + 16];
  alignas(16) static std::byte labels[4 * 8 + 8];
  alignas(16) static std::byte workspace[1024];
  float loss = 0.0f;
  std::int32_t flag = 0;
  const auto launch = [&](const CrossEntropyDesc& d, const void* x, const void* l, float* out, void* dx, void* ws,
                          std::int32_t* f) { launch_cross_entropy(d, x, l, out, dx, ws, f, nullptr); };
  expect_invalid_argument([&] { launch(desc, nullptr, labels, &loss, dlogits, workspace, &flag); }, "null");
  expect_invalid_argument([&] { launch(desc, logits, nullptr, &loss, dlogits, workspace, &flag); }, "null");
  expect_invalid_argument([&] { launch(desc, logits, labels, &loss, nullptr, workspace, &flag); }, "null");
  expect_invalid_argument([&] { launch(desc, logits, labels, nullptr, dlogits, workspace, &flag); }, "loss");
  expect_invalid_argument([&] { launch(desc, logits, labels, &loss, dlogits, nullptr, &flag); }, "workspace");
  expect_invalid_argument([&] { launch(desc, logits, labels, &loss, dlogits, workspace, nullptr); }, "error_flag");
  expect_invalid_argument([&] { launch(desc, logits + 2, labels, &loss, dlogits, workspace, &flag); }, "logits at");
  expect_invalid_argument([&] { launch(desc, logits, labels, &loss, dlogits + 8, workspace, &flag); }, "dlogits at");
  expect_invalid_argument([&] { launch(desc, logits, labels + 4, &loss, dlogits, workspace, &flag); }, "labels at");
  expect_invalid_argument([&] { launch(desc, logits, labels, &loss, dlogits, workspace + 8, &flag); }, "workspace at");
  CrossEntropyDesc bad = desc;
  bad.vocab = 60;
  expect_invalid_argument([&] { launch(bad, logits, labels, &loss, dlogits, workspace, &flag); }, "multiple of 8");
}

// ------------------------------------------------------------- device (GPU)

struct Inputs {
  HostArray logits;
  std::vector<std::int64_t> labels;
};

struct Outputs {
  float loss = NAN;
  HostArray dlogits;
  std::int32_t error_flag = -1;
};

Inputs random_inputs(const CrossEntropyDesc& desc, double ignored_fraction, std::mt19937& rng) {
  return {random_array(desc.logits_type, desc.tokens * desc.vocab, rng, -5.0f, 5.0f),
          random_labels(desc.tokens, desc.vocab, ignored_fraction, rng)};
}

// Fresh device buffers of one launch: the inputs uploaded, outputs and
// workspace poisoned (NaN), the error flag zeroed.
struct DeviceBuffers {
  DeviceBuffers(const CrossEntropyDesc& desc, const Inputs& in)
      : desc(desc),
        logits(in.logits),
        labels(labels_of(desc.label_type, in.labels)),
        dlogits(in.logits.bytes.size()),
        loss(sizeof(float)),
        workspace(cross_entropy_workspace_bytes(desc)),
        flag(HostArray(DType::kInt32, 1)) {
    dlogits.poison();
    loss.poison();
    workspace.poison();
  }
  // launch_cross_entropy with `with_labels` (default: labels).
  void launch(cudaStream_t stream, const DeviceArray* with_labels = nullptr) {
    launch_cross_entropy(desc, logits.get(), (with_labels != nullptr ? with_labels : &labels)->get(), loss.as<float>(),
                         dlogits.get(), workspace.get(), flag.as<std::int32_t>(), stream);
  }

  CrossEntropyDesc desc;
  DeviceArray logits, labels, dlogits, loss, workspace, flag;
};

// One launch into fresh buffers.
Outputs run_device(const CrossEntropyDesc& desc, const Inputs& in) {
  DeviceBuffers buffers(desc, in);
  Stream stream;
  buffers.launch(stream.get());
  stream.synchronize();
  Outputs out;
  out.loss = buffers.loss.download(DType::kFloat32, 1).get(0);
  out.dlogits = buffers.dlogits.download(desc.logits_type, desc.tokens * desc.vocab);
  std::memcpy(&out.error_flag, buffers.flag.download(DType::kInt32, 1).data(), sizeof(std::int32_t));
  return out;
}

Outputs run_host(const CrossEntropyDesc& desc, const Inputs& in) {
  Outputs out;
  out.dlogits = HostArray(desc.logits_type, desc.tokens * desc.vocab);
  host::cross_entropy(desc, in.logits.data(), labels_of(desc.label_type, in.labels).data(), &out.loss,
                      out.dlogits.data());
  out.error_flag = 0;
  return out;
}

// Losses accumulate in fp32 on the device, double on the host.
double loss_tolerance(DType logits_type) { return logits_type == DType::kFloat32 ? 1e-5 : 1e-4; }

void expect_matches_host(const CrossEntropyDesc& desc, const Outputs& got, const Outputs& want,
                         const std::string& what) {
  EXPECT_EQ(got.error_flag, 0) << what;
  EXPECT_LE(std::fabs(got.loss - want.loss), loss_tolerance(desc.logits_type) * std::fabs(want.loss))
      << what << ": loss " << got.loss << " vs host " << want.loss;
  EXPECT_LE(relative_error(got.dlogits.to_floats(), want.dlogits.to_floats()), tolerance_for(desc.logits_type))
      << what << ": dlogits";
}

struct DeviceCase {
  DType logits_type;
  DType label_type;
  std::int64_t tokens;
  std::int64_t vocab;
  double ignored_fraction;
  float loss_scale;
  const char* shape_class;
};

class CrossEntropyDevice : public ::testing::TestWithParam<DeviceCase> {};

TEST_P(CrossEntropyDevice, MatchesHostReference_AndIsBitwiseDeterministic) {
  SG_SKIP_WITHOUT_GPU();
  const DeviceCase& c = GetParam();
  const CrossEntropyDesc desc{.logits_type = c.logits_type,
                              .label_type = c.label_type,
                              .tokens = c.tokens,
                              .vocab = c.vocab,
                              .ignore_index = kIgnore,
                              .loss_scale = c.loss_scale};
  testing::SeededRng rng;
  const Inputs in = random_inputs(desc, c.ignored_fraction, rng);
  const Outputs first = run_device(desc, in);
  expect_matches_host(desc, first, run_host(desc, in), "");

  const Outputs second = run_device(desc, in);
  EXPECT_EQ(std::memcmp(&first.loss, &second.loss, sizeof(float)), 0) << "two losses differ";
  EXPECT_TRUE(first.dlogits.bytes == second.dlogits.bytes) << "two dlogits differ";
}

std::string case_name(const ::testing::TestParamInfo<DeviceCase>& info) {
  const DeviceCase& c = info.param;
  return std::string(dtype_name(c.logits_type)) + "_" + std::string(dtype_name(c.label_type)) + "_" +
         std::to_string(c.tokens) + "x" + std::to_string(c.vocab) + "_" + c.shape_class;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyDevice,
                         ::testing::Values(
                             // One token, one 16-byte vector (or two) per row: most threads idle.
                             DeviceCase{DType::kBFloat16, DType::kInt32, 1, 8, 0.0, 1.0f, "tiny"},
                             DeviceCase{DType::kBFloat16, DType::kInt64, 1, 8, 0.0, 1.0f, "tiny"},
                             DeviceCase{DType::kFloat32, DType::kInt32, 1, 8, 0.0, 1.0f, "tiny"},
                             DeviceCase{DType::kFloat32, DType::kInt64, 1, 8, 0.0, 1.0f, "tiny"},
                             DeviceCase{DType::kFloat16, DType::kInt32, 1, 8, 0.0, 1.0f, "tiny"},
                             // Part of one tile, with ignored tokens and a loss scale.
                             DeviceCase{DType::kBFloat16, DType::kInt32, 7, 1024, 0.3, 1.0f, "ignored"},
                             DeviceCase{DType::kBFloat16, DType::kInt64, 7, 1024, 0.3, 4.0f, "ignored_scaled"},
                             DeviceCase{DType::kFloat32, DType::kInt32, 7, 1024, 0.3, 1.0f, "ignored"},
                             DeviceCase{DType::kFloat32, DType::kInt64, 7, 1024, 0.3, 1.0f, "ignored"},
                             DeviceCase{DType::kFloat16, DType::kInt64, 7, 1024, 0.3, 1024.0f, "ignored_scaled"},
                             // Several tiles, the last one partial: pass 2 re-reads earlier tiles.
                             DeviceCase{DType::kBFloat16, DType::kInt32, 3, 40000, 0.0, 1.0f, "ragged_tiles"},
                             DeviceCase{DType::kFloat32, DType::kInt64, 5, 50004, 0.2, 1.0f, "ragged_tiles"},
                             // The LM-head width: one tile (bf16) or two (fp32) per row.
                             DeviceCase{DType::kBFloat16, DType::kInt64, 1000, 32768, 0.1, 1.0f, "ignored"},
                             DeviceCase{DType::kBFloat16, DType::kInt32, 1000, 32768, 0.1, 1.0f, "ignored"},
                             DeviceCase{DType::kFloat32, DType::kInt32, 1000, 32768, 0.1, 1.0f, "ignored"},
                             DeviceCase{DType::kFloat32, DType::kInt64, 1000, 32768, 0.1, 1.0f, "ignored"}),
                         case_name);

TEST(CrossEntropyDeviceEdge, Bf16Int32_7x1024_AllTokensIgnored_LossZeroAndZeroGradients) {
  SG_SKIP_WITHOUT_GPU();
  const CrossEntropyDesc desc{.logits_type = DType::kBFloat16, .label_type = DType::kInt32, .tokens = 7, .vocab = 1024};
  testing::SeededRng rng;
  const Inputs in{random_array(desc.logits_type, 7 * 1024, rng), std::vector<std::int64_t>(7, kIgnore)};
  const Outputs got = run_device(desc, in);
  EXPECT_EQ(got.loss, 0.0f);
  EXPECT_EQ(got.error_flag, 0);
  for (float g : got.dlogits.to_floats()) ASSERT_EQ(g, 0.0f);
}

TEST(CrossEntropyDeviceEdge, Fp32Int64_7x1024_OutOfRangeLabels_SetStickyErrorFlag_RowsWrittenAsIgnored) {
  SG_SKIP_WITHOUT_GPU();
  const CrossEntropyDesc desc{.logits_type = DType::kFloat32, .label_type = DType::kInt64, .tokens = 7, .vocab = 1024};
  testing::SeededRng rng;
  Inputs in = random_inputs(desc, 0.0, rng);
  in.labels[2] = 1024;  // == vocab
  in.labels[5] = -1;    // negative, not ignore_index
  const Outputs got = run_device(desc, in);
  EXPECT_EQ(got.error_flag, 1);
  // The documented outputs: bad rows as if ignored (zero, not counted).
  Inputs as_ignored = in;
  as_ignored.labels[2] = kIgnore;
  as_ignored.labels[5] = kIgnore;
  const Outputs want = run_host(desc, as_ignored);
  EXPECT_LE(std::fabs(got.loss - want.loss), 1e-5 * std::fabs(want.loss));
  EXPECT_LE(relative_error(got.dlogits.to_floats(), want.dlogits.to_floats()), tolerance_for(DType::kFloat32));

  // Sticky: a later launch with good labels leaves the flag set.
  DeviceBuffers buffers(desc, in);
  const DeviceArray good_labels(labels_of(desc.label_type, as_ignored.labels));
  Stream stream;
  buffers.launch(stream.get());
  buffers.launch(stream.get(), &good_labels);
  stream.synchronize();
  EXPECT_EQ(buffers.flag.download(DType::kInt32, 1).get(0), 1.0f);
}

TEST(CrossEntropyDeviceEdge, Bf16Int64_64x4096_CapturedGraphReplays_MatchEagerBitwise) {
  SG_SKIP_WITHOUT_GPU();
  const CrossEntropyDesc desc{
      .logits_type = DType::kBFloat16, .label_type = DType::kInt64, .tokens = 64, .vocab = 4096};
  testing::SeededRng rng;
  const Inputs in = random_inputs(desc, 0.2, rng);
  const Outputs eager = run_device(desc, in);

  DeviceBuffers buffers(desc, in);
  Stream stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  SG_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  buffers.launch(stream.get());
  SG_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  SG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    buffers.dlogits.poison();
    buffers.loss.poison();
    SG_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
    stream.synchronize();
    const float got_loss = buffers.loss.download(DType::kFloat32, 1).get(0);
    EXPECT_EQ(std::memcmp(&got_loss, &eager.loss, sizeof(float)), 0) << "replay " << replay;
    EXPECT_TRUE(buffers.dlogits.download(desc.logits_type, 64 * 4096).bytes == eager.dlogits.bytes)
        << "replay " << replay;
  }
  SG_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SG_CUDA_CHECK(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace stepgraph::kernels
