// MoE load-balancing kernels (kernels/moe_balance.h) and the biased router
// top-k. Host: the aux loss against the formula in double, its d logits
// against central differences of that formula (the splits held: f has no
// gradient) times the loss's factors, the bias update's +-rate by load, and
// the biased choice with unbiased gates. GPU: every kernel against its host
// reference. fp32 logits, tiny sizes; the seed is printed on failure.
#include "kernels/moe_balance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/cuda_check.h"
#include "engine/stream.h"
#include "kernels/moe_routing.h"
#include "tests/kernels/kernel_test_support.h"
#include "tests/support/gpu.h"
#include "tests/support/seed.h"

namespace stepgraph::kernels {
namespace {

using Ints = std::vector<std::int32_t>;

std::vector<float> random_logits(std::int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> out(static_cast<std::size_t>(n));
  for (float& v : out) v = u(rng);
  return out;
}

// The formula, in double: coef E sum_e (splits_e / (T k)) (1/T) sum_t softmax(l_t)_e.
double aux_formula(const std::vector<double>& logits, const Ints& splits, std::int64_t T, std::int64_t E, int k,
                   double coef) {
  std::vector<double> P(static_cast<std::size_t>(E), 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    double max = -INFINITY, sum = 0.0;
    for (std::int64_t e = 0; e < E; ++e) max = std::max(max, logits[t * E + e]);
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(logits[t * E + e] - max);
    for (std::int64_t e = 0; e < E; ++e) P[e] += std::exp(logits[t * E + e] - max) / sum / T;
  }
  double aux = 0.0;
  for (std::int64_t e = 0; e < E; ++e) aux += splits[e] / static_cast<double>(T * k) * P[e];
  return coef * E * aux;
}

// The splits of the unbiased top-k choice of `logits`.
Ints routed_splits(const std::vector<float>& logits, std::int64_t T, std::int64_t E, int k) {
  Ints experts(static_cast<std::size_t>(T * k));
  std::vector<float> gates(static_cast<std::size_t>(T * k));
  host::router_topk({DType::kFloat32, T, E, k}, logits.data(), experts.data(), gates.data());
  Ints splits(static_cast<std::size_t>(E), 0);
  for (std::int32_t e : experts) ++splits[e];
  return splits;
}

TEST(MoEBalanceHostTest, AuxLossMatchesTheFormula) {
  testing::SeededRng rng;
  for (const int k : {1, 2}) {
    constexpr std::int64_t T = 13, E = 5;
    const std::vector<float> logits = random_logits(T * E, rng);
    const Ints splits = routed_splits(logits, T, E, k);
    float aux = -1.0f;
    host::router_aux_loss({DType::kFloat32, T, E, k, 0.01f}, logits.data(), splits.data(), &aux);
    const double want = aux_formula(std::vector<double>(logits.begin(), logits.end()), splits, T, E, k, 0.01);
    EXPECT_NEAR(aux, want, 1e-6 * want) << "k=" << k;
    // Balanced routing with uniform probabilities gives coef exactly: f_e = P_e = 1/E.
    const std::vector<float> flat(static_cast<std::size_t>(4 * E), 0.5f);
    Ints whole(static_cast<std::size_t>(E), 0);
    whole[0] = 4 * k;
    host::router_aux_loss({DType::kFloat32, 4, E, k, 0.5f}, flat.data(), whole.data(), &aux);
    EXPECT_NEAR(aux, 0.5f, 1e-6f) << "uniform probabilities, k=" << k;
  }
}

TEST(MoEBalanceHostTest, AuxLossGradientMatchesCentralDifferencesTimesTheLossFactors) {
  testing::SeededRng rng;
  for (const int k : {1, 2}) {
    constexpr std::int64_t T = 7, E = 6;
    constexpr double kCoef = 0.3;
    const std::vector<float> logits = random_logits(T * E, rng);
    const Ints splits = routed_splits(logits, T, E, k);
    const std::vector<float> dlogits_in = random_logits(T * E, rng);
    const float loss_scale[3] = {4.0f, 0.25f, 0.0f};
    constexpr float kFactor = 0.5f;  // 1/N over two data-parallel ranks
    std::vector<float> out(static_cast<std::size_t>(T * E));
    host::router_aux_loss_backward({DType::kFloat32, T, E, k, static_cast<float>(kCoef)}, kFactor, logits.data(),
                                   splits.data(), loss_scale, dlogits_in.data(), out.data());
    const std::vector<double> base(logits.begin(), logits.end());
    for (std::int64_t i = 0; i < T * E; ++i) {
      std::vector<double> plus = base, minus = base;
      constexpr double kStep = 1e-4;
      plus[i] += kStep;
      minus[i] -= kStep;
      const double fd = (aux_formula(plus, splits, T, E, k, kCoef) - aux_formula(minus, splits, T, E, k, kCoef)) /
                        (2 * kStep);
      const double want = dlogits_in[i] + kFactor * loss_scale[0] * fd;
      EXPECT_NEAR(out[i], want, 1e-5 + 1e-4 * std::fabs(want)) << "k=" << k << " element " << i;
    }
    // In place (dlogits_out = dlogits_in) gives the same values.
    std::vector<float> in_place = dlogits_in;
    host::router_aux_loss_backward({DType::kFloat32, T, E, k, static_cast<float>(kCoef)}, kFactor, logits.data(),
                                   splits.data(), loss_scale, in_place.data(), in_place.data());
    EXPECT_EQ(in_place, out);
  }
}

TEST(MoEBalanceHostTest, BiasFallsForOverloadedExpertsAndRisesForUnderloadedOnes) {
  // 4 experts, 40 assignments: mean 10. Expert 0 over, 1 at the mean, 2 and 3 under.
  const Ints counts{22, 10, 8, 0};
  std::vector<float> bias{0.25f, -0.5f, 0.0f, 1.0f};
  constexpr float kRate = 0.125f;
  host::expert_bias_update(4, kRate, counts.data(), bias.data());
  EXPECT_EQ(bias, (std::vector<float>{0.25f - kRate, -0.5f, kRate, 1.0f + kRate}));
  // A mean that is not an integer: 3 experts, 10 assignments (mean 3.33...).
  const Ints uneven{4, 3, 3};
  std::vector<float> b3(3, 0.0f);
  host::expert_bias_update(3, 1.0f, uneven.data(), b3.data());
  EXPECT_EQ(b3, (std::vector<float>{-1.0f, 1.0f, 1.0f}));
}

TEST(MoEBalanceHostTest, BiasSteersTheChoiceButNotTheGates) {
  constexpr std::int64_t T = 3, E = 4;
  // Every token prefers expert 0, then 1.
  const std::vector<float> logits{2.0f, 1.0f, 0.0f, -1.0f,  //
                                  3.0f, 0.5f, 0.2f, 0.1f,   //
                                  1.5f, 1.4f, -2.0f, 0.0f};
  const std::vector<float> bias{-10.0f, 0.0f, 0.0f, 5.0f};  // expert 0 never, expert 3 always first
  for (const int k : {1, 2}) {
    Ints experts(T * k);
    std::vector<float> gates(T * k);
    host::router_topk({DType::kFloat32, T, E, k}, logits.data(), experts.data(), gates.data(), bias.data());
    for (std::int64_t t = 0; t < T; ++t) {
      const float* l = logits.data() + t * E;
      EXPECT_EQ(experts[t * k], 3) << "token " << t << " k=" << k;
      if (k == 2) {
        EXPECT_EQ(experts[t * k + 1], 1) << "token " << t;
      }
      double sum = 0.0;
      for (std::int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e]));
      if (k == 1) {
        EXPECT_NEAR(gates[t], std::exp(l[3]) / sum, 1e-6) << "the full softmax of the unbiased logit, token " << t;
      } else {
        const double z = std::exp(static_cast<double>(l[3])) + std::exp(static_cast<double>(l[1]));
        EXPECT_NEAR(gates[2 * t], std::exp(l[3]) / z, 1e-6) << "token " << t;
        EXPECT_NEAR(gates[2 * t + 1], std::exp(l[1]) / z, 1e-6) << "token " << t;
      }
    }
  }
}

// ---- GPU ----

template <typename T>
std::vector<T> download(const testing::DeviceArray& array, std::size_t n) {
  std::vector<T> out(n);
  SG_CUDA_CHECK(cudaDeviceSynchronize());
  SG_CUDA_CHECK(cudaMemcpy(out.data(), array.get(), n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

template <typename T>
void upload(testing::DeviceArray& array, const std::vector<T>& values) {
  SG_CUDA_CHECK(cudaMemcpy(array.get(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  SG_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(MoEBalanceCudaTest, KernelsMatchTheHostReferences) {
  SG_SKIP_WITHOUT_GPU();
  testing::SeededRng rng;
  Stream stream;
  for (const int k : {1, 2}) {
    constexpr std::int64_t T = 3000, E = 64;  // more tokens than the aux kernel's warps, experts over a warp
    const std::vector<float> logits = random_logits(T * E, rng);
    std::vector<float> bias = random_logits(E, rng);
    Ints experts(T * k), got_experts(T * k);
    std::vector<float> gates(T * k);
    host::router_topk({DType::kFloat32, T, E, k}, logits.data(), experts.data(), gates.data(), bias.data());
    Ints splits(E, 0);
    for (std::int32_t e : experts) ++splits[e];
    testing::DeviceArray d_logits(T * E * 4), d_bias(E * 4), d_experts(T * k * 4), d_gates(T * k * 4),
        d_splits(E * 4), d_aux(4), d_din(T * E * 4), d_dout(T * E * 4), d_scale(12);
    upload(d_logits, logits);
    upload(d_bias, bias);
    upload(d_splits, splits);
    launch_router_topk({DType::kFloat32, T, E, k}, d_logits.get(), d_experts.as<std::int32_t>(), d_gates.as<float>(),
                       stream.get(), d_bias.as<float>());
    EXPECT_EQ(download<std::int32_t>(d_experts, T * k), experts) << "k=" << k;
    EXPECT_LE(testing::relative_error(download<float>(d_gates, T * k), gates), 1e-5) << "k=" << k;

    const AuxLossDesc desc{DType::kFloat32, T, E, k, 0.01f};
    float want_aux = 0.0f;
    host::router_aux_loss(desc, logits.data(), splits.data(), &want_aux);
    launch_router_aux_loss(desc, d_logits.get(), d_splits.as<std::int32_t>(), d_aux.as<float>(), stream.get());
    EXPECT_NEAR(download<float>(d_aux, 1)[0], want_aux, 1e-5 * want_aux) << "k=" << k;

    const std::vector<float> din = random_logits(T * E, rng);
    const std::vector<float> scale{8.0f, 0.125f, 0.0f};
    std::vector<float> want(T * E);
    host::router_aux_loss_backward(desc, 0.5f, logits.data(), splits.data(), scale.data(), din.data(), want.data());
    upload(d_din, din);
    upload(d_scale, scale);
    launch_router_aux_loss_backward(desc, 0.5f, d_logits.get(), d_splits.as<std::int32_t>(), d_scale.as<float>(),
                                    d_din.get(), d_dout.get(), stream.get());
    EXPECT_LE(testing::relative_error(download<float>(d_dout, T * E), want), 1e-5) << "k=" << k;

    std::vector<float> want_bias = bias;
    host::expert_bias_update(E, 1e-3f, splits.data(), want_bias.data());
    launch_expert_bias_update(E, 1e-3f, d_splits.as<std::int32_t>(), d_bias.as<float>(), stream.get());
    EXPECT_EQ(download<float>(d_bias, E), want_bias) << "k=" << k;
  }
}

}  // namespace
}  // namespace stepgraph::kernels
