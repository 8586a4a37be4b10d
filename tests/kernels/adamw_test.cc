// Multi-tensor AdamW: the host reference against a hand-written double AdamW
// (several hyper-parameter sets, small and huge step counts), the table's and
// the launcher's argument checks (all without a GPU); then the device against
// the host over five steps for tensors of 1, 7, 0, 4097 and 2^20 elements
// packed into shared buffers in one launch (gaps between them must stay
// untouched), bitwise determinism, a captured step replayed, the step counter
// without tensors. Bandwidth is measured in benchmarks/memory_bound_bench.
#include "kernels/adamw.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/error.h"
#include "engine/half_precision.h"
#include "engine/stream.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using testing::expect_invalid_argument;
using testing::relative_error;

constexpr float kSentinel = 12345.0f;
constexpr std::uint16_t kPoisonBf16 = 0xFFFF;  // what DeviceArray::poison leaves

std::int64_t round_up(std::int64_t n, std::int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Tensors packed one after another in shared fp32 and bf16 buffers, each
// start 16-byte aligned, with at least one sentinel element between them.
struct Layout {
  std::vector<std::int64_t> numel;
  std::vector<std::int64_t> f32_offset;
  std::vector<std::int64_t> bf16_offset;  // -1: no bf16 copy
  std::int64_t f32_total = 0;
  std::int64_t bf16_total = 0;
  std::int64_t total_numel = 0;
  bool fp16 = false;  // the copies are fp16 (else bf16)

  Layout(std::vector<std::int64_t> sizes, const std::vector<bool>& has_copy) : numel(std::move(sizes)) {
    for (std::size_t i = 0; i < numel.size(); ++i) {
      f32_offset.push_back(f32_total);
      f32_total = round_up(f32_total + numel[i] + 1, 4);
      bf16_offset.push_back(has_copy[i] ? bf16_total : -1);
      if (has_copy[i]) bf16_total = round_up(bf16_total + numel[i] + 1, 8);
      total_numel += numel[i];
    }
  }
  std::int64_t count() const { return static_cast<std::int64_t>(numel.size()); }
  bool in_tensor(std::int64_t f32_index) const {
    for (std::size_t i = 0; i < numel.size(); ++i) {
      if (f32_index >= f32_offset[i] && f32_index < f32_offset[i] + numel[i]) return true;
    }
    return false;
  }
  // Works for host and device base pointers alike.
  std::vector<AdamWTensor> tensors(float* w, const float* g, float* m, float* v, std::uint16_t* copy) const {
    std::vector<AdamWTensor> out;
    for (std::size_t i = 0; i < numel.size(); ++i) {
      out.push_back({w + f32_offset[i], g + f32_offset[i], m + f32_offset[i], v + f32_offset[i],
                     bf16_offset[i] >= 0 ? copy + bf16_offset[i] : nullptr, numel[i], fp16});
    }
    return out;
  }
  // The copy's bits of w.
  std::uint16_t copy_of(float w) const { return fp16 ? float_to_fp16(w) : float_to_bf16(w); }
};

struct State {
  std::vector<float> w, m, v;
  std::vector<std::uint16_t> copy;
  std::int64_t step = 0;
};

// Random weights, zero moments, sentinels in the gaps, poisoned copies.
State initial_state(const Layout& layout, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  State s;
  s.w.assign(layout.f32_total, kSentinel);
  s.m.assign(layout.f32_total, kSentinel);
  s.v.assign(layout.f32_total, kSentinel);
  s.copy.assign(layout.bf16_total, kPoisonBf16);
  for (std::int64_t i = 0; i < layout.f32_total; ++i) {
    if (!layout.in_tensor(i)) continue;
    s.w[i] = uniform(rng);
    s.m[i] = 0.0f;
    s.v[i] = 0.0f;
  }
  return s;
}

std::vector<std::vector<float>> random_grads(const Layout& layout, int steps, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<std::vector<float>> grads(steps, std::vector<float>(layout.f32_total, 0.0f));
  for (auto& g : grads) {
    for (float& x : g) x = uniform(rng);
  }
  return grads;
}

State run_host(const AdamWHyper& hyper, const Layout& layout, State s, const std::vector<std::vector<float>>& grads) {
  for (const std::vector<float>& g : grads) {
    host::adamw(hyper, layout.tensors(s.w.data(), g.data(), s.m.data(), s.v.data(), s.copy.data()), &s.step);
  }
  return s;
}

// ---------------------------------------------------------------- host (CPU)

// The textbook AdamW in double, from the same fp32 hyper-parameters.
struct DoubleAdamW {
  std::vector<double> w, m, v;
  void step(const AdamWHyper& h, const std::vector<float>& g, double t) {
    const double b1 = h.beta1, b2 = h.beta2;
    for (std::size_t i = 0; i < w.size(); ++i) {
      m[i] = b1 * m[i] + (1.0 - b1) * g[i];
      v[i] = b2 * v[i] + (1.0 - b2) * static_cast<double>(g[i]) * g[i];
      const double m_hat = m[i] / (1.0 - std::pow(b1, t));
      const double v_hat = v[i] / (1.0 - std::pow(b2, t));
      w[i] -=
          static_cast<double>(h.lr) * (m_hat / (std::sqrt(v_hat) + h.eps) + static_cast<double>(h.weight_decay) * w[i]);
    }
  }
};

std::vector<float> region(const std::vector<float>& all, std::int64_t offset, std::int64_t n) {
  return {all.begin() + offset, all.begin() + offset + n};
}
std::vector<float> to_floats(const std::vector<double>& x, std::int64_t offset, std::int64_t n) {
  return {x.begin() + offset, x.begin() + offset + n};
}

void expect_host_matches_double(const AdamWHyper& hyper, std::int64_t first_step, int steps, bool fp16 = false) {
  Layout layout({1, 7, 0, 33, 100}, {true, false, true, true, false});
  layout.fp16 = fp16;
  testing::SeededRng rng;
  const State start = [&] {
    State s = initial_state(layout, rng);
    s.step = first_step;
    return s;
  }();
  const auto grads = random_grads(layout, steps, rng);
  const State got = run_host(hyper, layout, start, grads);

  DoubleAdamW want{
      {start.w.begin(), start.w.end()}, {start.m.begin(), start.m.end()}, {start.v.begin(), start.v.end()}};
  for (int s = 0; s < steps; ++s) want.step(hyper, grads[s], static_cast<double>(first_step + s + 1));

  EXPECT_EQ(got.step, first_step + steps);
  for (std::int64_t i = 0; i < layout.count(); ++i) {
    const std::int64_t offset = layout.f32_offset[i];
    const std::int64_t n = layout.numel[i];
    if (n == 0) continue;
    // w and m are differences of terms (w - lr * update, b1 m + (1 - b1) g)
    // that can cancel to nearly 0, above all in a one-element tensor; fp32
    // rounding is measured against the terms' size, not the tiny result.
    std::vector<float> w_scale(n), m_scale(n);
    for (std::int64_t j = 0; j < n; ++j) {
      w_scale[j] =
          std::fabs(start.w[offset + j]) + std::fabs(static_cast<float>(want.w[offset + j])) + steps * hyper.lr;
      m_scale[j] =
          std::fabs(start.m[offset + j]) + std::fabs(static_cast<float>(want.m[offset + j])) + 1.0f;  // |g| <= 1
    }
    EXPECT_LE(relative_error(region(got.w, offset, n), to_floats(want.w, offset, n), w_scale), 1e-6)
        << "w of tensor " << i;
    EXPECT_LE(relative_error(region(got.m, offset, n), to_floats(want.m, offset, n), m_scale), 1e-6)
        << "m of tensor " << i;
    EXPECT_LE(relative_error(region(got.v, offset, n), to_floats(want.v, offset, n)), 1e-6) << "v of tensor " << i;
    if (layout.bf16_offset[i] < 0) continue;
    for (std::int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(got.copy[layout.bf16_offset[i] + j], layout.copy_of(got.w[offset + j])) << "copy of tensor " << i;
    }
  }
  for (std::int64_t i = 0; i < layout.f32_total; ++i) {
    if (layout.in_tensor(i)) continue;
    ASSERT_EQ(got.w[i], kSentinel) << "gap element " << i << " written";
    ASSERT_EQ(got.m[i], kSentinel) << "gap element " << i << " written";
  }
}

struct HyperCase {
  const char* name;
  AdamWHyper hyper;
};

class AdamWHost : public ::testing::TestWithParam<HyperCase> {};

TEST_P(AdamWHost, Fp32_Sizes1_7_0_33_100_ThreeSteps_MatchDoubleAdamW) {
  expect_host_matches_double(GetParam().hyper, /*first_step=*/0, /*steps=*/3);
}

TEST_P(AdamWHost, Fp16Copies_Sizes1_7_0_33_100_ThreeSteps_MatchDoubleAdamW) {
  expect_host_matches_double(GetParam().hyper, /*first_step=*/0, /*steps=*/3, /*fp16=*/true);
}

TEST_P(AdamWHost, Fp32_StepCounterNear1e9_BiasCorrectionsOfOne_MatchDoubleAdamW) {
  expect_host_matches_double(GetParam().hyper, /*first_step=*/1'000'000'000, /*steps=*/2);
}

INSTANTIATE_TEST_SUITE_P(
    Hyper, AdamWHost,
    ::testing::Values(HyperCase{"Typical",
                                {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f}},
                      HyperCase{"Beta1Zero_Beta2Near1",
                                {.lr = 3e-3f, .beta1 = 0.0f, .beta2 = 0.99999f, .eps = 1e-6f, .weight_decay = 0.0f}},
                      HyperCase{"StrongDecay_LowBetas",
                                {.lr = 5e-2f, .beta1 = 0.5f, .beta2 = 0.75f, .eps = 1e-3f, .weight_decay = 0.1f}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(AdamWHostErrors, BadHyperOrTensors_AreErrors_NothingChanges) {
  const AdamWHyper good;
  const auto with = [&](auto&& edit) {
    AdamWHyper h = good;
    edit(h);
    return h;
  };
  EXPECT_NO_THROW(check_adamw_hyper(good));
  expect_invalid_argument([&] { check_adamw_hyper(with([](auto& h) { h.beta1 = 1.0f; })); }, "beta1");
  expect_invalid_argument([&] { check_adamw_hyper(with([](auto& h) { h.beta2 = -0.1f; })); }, "beta2");
  expect_invalid_argument([&] { check_adamw_hyper(with([](auto& h) { h.lr = NAN; })); }, "lr");
  expect_invalid_argument([&] { check_adamw_hyper(with([](auto& h) { h.eps = -1.0f; })); }, "eps");
  expect_invalid_argument([&] { check_adamw_hyper(with([](auto& h) { h.weight_decay = INFINITY; })); }, "weight_decay");

  std::vector<float> w(8, 1.0f), g(8, 1.0f), m(8, 0.0f), v(8, 0.0f);
  std::int64_t step = 0;
  const AdamWTensor fine{w.data(), g.data(), m.data(), v.data(), nullptr, 8};
  const AdamWTensor null_grad{w.data(), nullptr, m.data(), v.data(), nullptr, 8};
  const AdamWTensor negative{w.data(), g.data(), m.data(), v.data(), nullptr, -1};
  expect_invalid_argument([&] { host::adamw(good, {fine, null_grad}, &step); }, "null");
  expect_invalid_argument([&] { host::adamw(good, {fine, negative}, &step); }, "numel");
  expect_invalid_argument([&] { host::adamw(good, {fine}, nullptr); }, "step");
  expect_invalid_argument([&] { host::adamw(with([](auto& h) { h.beta1 = 1.0f; }), {fine}, &step); }, "beta1");
  EXPECT_EQ(step, 0);
  EXPECT_EQ(w, std::vector<float>(8, 1.0f));
  host::adamw(good, {fine, AdamWTensor{}}, &step);  // an empty tensor may have null pointers
  EXPECT_EQ(step, 1);
}

// ------------------------------------------------------- argument checks (CPU)

TEST(AdamWTable, MisalignedOrNullPointers_AreErrors_EmptyTensorsAreFine) {
  alignas(16) static float w[64], g[64], m[64], v[64];
  alignas(16) static std::uint16_t copy[64];
  std::vector<std::byte> table(4096);
  const AdamWTensor fine{w, g, m, v, copy, 64};
  EXPECT_NO_THROW(build_adamw_table({fine, AdamWTensor{}}, table.data()));
  const auto build = [&](AdamWTensor t) { build_adamw_table({fine, t}, table.data()); };
  expect_invalid_argument([&] { build({w + 1, g, m, v, nullptr, 8}); }, "not 16-byte aligned");
  expect_invalid_argument([&] { build({w, g + 2, m, v, nullptr, 8}); }, "not 16-byte aligned");
  expect_invalid_argument([&] { build({w, g, m, v + 3, nullptr, 8}); }, "not 16-byte aligned");
  expect_invalid_argument([&] { build({w, g, m, v, copy + 4, 8}); }, "its copy");
  expect_invalid_argument([&] { build({w, g, nullptr, v, nullptr, 8}); }, "null");
  expect_invalid_argument([&] { build({w, g, m, v, nullptr, -5}); }, "numel");
  expect_invalid_argument([&] { build_adamw_table({fine}, nullptr); }, "table_host");
  expect_invalid_argument([&] { (void)adamw_table_bytes({fine, AdamWTensor{w, g, m, v, nullptr, -1}}); }, "numel");

  // The table grows with the chunks the tensors start, not with each element.
  const auto bytes = [&](std::int64_t n) { return adamw_table_bytes({AdamWTensor{w, g, m, v, nullptr, n}}); };
  EXPECT_EQ(bytes(2), bytes(1));
  EXPECT_GT(bytes(1), bytes(0));
  EXPECT_GT(bytes(std::int64_t{1} << 30), bytes(1));
}

TEST(AdamWLaunch, BadArgumentsAreErrorsBeforeAnyLaunch) {
  // Host memory stands in for device memory: every case fails its checks first.
  alignas(16) static std::byte table[256];
  alignas(16) static std::int64_t step[2];
  const AdamWHyper good;
  AdamWHyper bad = good;
  bad.beta1 = 1.5f;
  expect_invalid_argument([&] { launch_adamw(good, table, 1, 8, nullptr, nullptr); }, "step is null");
  expect_invalid_argument([&] { launch_adamw(good, table, 1, 8, reinterpret_cast<std::int64_t*>(table + 4), nullptr); },
                          "step at");
  expect_invalid_argument([&] { launch_adamw(good, nullptr, 1, 8, step, nullptr); }, "table_device is null");
  expect_invalid_argument([&] { launch_adamw(good, table + 8, 1, 8, step, nullptr); }, "table_device at");
  expect_invalid_argument([&] { launch_adamw(good, table, -1, 8, step, nullptr); }, "tensor_count");
  expect_invalid_argument([&] { launch_adamw(good, table, 1, -8, step, nullptr); }, "total_numel");
  expect_invalid_argument([&] { launch_adamw(good, table, 0, 8, step, nullptr); }, "tensor_count is 0");
  expect_invalid_argument([&] { launch_adamw(bad, table, 1, 8, step, nullptr); }, "beta1");
}

// ------------------------------------------------------------- device (GPU)

template <typename T>
void upload(void* device, const std::vector<T>& host) {
  SG_CUDA_CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  SG_CUDA_CHECK(cudaDeviceSynchronize());  // pageable copy; our streams do not wait for it
}

template <typename T>
std::vector<T> download(const void* device, std::size_t n) {
  SG_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> host(n);
  SG_CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// Device buffers of one packed layout and its uploaded table.
struct DeviceState {
  testing::DeviceArray w, g, m, v, copy, step, table;

  DeviceState(const Layout& layout, const State& s)
      : w(layout.f32_total * 4),
        g(layout.f32_total * 4),
        m(layout.f32_total * 4),
        v(layout.f32_total * 4),
        copy(layout.bf16_total * 2),
        step(8),
        table(adamw_table_bytes(tensors(layout))) {
    upload(w.get(), s.w);
    upload(m.get(), s.m);
    upload(v.get(), s.v);
    copy.poison();
    upload(step.get(), std::vector<std::int64_t>{s.step});
    std::vector<std::byte> host_table(table.bytes());
    build_adamw_table(tensors(layout), host_table.data());
    upload(table.get(), host_table);
  }
  std::vector<AdamWTensor> tensors(const Layout& layout) const {
    return layout.tensors(w.as<float>(), g.as<float>(), m.as<float>(), v.as<float>(), copy.as<std::uint16_t>());
  }
  void launch(const AdamWHyper& hyper, const Layout& layout, cudaStream_t stream) const {
    launch_adamw(hyper, table.get(), layout.count(), layout.total_numel, step.as<std::int64_t>(), stream);
  }
  State download_state(const Layout& layout) const {
    return {download<float>(w.get(), layout.f32_total), download<float>(m.get(), layout.f32_total),
            download<float>(v.get(), layout.f32_total), download<std::uint16_t>(copy.get(), layout.bf16_total),
            download<std::int64_t>(step.get(), 1)[0]};
  }
};

// One launch per step over fresh buffers, a new gradient before each.
State run_device(const AdamWHyper& hyper, const Layout& layout, const State& start,
                 const std::vector<std::vector<float>>& grads) {
  DeviceState d(layout, start);
  Stream stream;
  for (const std::vector<float>& g : grads) {
    upload(d.g.get(), g);
    d.launch(hyper, layout, stream.get());
    stream.synchronize();
  }
  return d.download_state(layout);
}

void expect_device_matches_host(const Layout& layout, const State& got, const State& want) {
  EXPECT_EQ(got.step, want.step);
  for (std::int64_t i = 0; i < layout.count(); ++i) {
    const std::int64_t offset = layout.f32_offset[i];
    const std::int64_t n = layout.numel[i];
    if (n == 0) continue;
    const std::string what = "tensor " + std::to_string(i) + " (" + std::to_string(n) + " elements)";
    EXPECT_LE(relative_error(region(got.w, offset, n), region(want.w, offset, n)), 1e-6) << "w of " << what;
    EXPECT_LE(relative_error(region(got.m, offset, n), region(want.m, offset, n)), 1e-6) << "m of " << what;
    EXPECT_LE(relative_error(region(got.v, offset, n), region(want.v, offset, n)), 1e-6) << "v of " << what;
    if (layout.bf16_offset[i] < 0) continue;
    std::int64_t bad = 0;
    for (std::int64_t j = 0; j < n; ++j) bad += got.copy[layout.bf16_offset[i] + j] != layout.copy_of(got.w[offset + j]);
    EXPECT_EQ(bad, 0) << "copy elements of " << what << " that are not " << (layout.fp16 ? "fp16" : "bf16") << "(w)";
  }
  std::int64_t gaps_written = 0;
  for (std::int64_t i = 0; i < layout.f32_total; ++i) {
    if (layout.in_tensor(i)) continue;
    gaps_written += got.w[i] != kSentinel || got.m[i] != kSentinel || got.v[i] != kSentinel;
  }
  EXPECT_EQ(gaps_written, 0) << "fp32 elements between tensors written";
  std::vector<bool> in_copy(layout.bf16_total, false);
  for (std::int64_t i = 0; i < layout.count(); ++i) {
    for (std::int64_t j = 0; layout.bf16_offset[i] >= 0 && j < layout.numel[i]; ++j)
      in_copy[layout.bf16_offset[i] + j] = true;
  }
  std::int64_t copy_gaps_written = 0;
  for (std::int64_t i = 0; i < layout.bf16_total; ++i) copy_gaps_written += !in_copy[i] && got.copy[i] != kPoisonBf16;
  EXPECT_EQ(copy_gaps_written, 0) << "bf16 elements between copies written";
}

const AdamWHyper kTypical{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};

TEST(AdamWDevice, Fp32_Sizes1_7_0_4097_1M_Packed_OneLaunch_FiveSteps_MatchHost_Deterministic) {
  SG_SKIP_WITHOUT_GPU();
  // Tensor 1 (7 elements) has no bf16 copy; tensor 2 is empty.
  const Layout layout({1, 7, 0, 4097, 1 << 20}, {true, false, true, true, true});
  testing::SeededRng rng;
  const State start = initial_state(layout, rng);
  const auto grads = random_grads(layout, 5, rng);
  const State got = run_device(kTypical, layout, start, grads);
  expect_device_matches_host(layout, got, run_host(kTypical, layout, start, grads));
  EXPECT_EQ(got.step, 5);

  const State again = run_device(kTypical, layout, start, grads);
  EXPECT_TRUE(got.w == again.w && got.m == again.m && got.v == again.v && got.copy == again.copy)
      << "two runs from the same state differ";
}

// fp16 parameters' copies are fp16 bits (a bf16 copy written into fp16
// storage would be another number), on the device as on the host.
TEST(AdamWDevice, Fp16Copies_Sizes1_7_4097_ThreeSteps_MatchHost) {
  SG_SKIP_WITHOUT_GPU();
  Layout layout({1, 7, 4097}, {true, false, true});
  layout.fp16 = true;
  testing::SeededRng rng;
  const State start = initial_state(layout, rng);
  const auto grads = random_grads(layout, 3, rng);
  expect_device_matches_host(layout, run_device(kTypical, layout, start, grads),
                             run_host(kTypical, layout, start, grads));
}

TEST(AdamWDevice, Fp32_Sizes7_4097_CapturedStep_ReplayedFiveTimes_AdvancesStepAndMatchesHost) {
  SG_SKIP_WITHOUT_GPU();
  const Layout layout({7, 4097}, {true, true});
  testing::SeededRng rng;
  const State start = initial_state(layout, rng);
  const std::vector<float> grad = random_grads(layout, 1, rng)[0];

  DeviceState d(layout, start);
  upload(d.g.get(), grad);
  Stream stream;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  SG_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  d.launch(kTypical, layout, stream.get());
  SG_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  SG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 5; ++replay) SG_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
  stream.synchronize();
  SG_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SG_CUDA_CHECK(cudaGraphDestroy(graph));

  const State got = d.download_state(layout);
  EXPECT_EQ(got.step, 5);
  expect_device_matches_host(layout, got, run_host(kTypical, layout, start, std::vector<std::vector<float>>(5, grad)));
}

TEST(AdamWDevice, NoElements_StepStillAdvances) {
  SG_SKIP_WITHOUT_GPU();
  testing::DeviceArray step(8);
  upload(step.get(), std::vector<std::int64_t>{41});
  Stream stream;
  launch_adamw(kTypical, nullptr, 0, 0, step.as<std::int64_t>(), stream.get());
  launch_adamw(kTypical, nullptr, 2, 0, step.as<std::int64_t>(), stream.get());  // two empty tensors
  stream.synchronize();
  EXPECT_EQ(download<std::int64_t>(step.get(), 1)[0], 43);
}

}  // namespace
}  // namespace stepgraph::kernels
