// Central finite differences of a layer's loss L = sum(y * r) (r random, so
// dL/dy = r) against its analytic gradients, on the host in fp32, with fresh
// random inputs each run. Shared by every layer gradient test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/context.h"
#include "tests/support/seed.h"

namespace stepgraph::testing {

class GradientCheck {
 public:
  explicit GradientCheck(Context& ctx) : ctx_(ctx), rng_() {}

  Tensor random_tensor(const std::string& name, const Shape& shape) {
    Tensor t = ctx_.persistent(name, {shape, DType::kFloat32});
    std::vector<float> values = random_values(shape.numel());
    ctx_.copy_from_host(t, values.data(), values.size() * sizeof(float));
    return t;
  }

  std::vector<float> random_values(std::int64_t n) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<float> out(static_cast<std::size_t>(n));
    for (float& v : out) v = uniform(rng_);
    return out;
  }

  // The loss of forward(), which returns y; r is fixed per check.
  double loss(const std::function<Tensor()>& forward, const std::vector<float>& r) {
    const std::vector<float> y = ctx_.to_vector<float>(forward());
    double total = 0.0;
    for (std::size_t i = 0; i < y.size(); ++i) total += static_cast<double>(y[i]) * r[i];
    return total;
  }

  // Compares `analytic` (the gradient w.r.t. `tensor`) with central
  // differences of loss() at a few random elements of `tensor`. For a loss
  // that is only piecewise smooth (e.g. a top-k choice), `same_piece` says
  // whether the last forward stayed on the piece of the unperturbed one; a
  // trial where it did not is drawn again.
  void expect_matches(const std::string& what, const Tensor& tensor, const std::vector<float>& analytic,
                      const std::function<Tensor()>& forward, const std::vector<float>& r,
                      const std::function<bool()>& same_piece = {}, float step = 1e-2f) {
    std::vector<float> values = ctx_.to_vector<float>(tensor);
    ASSERT_EQ(values.size(), analytic.size()) << what;
    std::uniform_int_distribution<std::size_t> pick(0, values.size() - 1);
    int checked = 0;
    for (int attempt = 0; attempt < 60 && checked < 6; ++attempt) {
      const std::size_t i = pick(rng_);
      const float saved = values[i];
      values[i] = saved + step;
      ctx_.copy_from_host(tensor, values.data(), values.size() * sizeof(float));
      const double up = loss(forward, r);
      const bool up_same = !same_piece || same_piece();
      values[i] = saved - step;
      ctx_.copy_from_host(tensor, values.data(), values.size() * sizeof(float));
      const double down = loss(forward, r);
      const bool down_same = !same_piece || same_piece();
      values[i] = saved;
      ctx_.copy_from_host(tensor, values.data(), values.size() * sizeof(float));
      if (!up_same || !down_same) continue;
      ++checked;
      const double numeric = (up - down) / (2.0 * step);
      EXPECT_NEAR(analytic[i], numeric, 2e-2 * std::max(1.0, std::fabs(numeric)))
          << what << "[" << i << "]: analytic " << analytic[i] << ", finite difference " << numeric;
    }
    EXPECT_GE(checked, 3) << what << ": too few perturbations kept the piece; the check checked little";
  }

  Context& ctx() { return ctx_; }
  std::mt19937& rng() { return rng_; }

 private:
  Context& ctx_;
  SeededRng rng_;  // failures print its seed (tests/support/seed.h)
};

}  // namespace stepgraph::testing
