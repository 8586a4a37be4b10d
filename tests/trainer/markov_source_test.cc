#include "trainer/markov_source.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/error.h"
#include "tests/support/expect_error.h"

namespace stepgraph::trainer {
namespace {

// The stationary distribution by a direct solve of pi (P - I) = 0 with
// sum(pi) = 1: Gaussian elimination with partial pivoting on the states x
// states system (small configs only).
std::vector<double> solve_stationary(const MarkovSource& source) {
  const std::int64_t n = source.states();
  const std::int64_t v = source.vocab();
  // a[i][j]: equation i (next state i), unknown j (pi of state j).
  std::vector<std::vector<double>> a(n, std::vector<double>(n + 1, 0.0));
  for (std::int64_t s = 0; s < n; ++s) {
    a[s][s] -= 1.0;
    for (std::int64_t x = 0; x < v; ++x) {
      a[source.next_state(s, static_cast<std::int32_t>(x))][s] += source.probability(s, static_cast<std::int32_t>(x));
    }
  }
  // The equations are dependent: replace the last by the normalization.
  for (std::int64_t j = 0; j < n; ++j) a[n - 1][j] = 1.0;
  a[n - 1][n] = 1.0;
  for (std::int64_t col = 0; col < n; ++col) {
    std::int64_t pivot = col;
    for (std::int64_t r = col + 1; r < n; ++r) {
      if (std::abs(a[r][col]) > std::abs(a[pivot][col])) pivot = r;
    }
    std::swap(a[col], a[pivot]);
    for (std::int64_t r = 0; r < n; ++r) {
      if (r == col) continue;
      const double factor = a[r][col] / a[col][col];
      for (std::int64_t c = col; c <= n; ++c) a[r][c] -= factor * a[col][c];
    }
  }
  std::vector<double> pi(n);
  for (std::int64_t s = 0; s < n; ++s) pi[s] = a[s][n] / a[s][s];
  return pi;
}

double entropy_rate_from(const MarkovSource& source, const std::vector<double>& pi) {
  double entropy = 0;
  for (std::int64_t s = 0; s < source.states(); ++s) {
    for (std::int32_t x = 0; x < source.vocab(); ++x) {
      const double p = source.probability(s, x);
      entropy -= pi[s] * p * std::log(p);
    }
  }
  return entropy;
}

// The state (last `order` tokens) at the end of a window.
std::int64_t state_of(const std::int32_t* window_end, std::int64_t order, std::int64_t vocab) {
  std::int64_t state = 0;
  for (std::int64_t i = order; i >= 1; --i) state = state * vocab + window_end[-i];
  return state;
}

TEST(MarkovSourceTest, StationaryMatchesDirectSolve) {
  struct Case {
    MarkovConfig config;
    double l1_tolerance;  // see Note [Stationary error bound]
  };
  for (const Case& c : {Case{MarkovConfig{.vocab = 3, .order = 2, .seed = 7}, 1e-12},
                        Case{MarkovConfig{.vocab = 16, .order = 2}, 1e-12},  // the default
                        Case{MarkovConfig{.vocab = 5, .order = 3, .seed = 1, .concentration = 0.1}, 1e-12},
                        Case{MarkovConfig{.vocab = 4, .order = 1, .seed = 3, .smoothing = 1e-3}, 1e-12},
                        // Mixes slowly: round-off limits the power iteration.
                        Case{MarkovConfig{.vocab = 8, .order = 3, .concentration = 0.05, .smoothing = 1e-4}, 1e-10}}) {
    const MarkovSource source(c.config);
    const std::vector<double> pi = solve_stationary(source);
    ASSERT_EQ(source.stationary().size(), pi.size());
    double total = 0, l1 = 0;
    for (std::size_t s = 0; s < pi.size(); ++s) {
      l1 += std::abs(source.stationary()[s] - pi[s]);
      total += source.stationary()[s];
    }
    EXPECT_LT(l1, c.l1_tolerance) << source.describe();
    EXPECT_NEAR(total, 1.0, 1e-12);
    EXPECT_NEAR(*source.entropy_rate(), entropy_rate_from(source, pi), 10 * c.l1_tolerance);
  }
}

TEST(MarkovSourceTest, RowsAreDistributionsWellBelowUniform) {
  const MarkovSource source(MarkovConfig{});
  for (std::int64_t s = 0; s < source.states(); ++s) {
    double total = 0;
    for (std::int32_t x = 0; x < source.vocab(); ++x) {
      EXPECT_GT(source.probability(s, x), 0.0);
      total += source.probability(s, x);
    }
    EXPECT_NEAR(total, 1.0, 1e-12);
  }
  // Learnable: the floor is far below log V (a uniform guess).
  EXPECT_LT(*source.entropy_rate(), std::log(16.0) - 0.5);
  EXPECT_GT(*source.entropy_rate(), 0.1);
}

// The labels' mean surprisal under the true table estimates the entropy
// rate; the windows' end states are distributed by pi. Both check that the
// examples are stationary samples.
TEST(MarkovSourceTest, SamplesMatchEntropyRateAndStationaryDistribution) {
  MarkovSource source(MarkovConfig{.seed = 11});
  const std::int64_t order = source.config().order;
  // context == order: each window is exactly the start state, so its
  // distribution is tested directly, not after the chain has mixed.
  const std::int64_t batch = 512, context = order, batches = 100;
  std::vector<double> visits(source.states(), 0.0);
  double sum = 0, sum_squares = 0;
  Batch out;
  for (std::int64_t b = 0; b < batches; ++b) {
    source.next_batch(batch, context, out);
    for (std::int64_t r = 0; r < batch; ++r) {
      const std::int64_t state = state_of(out.windows.data() + (r + 1) * context, order, source.vocab());
      visits[state] += 1;
      const double surprisal = -std::log(source.probability(state, out.labels[r]));
      sum += surprisal;
      sum_squares += surprisal * surprisal;
    }
  }
  const double n = static_cast<double>(batch * batches);
  const double mean = sum / n;
  const double standard_error = std::sqrt((sum_squares / n - mean * mean) / n);
  EXPECT_NEAR(mean, *source.entropy_rate(), 5 * standard_error) << "standard error " << standard_error;
  for (std::int64_t s = 0; s < source.states(); ++s) {
    const double p = source.stationary()[s];
    EXPECT_NEAR(visits[s] / n, p, 5 * std::sqrt(p * (1 - p) / n) + 1e-9) << "state " << s;
  }
}

TEST(MarkovSourceTest, ConditionalEntropyBelowOrderIsAboveTheRate) {
  const MarkovSource source(MarkovConfig{.vocab = 8, .order = 3, .seed = 5});
  const double rate = *source.entropy_rate();
  EXPECT_DOUBLE_EQ(source.conditional_entropy(3), rate);
  EXPECT_DOUBLE_EQ(source.conditional_entropy(10), rate);
  double previous = std::log(8.0) + 1e-12;
  for (std::int64_t context = 0; context <= 3; ++context) {
    const double entropy = source.conditional_entropy(context);
    EXPECT_LE(entropy, previous) << "context " << context;
    previous = entropy;
  }
  EXPECT_GT(source.conditional_entropy(2), rate + 1e-3);
}

TEST(MarkovSourceTest, DescribeSaysTheFloorIsUnreachableBelowTheOrder) {
  const MarkovSource short_window(MarkovConfig{.order = 3, .context = 2});
  EXPECT_NE(short_window.describe().find("not reachable"), std::string::npos) << short_window.describe();
  const MarkovSource long_window(MarkovConfig{.order = 3, .context = 8});
  EXPECT_EQ(long_window.describe().find("not reachable"), std::string::npos) << long_window.describe();
  EXPECT_NE(long_window.describe().find("entropy rate"), std::string::npos);
}

TEST(MarkovSourceTest, SameSeedSameBatchesOtherSeedOthers) {
  auto a = make_markov_source(MarkovConfig{.seed = 3});
  auto b = make_markov_source(MarkovConfig{.seed = 3});
  auto c = make_markov_source(MarkovConfig{.seed = 4});
  Batch x, y, z;
  for (int step = 0; step < 5; ++step) {
    a->next_batch(16, 8, x);
    b->next_batch(16, 8, y);
    c->next_batch(16, 8, z);
    EXPECT_EQ(x.windows, y.windows);
    EXPECT_EQ(x.labels, y.labels);
    EXPECT_NE(x.windows, z.windows);
  }
  EXPECT_EQ(*a->entropy_rate(), *b->entropy_rate());
  EXPECT_NE(*a->entropy_rate(), *c->entropy_rate());
}

TEST(MarkovSourceTest, SeekResumesExactly) {
  auto straight = make_markov_source(MarkovConfig{});
  Batch expected, resumed;
  for (int step = 0; step < 6; ++step) straight->next_batch(32, 10, expected);
  EXPECT_EQ(straight->position(), 6u);
  auto restarted = make_markov_source(MarkovConfig{});
  restarted->seek(5);
  restarted->next_batch(32, 10, resumed);
  EXPECT_EQ(resumed.windows, expected.windows);
  EXPECT_EQ(resumed.labels, expected.labels);
  EXPECT_EQ(restarted->position(), 6u);
  // A batch differs from its neighbour.
  restarted->next_batch(32, 10, resumed);
  EXPECT_NE(resumed.windows, expected.windows);
}

TEST(MarkovSourceTest, RowsDoNotDependOnTheBatchSize) {
  auto small = make_markov_source(MarkovConfig{});
  auto large = make_markov_source(MarkovConfig{});
  Batch a, b;
  small->next_batch(4, 5, a);
  large->next_batch(9, 5, b);
  ASSERT_EQ(a.windows.size(), 20u);
  ASSERT_EQ(b.windows.size(), 45u);
  EXPECT_TRUE(std::equal(a.windows.begin(), a.windows.end(), b.windows.begin()));
  EXPECT_TRUE(std::equal(a.labels.begin(), a.labels.end(), b.labels.begin()));
}

TEST(MarkovSourceTest, ContextShorterThanOrderGivesTheLastTokens) {
  auto source = make_markov_source(MarkovConfig{.vocab = 5, .order = 3});
  Batch out;
  source->next_batch(64, 1, out);
  ASSERT_EQ(out.windows.size(), 64u);
  ASSERT_EQ(out.labels.size(), 64u);
  for (std::int32_t token : out.windows) EXPECT_TRUE(token >= 0 && token < 5);
  for (std::int32_t token : out.labels) EXPECT_TRUE(token >= 0 && token < 5);
}

TEST(MarkovSourceTest, BadConfigsAndArgumentsAreClearErrors) {
  auto expect_invalid = [](const MarkovConfig& config, const char* words) {
    try {
      MarkovSource source(config);
      ADD_FAILURE() << "no error for " << words;
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(error.message().find(words), std::string::npos) << error.message();
    }
  };
  expect_invalid(MarkovConfig{.vocab = 1}, "vocab");
  expect_invalid(MarkovConfig{.order = 0}, "order");
  expect_invalid(MarkovConfig{.vocab = 256, .order = 3}, "table limit");
  expect_invalid(MarkovConfig{.concentration = 0}, "concentration");
  expect_invalid(MarkovConfig{.smoothing = 0}, "smoothing");
  expect_invalid(MarkovConfig{.context = -1}, "context");
  auto source = make_markov_source(MarkovConfig{});
  Batch out;
  EXPECT_ERROR_CONTAINS(source->next_batch(0, 4, out), "next_batch: batch must be >= 1, got 0");
  EXPECT_ERROR_CONTAINS(source->next_batch(4, 0, out), "next_batch: context must be >= 1, got 0");
  EXPECT_EQ(source->position(), 0u);
}

}  // namespace
}  // namespace stepgraph::trainer
